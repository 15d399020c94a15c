"""The validated config: composition, recipes, and one-line errors for bad overrides."""

from __future__ import annotations


import pytest

from qwenft.cli.compose import validate
from qwenft.resources import available_recipes
from qwenft.config import ALL_TARGETS, ConfigError
from qwenft.cli.compose import register_resolvers
from tests.conftest import ROOT, compose_config, qwenft_in_process, run_main, run_qwenft


def test_defaults_compose():
    config = compose_config()
    assert config.command == "train"
    assert config.model.source == "embedded"
    assert config.quant.method == "nf4" and config.quant.double_quant and config.quant.compute_dtype == "auto"
    assert config.lora.target_modules == ALL_TARGETS
    assert [s.weight for s in config.data.sources] == [0.8, 0.2]


def test_group_options_and_overrides():
    config = compose_config("model=tiny-random", "quant=none", "lora.r=8", "train.lr=1e-3")
    assert config.model.source == "tiny-random" and config.quant.method == "none"
    assert config.lora.r == 8 and config.train.lr == pytest.approx(1e-3)


@pytest.mark.parametrize("override, key", [
    ("lora.rank=8", "lora.rank"),
    ("train.lr=fast", "train.lr"),
    ("lora.r=0", "lora.r"),
    ("quant=nf3", "quant"),
    ("+lora.foo=1", "lora.foo"),
    ("lora.target_modules=[q_proj,qkv]", "lora.target_modules"),
    ("generate.top_p=1.5", "generate.top_p"),
    ("data.sources=[{name: a, path: x.jsonl, weight: -1}]", "weight"),
    ("model=gpt2", "model"),
    ("lora.alpha=8", "(did you mean lora.lora_alpha?)"),  # another tool's name: the intended key is named
    ("train.learning_rate=1e-4", "(did you mean train.lr?)"),
    ("+data.sources.0.wieght=1", "(did you mean data.sources[0].weight?)"),
    ("out_dir=a,b", "\"out_dir='a,b'\""),  # a comma outside -m: how to quote it
    ("inspect.layers=[]", "inspect.layers"),
    ("lr=1e-4", "(did you mean train.lr?)"),  # a bare key: the section holding it
    ("temperature=0.7", "(did you mean generate.temperature?)"),
    ("recipe=quickstart", "+recipe=quickstart"),
    ("generate.stop_strings=abc", "generate.stop_strings=[abc]"),  # one value for a list: how to write the list
    ("merge.gguf=q4_k_m", "'merge.quantize=[gguf-q4_k_m]'"),  # a 4-bit GGUF: where it is asked for
])
def test_bad_overrides_name_the_key(override, key):
    register_resolvers()
    with pytest.raises(ConfigError) as info:
        validate("train", [override])
    message = str(info.value)
    assert key in message and "\n" not in message


def test_multirun_grid_validates_every_point():
    register_resolvers()
    assert [c.lora.r for c in validate("train", ["lora.r=8,16"], multirun=True)] == [8, 16]
    with pytest.raises(ConfigError, match="lora.r"):
        validate("train", ["lora.r=8,0"], multirun=True)


def test_every_recipe_composes():
    recipes = available_recipes()
    assert recipes, "recipes/ has no recipe"
    for name in recipes:
        command = "eval" if name.endswith("_eval") else "train"  # an evaluation recipe trains on nothing
        try:
            config = compose_config(f"+recipe={name}", command=command)
        except ConfigError as exc:  # a recipe whose one key to set is the data file
            assert "data.sources.N.path=FILE" in str(exc), (name, str(exc))
            config = compose_config(f"+recipe={name}", f"data.sources.0.path={ROOT / 'data' / 'domain.jsonl'}",
                                    command=command)
        assert config.run_name == name, f"recipe {name} should set run_name: {name}"
        assert all(source.path for source in config.data.sources)


def test_help_lists_the_seven_commands():
    result = run_qwenft("--help")
    assert result.returncode == 0
    for command in ("train", "eval", "generate", "merge", "data", "inspect", "plan"):
        assert f"\n  {command} " in result.stdout


def test_command_help_leads_with_the_keys_it_reads():
    """`generate --help` (issue 27): the keys generate reads with their values, examples, and where the whole
    config is; not Hydra's 200-line config dump. `--cfg job` still prints the resolved config."""
    result = run_qwenft("generate", "--help", "generate.max_new_tokens=7")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("usage: python -m qwenft generate") and len(lines) < 40, result.stdout
    for key in ("prompt=null", "prompts_file=null", "out=null", "adapter=null", "generate.max_new_tokens=7"):
        assert any(line.strip().startswith(key) for line in lines), key
    assert "--cfg job" in result.stdout and "== Config ==" not in result.stdout
    dump = run_qwenft("generate", "--cfg", "job")
    assert dump.returncode == 0 and "max_new_tokens: 256" in dump.stdout and len(dump.stdout.splitlines()) > 100


def test_every_help_key_is_a_config_key():
    """Each command's --help lists keys of the config (no drift), with their composed values."""
    from omegaconf import OmegaConf

    from qwenft.cli.dispatch import COMMAND_TABLE
    from qwenft.config import COMMANDS
    from qwenft.cli.usage import COMMAND_KEYS, _values, command_help

    assert set(COMMAND_KEYS) == set(COMMANDS)
    base = OmegaConf.structured(compose_config())
    for command, keys in COMMAND_KEYS.items():
        for key, _ in keys:
            assert key == "+recipe" or OmegaConf.select(base, key, default="absent") != "absent", (command, key)
        assert command_help(command, COMMAND_TABLE[command][0]).count("\n  ") >= len(keys)
    assert _values("plan", ["model=qwen2.5-7b-instruct", "lora.r=64"])["model"] == "qwen2.5-7b-instruct"
    assert _values("plan", ["lora.r=64"])["lora.r"] == "64"


@pytest.mark.parametrize("override, key", [("lora.rank=8", "lora.rank"), ("train.lr=fast", "train.lr"),
                                           ("lora.r=0", "lora.r")])
def test_cli_bad_override_exits_2_with_one_line(override, key):
    result = run_qwenft("train", override)
    assert result.returncode == 2
    assert key in result.stderr
    assert result.stdout == ""  # WANDB_MODE=offline: transformers' "[INFO] Running in WANDB offline mode" dropped
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_unknown_recipe_lists_recipes():
    result = run_qwenft("train", "+recipe=nope")
    assert result.returncode == 2
    for name in available_recipes():
        assert name in result.stderr


def test_cli_unknown_command():
    result = run_qwenft("fly")
    assert result.returncode == 2 and "train" in result.stderr


def test_free_text_and_list_overrides_are_rewritten_for_hydra():
    from qwenft.cli.overrides import free_form

    assert free_form(["prompt=春天", "prompt=it's a, b", 'prompt="x"']) == [
        "prompt='春天'", "prompt='it\\'s a, b'", 'prompt="x"']
    assert free_form(["inspect.layers=0,12,23", "inspect.layers=[1]"]) == ["inspect.layers=[0,12,23]",
                                                                         "inspect.layers=[1]"]
    assert free_form(["data.sources.0.columns={instruction: q}", "lora.r=8"]) == [
        "++data.sources.0.columns={instruction: q}", "lora.r=8"]
    config = compose_config(*free_form(["prompt=春天, 夏天", "inspect.layers=0,1"]), command="inspect")
    assert config.prompt == "春天, 夏天" and config.inspect.layers == [0, 1]
    assert compose_config(*free_form(["inspect.layers=5"]), command="inspect").inspect.layers == [5]
    assert compose_config(*free_form(["lora.target_modules=q_proj,v_proj"])).lora.target_modules == ["q_proj", "v_proj"]
    assert compose_config(*free_form(["lora.target_modules=q_proj"])).lora.target_modules == ["q_proj"]
    # the lists of names and paths the docs show: one value (eval.bench_data=DIR, as $QWENFT_BENCH_DATA) or a comma list
    config = compose_config(*free_form(["eval.bench_data=/data/bench", "eval.benchmarks=mmlu,gsm8k",
                                        "merge.quantize=gguf-q4_k_m", "merge.gguf=f16"]), command="merge")
    assert config.eval.bench_data == ["/data/bench"] and config.eval.benchmarks == ["mmlu", "gsm8k"]
    assert config.merge.quantize == ["gguf-q4_k_m"]


@pytest.mark.parametrize("text", ["a\\b", "it's", "end\\", "x\\'y", "\\\\'", "a ${x} b", "${oc.env:HOME}",
                                  "$5 and \\$", "a\\${x}", "a\\\\${x}\\", "${a}${b}", "[1,2]", "{a: 1}", "  lead",
                                  "q=1, r=2"])
def test_free_text_composes_back_to_exactly_what_was_typed(text):
    """prompt= and data.system_prompt= are literal: no interpolation, backslashes and quotes as typed."""
    from qwenft.cli.overrides import free_form

    config = compose_config(*free_form([f"prompt={text}", f"data.system_prompt={text}"]), command="generate")
    assert config.prompt == text and config.data.system_prompt == text


def test_a_refused_run_removes_only_the_run_directory_it_created(tmp_path, capsys):
    empty = tmp_path / "mine"
    empty.mkdir()
    for out_dir, kept in ((empty, True), (tmp_path / "new", False)):
        result = qwenft_in_process(capsys, "eval", "model=tiny-random", f"out_dir={out_dir}",
                                   f"adapter={tmp_path / 'no_adapter'}")
        assert result.returncode == 2 and "no_adapter" in result.stderr and "Traceback" not in result.stderr
        assert out_dir.exists() == kept
    with pytest.raises(ConfigError, match="hydra.run.dir is set from out_dir; use out_dir=PATH"):
        validate("train", ["hydra.run.dir=/tmp/elsewhere"])


def test_unreadable_values_and_impossible_numbers_are_one_line(tmp_path, capsys):
    result = qwenft_in_process(capsys, "data", "out_dir=/tmp/路径")
    assert result.returncode == 2 and "quote it" in result.stderr and "\"out_dir='/tmp/路径'\"" in result.stderr
    for key in ("train.lr=inf", "train.lr=nan", "train.epochs=inf", "train.weight_decay=nan", "generate.temperature=inf",
                "generate.top_p=nan"):
        with pytest.raises(ConfigError, match=f"{key.split('=')[0]}=.*finite"):
            compose_config(key)
    result = qwenft_in_process(capsys, "generate", "model=tiny-random", "prompt=x", "generate.stop_strings=[停]")
    assert result.returncode == 2 and "quote each text item" in result.stderr
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    result = qwenft_in_process(capsys, "eval", "model=tiny-random", f"out_dir={a_file}")
    assert result.returncode == 2 and "is a file" in result.stderr and "Traceback" not in result.stderr
    assert a_file.read_text() == "keep"


# --- the few places where only Hydra's / OmegaConf's wording tells what went wrong, and Hydra's sweep order -------


def test_hydra_lexer_failures_are_told_by_hydra_1_3_wording():
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from qwenft.cli.overrides import lexer_refused

    def refusal(override):
        with pytest.raises(OverrideParseException) as info:
            OverridesParser.create().parse_overrides([override])
        assert info.value.override == override
        return info.value

    assert lexer_refused(refusal("prompt=春天"))  # a character without a token in Hydra's grammar
    assert not lexer_refused(refusal("lora.r=[1"))  # a parser error: the value's brackets


def test_omegaconf_unknown_keys_are_told_by_omegaconf_2_3_wording():
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from qwenft.config import LoraConfig
    from qwenft.config.load import names_an_unknown_key

    def first_line(action):
        with pytest.raises(OmegaConfBaseException) as info:
            action()
        return str(info.value).splitlines()[0]

    typed, struct = OmegaConf.structured(LoraConfig), OmegaConf.create({"r": 8})
    OmegaConf.set_struct(struct, True)
    assert names_an_unknown_key(first_line(lambda: typed.alpha))  # Key 'alpha' not in 'LoraConfig'
    assert names_an_unknown_key(first_line(lambda: struct["alpha"]))  # Key 'alpha' is not in struct
    assert names_an_unknown_key(first_line(lambda: OmegaConf.merge(typed, {"alpha": 8})))
    assert not names_an_unknown_key(first_line(lambda: OmegaConf.merge(typed, {"r": "eight"})))


@pytest.mark.parametrize("overrides", [["lora.r=4,8", "train.lr=1e-4,2e-4", "quant=none"],
                                       ["lora.r=range(4,12,4)", "+recipe=quickstart", "lora.r=16,32"],
                                       ["lora.r=choice(8,16)", "data.system_prompt='a,b'", "~train.seed"]])
def test_the_multirun_grid_is_hydras_job_order(overrides):
    """qwenft lists the jobs of ``-m`` itself (grid point N runs in out_dir/N): the order Hydra's basic sweeper
    (private in Hydra 1.3, so only this test reads it) gives its jobs."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from qwenft.cli.overrides import sweep_grid

    parsed = OverridesParser.create().parse_overrides(overrides)
    (hydra_jobs,) = BasicSweeper.split_arguments(parsed, None)
    assert sweep_grid(parsed) == hydra_jobs and len(hydra_jobs) > 1


def test_an_override_the_shell_split_gets_the_quoting_hint(capsys):
    """Issue 27: `train +recipe=domain data.sources.0.path=qa.csv data.sources.0.columns={instruction: q, output: a}`
    unquoted reaches qwenft as several words (Hydra: "no viable alternative at input '{instruction:'")."""
    from qwenft.cli import main

    words = "train +recipe=domain data.sources.0.path=qa.csv data.sources.0.columns={instruction: q, output: a}"
    result = run_qwenft(*words.split(" "))  # as the shell splits it
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "qwenft: error: data.sources.0.columns: the shell split this override at its spaces into 4 words (the first: "
        "data.sources.0.columns={instruction:); quote it whole: 'data.sources.0.columns={instruction: q, output: a}'")
    for typed, quoted in [("eval.metrics=[char_f1, rouge_l]", "'eval.metrics=[char_f1, rouge_l]'"),
                          ("-m lora.r=8, 16", "'lora.r=8, 16'"),
                          ("prompt=it's cold", "\"prompt=it's cold\"")]:
        with pytest.raises(SystemExit) as info:
            main(["generate", "model=tiny-random", *typed.split(" ")])
        assert info.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.endswith(f"quote it whole: {quoted}") and line.startswith("qwenft: error: ")


def test_eval_picks_its_sampler_from_every_composed_preset():
    """conf/config.yaml composes every conf/generate preset into ``generate_presets`` (each as the file on the
    schema's defaults): ``eval.generate=NAME`` picks one without reading a file; an unknown name lists them."""
    from omegaconf import OmegaConf

    from qwenft.config import GenerateConfig
    from qwenft.evaluate.run import generate_preset
    from qwenft.resources import conf_dir

    files = sorted((conf_dir() / "generate").glob("*.yaml"))
    config = compose_config("eval.generate=creative", "eval.max_new_tokens=9", "generate.static_cache=true")
    assert sorted(config.generate_presets) == [path.stem for path in files]
    for path in files:
        on_defaults = OmegaConf.merge(OmegaConf.structured(GenerateConfig), OmegaConf.load(path))
        assert config.generate_presets[path.stem] == OmegaConf.to_object(on_defaults), path.name
    settings = generate_preset(config)
    assert settings.temperature == config.generate_presets["creative"].temperature and settings.max_new_tokens == 9
    assert settings.static_cache and not config.generate_presets["creative"].static_cache
    with pytest.raises(ConfigError) as caught:
        generate_preset(compose_config("eval.generate=greedy"))
    names = ", ".join(path.stem for path in files)
    assert str(caught.value) == f"eval.generate='greedy' is not accepted; choose one of: {names}"


def test_an_impossible_preset_value_is_named_by_its_own_key():
    """``generate_presets.NAME.KEY`` is checked as the ``generate`` section is, and the error names the preset's key
    (a new user's ``generate_presets.balanced.max_new_tokens=0`` was refused as ``generate.max_new_tokens``)."""
    with pytest.raises(ConfigError) as caught:
        compose_config("generate_presets.balanced.max_new_tokens=0")
    assert str(caught.value).startswith("generate_presets.balanced.max_new_tokens=0 is not accepted")
    with pytest.raises(ConfigError) as caught:
        compose_config("generate.max_new_tokens=0")
    assert str(caught.value).startswith("generate.max_new_tokens=0 is not accepted")


def test_ctrl_c_before_the_command_runs_is_one_line(monkeypatch, capsys):
    """Ctrl-C while the command line is still being checked (a new user's came during the library imports that
    follow the config checks) ends with one line and exit code 130, as it does once the command runs."""
    import qwenft.cli.dispatch as dispatch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dispatch, "_quiet_wandb_notice", interrupted)
    code, stderr = run_main(["plan", "model=tiny-random"], capsys)
    assert code == 130 and stderr.splitlines()[-1] == "qwenft: error: interrupted", stderr
    assert "Traceback" not in stderr


def test_hydra_help_prints_hydra_s_help(capsys):
    """``COMMAND --hydra-help`` (each command's --help points to it) prints Hydra's own help, with or without
    overrides; it was two tracebacks (Hydra composes no primary config for it, so qwenft's overrides could not apply)."""
    for argv in (["train", "--hydra-help"], ["plan", "model=tiny-random", "--hydra-help"]):
        result = qwenft_in_process(capsys, *argv)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert "--hydra-help" in result.stdout and "Hydra" in result.stdout, result.stdout[:500]
