"""The training run: exact resume after SIGKILL, NaN guard, sweeps and multirun, plain-peft adapters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from qwenft.files import umask
from tests.conftest import QUESTIONS, ROOT, compose_config, qwenft_in_process, run_train, train_overrides
from tests.train.conftest import kill_after_checkpoint


def final_state(run_dir: Path):
    checkpoint = run_dir / "checkpoints" / "checkpoint-6"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    lrs = [h["learning_rate"] for h in state["log_history"] if "learning_rate" in h]
    weights = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    return state["global_step"], lrs[-1], weights


@pytest.mark.slow  # three training runs, one killed by SIGKILL: the process boundary is the point
def test_sigkill_after_checkpoint_then_resume_equals_uninterrupted(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_train(train_overrides(tmp_path, straight))
    assert result.returncode == 0, result.stderr[-3000:]

    result = run_train(train_overrides(tmp_path, killed), patch=kill_after_checkpoint(3))
    assert result.returncode == -9, result.stderr[-3000:]
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["checkpoint-3"]
    assert not (killed / "adapter").exists()

    result = run_train(train_overrides(tmp_path, killed, "train.resume=auto"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stderr + result.stdout

    step_a, lr_a, weights_a = final_state(straight)
    step_b, lr_b, weights_b = final_state(killed)
    assert step_a == step_b == 6
    assert lr_a == pytest.approx(lr_b, rel=1e-9)
    assert weights_a.keys() == weights_b.keys() and len(weights_a) > 0
    for name in weights_a:
        # fp32 on CPU with the same batches, RNG and optimizer state: only summation-order noise is allowed.
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=0, atol=1e-6)
    assert any(w.abs().sum() > 0 for n, w in weights_a.items() if "lora_B" in n)  # training moved B off zero


def test_a_checkpoint_is_published_whole_with_qwenft_json_and_rotated_by_step(tmp_path):
    """What the Trainer's on_save hook does once checkpoint-N is complete in the staging folder (its output_dir)."""
    from qwenft.train.callbacks import AtomicCheckpoints, staging_root

    checkpoints = tmp_path / "checkpoints"
    staging = staging_root(checkpoints)
    publisher = AtomicCheckpoints(checkpoints, compose_config("model=tiny-random", "quant=none"))
    for step in (2, 4, 6, 4):  # the last one: the same step saved again, as after a resume
        (staging / f"checkpoint-{step}").mkdir(parents=True)
        (staging / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        publisher.publish(staging, step, save_total_limit=2)
        assert not staging.exists()  # the emptied staging folder goes: only checkpoints are listed
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert json.loads((checkpoints / "checkpoint-4" / "qwenft.json").read_text())["model"]["source"] == "tiny-random"


NAN_FROM_STEP_5 = """
import torch
from qwenft.train.trainer import QwenftTrainer
_loss = QwenftTrainer.compute_loss
def _nan_loss(self, model, inputs, *args, **kwargs):
    out = _loss(self, model, inputs, *args, **kwargs)
    if self.state.global_step >= 4:
        return out * float("nan") if not isinstance(out, tuple) else (out[0] * float("nan"), *out[1:])
    return out
QwenftTrainer.compute_loss = _nan_loss
"""


def test_non_finite_loss_stops_with_clear_error(tmp_path):
    run_dir = tmp_path / "nan"
    args = train_overrides(tmp_path, run_dir, "train.save_steps=2")
    result = run_train(args, patch=NAN_FROM_STEP_5)
    assert result.returncode != 0
    assert "non-finite loss" in result.stderr and "step 5" in result.stderr
    assert "Traceback" not in result.stderr
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint-2", "checkpoint-4"]
    last = run_dir / "checkpoints" / "checkpoint-4"
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    weights = load_file(str(last / "adapter_model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


def sweep_points():
    return sorted((ROOT / "recipes" / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", sweep_points(), ids=lambda p: p.name)
def test_sweep_specs_parse_and_compose(path):
    spec = yaml.safe_load(path.read_text())
    assert spec["method"] in ("grid", "random", "bayes")
    assert spec["command"][:5] == ["${env}", "python", "-m", "qwenft", "train"]
    fixed = [a for a in spec["command"][5:] if not a.startswith("${")]
    first = []
    for key, values in spec["parameters"].items():
        value = values["values"][0] if "values" in values else values.get("min")
        first.append(f"{key}={value}")
    config = compose_config(*fixed, *first)
    for item in first:
        key, value = item.split("=")
        section, name = key.split(".")
        assert float(getattr(getattr(config, section), name)) == pytest.approx(float(value))


def test_multirun_grid_writes_two_run_directories(tmp_path):
    sweep_dir = tmp_path / "grid"  # out_dir names the grid's folder, one run directory per point under it
    args = [a.replace("train.max_steps=6", "train.max_steps=2") for a in train_overrides(tmp_path, sweep_dir)]
    result = run_train([*args[:2], "-m", "lora.r=4,8", *args[2:]])  # -m among the overrides, as the README writes it
    assert result.returncode == 0, result.stderr[-3000:]
    for num, rank in ((0, 4), (1, 8)):
        adapter = sweep_dir / str(num) / "adapter"
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == rank
        assert (sweep_dir / str(num) / "metrics.json").is_file()
    # the grid's index at its root (issue 27): which overrides each point got, and a comparison table
    index = json.loads((sweep_dir / "grid.json").read_text())["points"]
    assert [(p["num"], p["status"]) for p in index] == [(0, "done"), (1, "done")]
    assert ["lora.r=4" in p["overrides"] for p in index] == [True, False] and "lora.r=8" in index[1]["overrides"]
    for point in index:
        final = json.loads((sweep_dir / str(point["num"]) / "metrics.json").read_text())["train"]["final_loss"]
        assert point["metrics"]["final_loss"] == final and point["dir"] == str(sweep_dir / str(point["num"]))
    table = (sweep_dir / "grid.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| point"))
    assert header.split(" | ")[:3] == ["| point", "lora.r", "status"] and "final_loss" in header
    rows = [line for line in table if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert [r.split(" | ")[1] for r in rows] == ["4", "8"]
    # The same grid again into the same out_dir: refused before Hydra rewrites any point's .hydra/
    snapshot = {p: p.stat().st_mtime_ns for p in sweep_dir.rglob("*") if p.is_file()}
    again = run_train(["-m", "lora.r=4,8", *args])
    assert again.returncode == 2 and f"{sweep_dir / '0'} already holds a training run" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in sweep_dir.rglob("*") if p.is_file()} == snapshot


# Ctrl-C after step 2: KeyboardInterrupt raised where the progress bar has just been drawn.
CTRL_C_AT_STEP_2 = """
from qwenft.train.callbacks import ProgressBarCallback
_step_end = ProgressBarCallback.on_step_end
def _interrupt(self, args, state, control, **kwargs):
    _step_end(self, args, state, control, **kwargs)
    if state.global_step == 2:
        raise KeyboardInterrupt
ProgressBarCallback.on_step_end = _interrupt
"""


def test_ctrl_c_message_starts_on_its_own_line(tmp_path):
    """The progress bar ends without a newline; Ctrl-C's message (exit 130) starts on a line of its own, not glued
    to the bar (issue 27)."""
    run_dir = tmp_path / "run"
    result = run_train(train_overrides(tmp_path, run_dir), patch=CTRL_C_AT_STEP_2)
    assert result.returncode == 130, result.stderr[-2000:]
    assert "train:" in result.stderr  # the bar was drawn
    assert any(line.startswith("qwenft: error: interrupted; complete checkpoints in")
               for line in result.stderr.split("\n")), result.stderr[-1000:]


def test_refused_runs_write_nothing_and_keep_the_resumable_run(tmp_path, capsys):
    """Bad data, a resume with another LoRA shape, a second run into a finished run: one line each, exit 2,
    and nothing written or overwritten (checked before the model loads and before the run directory is used). In
    this process: what is checked is each command's message and the files, not the process."""
    from omegaconf import OmegaConf

    run_dir = tmp_path / "run"
    text = "Answer plainly; ${HOME} and {x} are text"  # a literal ${ must survive into config.yaml as text
    args = [a.replace("train.max_steps=6", "train.max_steps=3") for a in train_overrides(tmp_path, run_dir)]
    args.append(f"data.system_prompt={text}")
    first = qwenft_in_process(capsys, "train", *args)
    assert first.returncode == 0, first.stderr[-2000:]
    assert OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)["data"]["system_prompt"] \
        == text
    # a checkpoint names its base like the final adapter (adapter=.../checkpoint-3 runs on the right model)
    meta = json.loads((run_dir / "checkpoints" / "checkpoint-3" / "qwenft.json").read_text())
    assert meta == json.loads((run_dir / "adapter" / "qwenft.json").read_text()) and meta["system_prompt"] == text
    checkpoint = run_dir / "checkpoints" / "checkpoint-3"
    assert {p.stat().st_mode & 0o777 for p in checkpoint.rglob("*") if p.is_file()} == {0o666 & ~umask()}
    saved = {p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    refused = [([*args, "train.resume=auto", "lora.r=4"], "lora.r=16 in the run, 4 now"),
               ([*args, "train.resume=auto"], "is already at step 3 (epoch"),  # finished: nothing left to train
               (args, "already holds a training run")]
    for argv, message in refused:
        result = qwenft_in_process(capsys, "train", *argv)
        assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        assert {p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == saved
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "q", "output": "a"}\n{"instruction": "q2"}\n', encoding="utf-8")
    # A resume refused by its data (found after Hydra took the directory): the run's .hydra/ is put back as it was.
    contents = {p: (run_dir / p).read_bytes() for p in saved if p.name != "train.log"}
    resume_bad = [a.replace(str(tmp_path / "rows.jsonl"), str(bad)).replace("train.max_steps=3", "train.max_steps=6")
                  for a in args] + ["train.resume=auto"]
    result = qwenft_in_process(capsys, "train", *resume_bad)
    assert result.returncode == 2 and f"{bad}: line 2: field 'output'" in result.stderr, result.stderr[-2000:]
    assert {p: (run_dir / p).read_bytes() for p in saved if p.name != "train.log"} == contents
    assert f"error: {bad}: line 2" in (run_dir / "train.log").read_text().splitlines()[-1]  # the log says why
    assert {p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file()} == set(saved)
    fresh = tmp_path / "fresh"
    bad_args = [a.replace(str(tmp_path / "rows.jsonl"), str(bad)).replace(str(run_dir), str(fresh)) for a in args]
    result = qwenft_in_process(capsys, "train", *bad_args)
    assert result.returncode == 2 and f"{bad}: line 2: field 'output'" in result.stderr, result.stderr[-2000:]
    assert not fresh.exists()  # not even Hydra's .hydra/ and log


def test_adapter_loads_with_plain_peft(tmp_path, capsys):
    """Trained in this process; loaded in a new one that never imports qwenft (the point of the check)."""
    run_dir = tmp_path / "run"
    args = [a.replace("train.max_steps=6", "train.max_steps=2") for a in train_overrides(tmp_path, run_dir)]
    result = qwenft_in_process(capsys, "train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = run_dir / "adapter"
    mask = umask()
    assert adapter.stat().st_mode & 0o777 == 0o777 & ~mask  # an ordinary folder, not mkdtemp's private 0700
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json",
                 "generation_config.json", "qwenft.json"):
        assert (adapter / name).is_file(), name
        assert (adapter / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    for name in ("config.yaml", "metrics.json"):
        assert (run_dir / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train"]["global_step"] == 2 and metrics["train"]["tokens_per_s"] > 0
    check = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from peft import PeftConfig, PeftModel\n"
        f"path = {str(adapter)!r}\n"
        "base_path = PeftConfig.from_pretrained(path).base_model_name_or_path\n"
        "model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), path)\n"
        "tok = AutoTokenizer.from_pretrained(path)\n"
        "ids = tok('hello', return_tensors='pt').input_ids\n"
        "assert torch.isfinite(model(ids).logits).all()\n"
        "assert not any(m.startswith('qwenft') for m in sys.modules), 'qwenft was imported'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_supervised_only_loss_equals_the_model_loss(tmp_path):
    """QwenftTrainer.compute_loss (lm_head on supervised positions only) == transformers' loss."""
    from qwenft.data import DataCollator, encode_example
    from qwenft.model import attach_lora, load_model
    from qwenft.train.trainer import training_arguments
    from qwenft.train.trainer import QwenftTrainer

    config = compose_config("model=tiny-random", "quant=none", f"out_dir={tmp_path}", "lora.lora_dropout=0.0")
    model, tokenizer = load_model(config, device="cpu")
    model = attach_lora(model, config.lora, gradient_checkpointing=False)
    rows = [encode_example(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                           max_seq_len=128, train_on="assistant") for q, a in QUESTIONS[:3]]
    batch = DataCollator(tokenizer)([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    trainer = QwenftTrainer(model=model, args=training_arguments(config, model, tmp_path / "ckpt", False))
    with torch.no_grad():
        ours = trainer.compute_loss(model, dict(batch))
        reference = model(**batch).loss
        n = int((batch["labels"][:, 1:] != -100).sum())
        ours_sum = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(2 * n))
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)  # fp32, same math in another order
    torch.testing.assert_close(ours_sum, reference / 2, rtol=1e-6, atol=0)


def test_rows_with_their_own_system_turn_are_what_inference_uses(tmp_path, capsys):
    """issue 27 item 7: sharegpt rows that each carry the system turn "You are the Widget helpdesk.": qwenft.json
    records it (the most frequent one, and its share), and `inspect adapter=<run>` prompts with it, not with the
    template's default."""
    rows = tmp_path / "widget.jsonl"
    with open(rows, "w", encoding="utf-8") as handle:
        for i in range(12):
            system = "You are the Widget helpdesk." if i < 9 else "You are a pirate."  # 9 of 12 rows
            handle.write(json.dumps({"conversations": [{"from": "system", "value": system},
                                                       {"from": "human", "value": f"Is widget {i} on?"},
                                                       {"from": "gpt", "value": "Yes, it is."}]}) + "\n")
    run_dir = tmp_path / "run"
    args = [a for a in train_overrides(tmp_path, run_dir) if not a.startswith(("data.sources=", "train.max_steps"))]
    result = qwenft_in_process(capsys, "train", *args, "train.max_steps=2",
                               f"data.sources=[{{name: widget, path: '{rows}', format: sharegpt}}]")
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((run_dir / "adapter" / "qwenft.json").read_text())
    assert meta["system_prompt"] == "You are the Widget helpdesk." and meta["system_prompt_from"] == "rows"
    assert meta["system_prompt_share"] == pytest.approx(0.75)
    assert json.loads((run_dir / "checkpoints" / "checkpoint-2" / "qwenft.json").read_text()) == meta

    trace = tmp_path / "trace.json"
    proc = qwenft_in_process(capsys, "inspect", f"adapter={run_dir}", "prompt=hi", f"inspect.out={trace}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("system prompt from the adapter's qwenft.json, the system turn of 75% of its training rows: "
            "'You are the Widget helpdesk.'") in proc.stderr
    text = "".join(token["text"] for token in json.loads(trace.read_text())["tokens"])
    assert text.startswith("<|im_start|>system\nYou are the Widget helpdesk.<|im_end|>\n<|im_start|>user\nhi"), text


def test_a_resume_with_another_model_names_the_model_typed(tmp_path):
    """issue 27 item 10: a resume with `model=` other than the run's names `model=NAME` (what the user typed), then
    the keys it changes; a `quant=` likewise."""
    from qwenft.config import QwenftError
    from qwenft.train.rundir import check_resume_config, config_yaml

    (tmp_path / "config.yaml").write_text(config_yaml(compose_config("model=tiny-random", "quant=none")))
    with pytest.raises(QwenftError) as info:
        check_resume_config(compose_config("model=qwen2.5-0.5b-instruct", "quant=nf4"), tmp_path)
    message = str(info.value)
    assert "other settings (model=qwen2.5-0.5b-instruct now, model=tiny-random in the run: model.path " in message
    assert "model.source 'tiny-random' -> 'hub'" in message and "; quant=nf4 now, quant=none in the run" in message
    assert "model.source=" not in message and "quant.method=" not in message
    with pytest.raises(QwenftError, match=r"\(lora.r=16 in the run, 4 now\)"):  # a plain key: named as it is
        check_resume_config(compose_config("model=tiny-random", "quant=none", "lora.r=4"), tmp_path)


def test_a_run_that_is_all_warmup_is_warned(tmp_path, caplog):
    """max_steps=1 with the default warmup_ratio: the only step runs at lr 0 (the warmup starts from 0), so the
    adapter stays as it began; the run says so (a newcomer's `train.max_steps=1` trained nothing, silently)."""
    import logging

    from qwenft.model import load_model
    from qwenft.train.trainer import training_arguments

    model, _ = load_model(compose_config("model=tiny-random", "quant=none"), device="cpu")
    for steps, warned in ((1, True), (2, False)):
        config = compose_config("model=tiny-random", "quant=none", f"out_dir={tmp_path}", f"train.max_steps={steps}")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qwenft"):
            training_arguments(config, model, tmp_path / "ckpt", False)
        assert any("every step is warmup" in r.getMessage() for r in caplog.records) is warned, steps
    config = compose_config("model=tiny-random", "quant=none", f"out_dir={tmp_path}", "train.max_steps=1",
                            "train.warmup_ratio=0")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qwenft"):
        training_arguments(config, model, tmp_path / "ckpt", False)
    assert not any("warmup" in r.getMessage() for r in caplog.records)


def test_qwenft_json_records_the_rows_held_out_not_the_rows_asked(tmp_path):
    """A recipe's eval_rows larger than the file is clamped by the build; qwenft.json records what was held out,
    so a later `eval adapter=...` holds out the same rows and does not repeat the clamp warning."""
    from qwenft.model import read_adapter_meta, save_adapter_meta

    config = compose_config("model=tiny-random", "quant=none", "data.sources.0.eval_rows=50")
    name = config.data.sources[0].name
    save_adapter_meta(tmp_path, config, {"sources": {name: {"eval": 10}}, "system_prompt": None})
    recorded = read_adapter_meta(tmp_path)["data"]["sources"]
    assert recorded[0]["name"] == name and recorded[0]["eval_rows"] == 10
    save_adapter_meta(tmp_path, config)  # no statistics: the configured value
    assert read_adapter_meta(tmp_path)["data"]["sources"][0]["eval_rows"] == 50
