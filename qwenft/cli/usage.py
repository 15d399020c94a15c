"""``python -m qwenft COMMAND --help``: the keys that command reads, each with its value in the composed config
(the user's overrides and recipe applied), then examples. Hydra's own help (``--hydra-help``) and the whole
resolved config (``--cfg job``) stay where they were; a 200-line config dump is not where a newcomer looks first.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

_MODEL = [("model", "the base: a preset of conf/model/ (or model.source=local model.path=DIR)"),
          ("quant", "nf4 (4-bit NF4, double quant) or none (16-bit)")]
_ADAPTER = ("adapter", "a LoRA adapter directory (RUN/adapter); its base and system prompt are used")

# command -> (key, what it does), in the order shown; every key is a key of the config (a test checks)
COMMAND_KEYS: Dict[str, List[Tuple[str, str]]] = {
    "train": [("+recipe", "a complete experiment: recipes/NAME.yaml (+recipe=quickstart) or a file (+recipe=./my.yaml)"),
              *_MODEL,
              ("data.sources", "the data: a list of {name, path, format, columns, weight, max_rows, eval_rows}; "
                               "one key: data.sources.0.path=FILE"),
              ("data.max_seq_len", "tokens per example; longer ones are truncated or dropped (data.overlong)"),
              ("lora.r", "LoRA rank"), ("lora.lora_alpha", "LoRA scale (alpha / r)"),
              ("lora.target_modules", "projections that get LoRA"),
              ("train.lr", "peak learning rate"), ("train.epochs", "passes over the data"),
              ("train.max_steps", "stop after N optimizer steps (-1: epochs decide)"),
              ("train.batch_size", "examples per step and process"), ("train.grad_accum", "steps accumulated"),
              ("train.resume", "auto: continue the run in out_dir from its last checkpoint"),
              ("train.objective", "sft, or preference tuning on pairs: dpo, ipo, simpo, orpo, kto"),
              ("pref.beta", "the preference objective's beta (pref.*: label_smoothing, rpo_alpha, precompute_ref)"),
              ("init_adapter", "start from this adapter (a second stage: DPO after SFT; also the reference)"),
              ("eval.after_train", "evaluate base vs tuned when training ends"),
              ("eval.judge.url", "judge base vs tuned answers through an OpenAI-compatible endpoint (docs/eval.md)"),
              ("logger", "none or wandb"), ("out_dir", "the run directory")],
    "eval": [_ADAPTER,
             ("+recipe", "the data to evaluate on (default: the sources the adapter was trained on)"),
             ("data.sources", "the held-out data, as for train"), *_MODEL,
             ("eval.metrics", "metrics of the generated answers"),
             ("eval.max_eval_prompts", "held-out prompts per source at most"),
             ("eval.benchmarks", "retention benchmarks, e.g. [mmlu]"), ("eval.bench_limit", "questions per benchmark: N, null (all) or auto (1,000 on a GPU, 64 on a CPU)"),
             ("eval.bench_block", "questions per subject at most (16)"),
             ("eval.targets", "the sources to improve (default: the first); the rest is retention"),
             ("eval.gates", "the verdict's conditions, judged on 95% intervals"),
             ("eval.min_n", "fewest rows a gate is decided on (20)"), ("eval.fail_on_gate", "exit 3 when a gate fails"),
             ("eval.fail_on_inconclusive", "exit 4 when the verdict is INCONCLUSIVE (and 3 on a FAIL)"),
             ("eval.judge.url", "a pairwise judge: an OpenAI-compatible base URL (eval.judge.model, api_key_env)"),
             ("eval.judge.local", "or a model preset judging in this process"),
             ("eval.judge.compare", "[base] (tuned vs base), also reference"),
             ("eval.judge.sanity_n", "prompts of the judge's sanity check (20)"),
             ("out_dir", "where metrics.json and report.md go")],
    "generate": [("prompt", "the prompt, taken literally (prompt=\"春天, 夏天\")"),
                 ("prompts_file", "a JSONL file, one {\"prompt\": ...} or {\"messages\": [...]} object a line"),
                 ("out", "with prompts_file: the JSONL file the answers go to (default: stdout)"),
                 _ADAPTER, *_MODEL,
                 ("data.system_prompt", "the system turn (default: the adapter's, else the model's)"),
                 ("chat", "wrap the prompt in the chat template"),
                 ("generate", "a sampling preset: precise, balanced or creative"),
                 ("generate.max_new_tokens", "tokens generated at most"),
                 ("generate.temperature", "null: the model's generation_config"), ("generate.top_k", ""),
                 ("generate.top_p", ""), ("generate.min_p", ""), ("generate.repetition_penalty", ""),
                 ("generate.stop_strings", "extra strings that end the answer"),
                 ("generate.seed", "a seed makes a sampled answer reproducible")],
    "merge": [_ADAPTER, ("out", "the directory the merged model is written to"),
              ("merge.dtype", "bfloat16 or float16 or float32"),
              ("merge.base", "dequantized (the NF4 weights trained against) or original"),
              ("merge.gguf", "none, f16 or q8_0: also write a GGUF"),
              ("merge.verify_gguf", "run the GGUF in llama.cpp (null: when installed)"),
              ("merge.quantize", "artifacts made from the merge and measured against it: gguf-q8_0, gguf-q6_k, "
                                 "gguf-q5_k_m, gguf-q4_k_m (need merge.gguf=f16), gptq, awq"),
              ("merge.calibration_rows", "training rows of the run GPTQ and AWQ calibrate on"),
              ("merge.overwrite", "replace a non-empty out")],
    "data": [("+recipe", "a complete experiment (its data)"),
             ("data.sources", "the data: a list of {name, path, format, columns, weight, max_rows, eval_rows}"),
             ("data.max_seq_len", "tokens per example"), ("data.system_prompt", "the system turn of every example"),
             ("model", "the tokenizer's model (only the tokenizer is loaded)")],
    "inspect": [("prompt", "the prompt, taken literally"), _ADAPTER, *_MODEL,
                ("inspect.layers", "layers to trace, e.g. 0,12,-1 (null: all)"),
                ("inspect.top_k", "next-token candidates shown"), ("inspect.out", "a JSON file for the whole trace"),
                ("chat", "wrap the prompt in the chat template")],
    "plan": [*_MODEL, ("lora.r", "LoRA rank"), ("lora.target_modules", "projections that get LoRA"),
             ("data.max_seq_len", "tokens per example"), ("train.batch_size", "examples per step"),
             ("train.gradient_checkpointing", "recompute activations in the backward pass"),
             ("plan.gpu_gb", "the device's memory in GiB"), ("plan.device", "cuda or cpu"),
             ("plan.out", "a JSON file for the whole plan")],
    "serve": [_ADAPTER, *_MODEL, ("serve.host", "the interface (127.0.0.1; any other needs serve.api_key)"),
              ("serve.port", "the port (0: a free one, printed)"), ("serve.name", "the tuned model's id (null: the run's)"),
              ("serve.api_key", "clients send Authorization: Bearer KEY"),
              ("serve.max_batch", "requests decoded together at most"),
              ("serve.max_queue", "requests waiting at most (more get 429)"),
              ("serve.max_tokens", "max_tokens of a request at most"),
              ("generate", "the default sampling preset of a request")],
}

EXAMPLES: Dict[str, List[str]] = {
    "train": ["python -m qwenft train +recipe=quickstart",
              "python -m qwenft train +recipe=domain data.sources.0.path=FILE train.max_steps=20",
              "python -m qwenft train +recipe=quickstart -m lora.r=8,16   # a grid: out_dir/0, out_dir/1, grid.md"],
    "eval": ["python -m qwenft eval adapter=RUN/adapter", "python -m qwenft eval +recipe=quickstart   # the base alone"],
    "generate": ['python -m qwenft generate prompt="Why is the sky blue?" adapter=RUN/adapter',
                 "python -m qwenft generate prompts_file=data/examples/prompts.jsonl out=answers.jsonl"],
    "merge": ["python -m qwenft merge adapter=RUN/adapter out=DIR",
              "python -m qwenft merge adapter=RUN/adapter out=DIR merge.gguf=f16 'merge.quantize=[gguf-q4_k_m,gptq,awq]'"],
    "data": ["python -m qwenft data +recipe=quickstart",
             "python -m qwenft data cache=list       # the tokenized-data cache; cache=clear removes it"],
    "inspect": ['python -m qwenft inspect prompt="春天" inspect.layers=0,12,23'],
    "plan": ["python -m qwenft plan model=qwen2.5-7b-instruct lora.r=64 plan.gpu_gb=24"],
    "serve": ["python -m qwenft serve adapter=RUN/adapter   # then open http://127.0.0.1:8000/",
              "python -m qwenft serve adapter=RUN/adapter serve.host=0.0.0.0 serve.api_key=YOUR_SECRET_KEY"],
}


def _values(command: str, overrides: Sequence[str]) -> Dict[str, str]:
    """Each key's value in the config composed with ``overrides`` (``{}`` when it does not compose: the help is
    shown anyway, and the run itself says what is wrong)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from qwenft.resources import conf_dir

    values: Dict[str, str] = {}
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*overrides, f"command={command}"],
                          return_hydra_config=True)
        choices = cfg.hydra.runtime.choices  # the preset of each group (model=..., +recipe=...)
        for key, _ in COMMAND_KEYS[command]:
            group = key.lstrip("+")
            if group in ("recipe", "model", "quant", "generate"):
                if choices.get(group) is not None:
                    values[key] = str(choices[group])
                continue
            node = OmegaConf.select(cfg, key, throw_on_missing=False)
            if key == "data.sources":
                paths = [("???" if OmegaConf.is_missing(s, "path") else s.path) or "???" for s in node]
                text = "[" + ", ".join(f"{s.name}: {path}" for s, path in zip(node, paths)) + "]"
            elif OmegaConf.is_config(node):
                text = "???" if OmegaConf.is_missing(cfg, key) else str(OmegaConf.to_container(node, resolve=False))
            else:
                text = "null" if node is None else str(node)
            values[key] = text if len(text) <= 100 else text[:97] + "..."
    except Exception:  # a bad override: the command run says so with its one line
        return {}
    finally:
        GlobalHydra.instance().clear()
    return values


def command_help(command: str, one_line: str, overrides: Sequence[str] = ()) -> str:
    """The text of ``python -m qwenft COMMAND --help``: what the command does, the keys it reads with their values
    under ``overrides``, examples, and where the rest is (``--cfg job``, docs/)."""
    values = _values(command, overrides)
    lines = [f"usage: python -m qwenft {command} [key=value ...] [+recipe=NAME] [-m] [--cfg job]", "",
             one_line, "", f"keys {command} reads (value now):"]
    for key, what in COMMAND_KEYS[command]:
        shown = f"{key}={values[key]}" if key in values else key
        lines.append(f"  {shown:<44} {what}".rstrip())
    lines += ["", "examples:", *(f"  {e}" for e in EXAMPLES[command]), "",
              f"every key, resolved: python -m qwenft {command} --cfg job [overrides]; Hydra's options: --hydra-help"]
    return "\n".join(lines) + "\n"
