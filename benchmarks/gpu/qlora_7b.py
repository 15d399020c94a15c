"""One-GPU check: QLoRA training steps and KV-cached decode on a random Qwen2.5-7B-shaped model in NF4.

No download and no model files: the model has the exact Qwen2.5-7B-Instruct config with random weights
(:mod:`benchmarks.gpu.build`), NF4 with double quantization and bf16 compute; LoRA r=16 on all seven
projections. Phases, each after a fresh build with the same seed (so every phase sees the same weights and its
memory peak is its own; ``torch.cuda.max_memory_allocated`` is reset before each):

1. decode (:mod:`benchmarks.gpu.decode`): greedy, exactly N new tokens from random token-id prompts at batch 1
   and 16; arms NF4 dynamic, NF4 compiled, 16-bit compiled, tuned (LoRA folded) 16-bit compiled and
   transformers' generate, warmed up, then alternated over rounds; decode tokens/s from the difference of a long
   and a short call; tokens compared with each arm's reference (first differing position and logit margin);
   each arm's fraction of the bandwidth ceiling for the bytes it reads per step (weights + KV cache) at the
   measured device copy bandwidth (STREAM copy convention, read + write). Then an evaluation's generation
   (``--eval-prompts`` prompts, base then tuned folded, as ``qwenft eval`` runs it), timed after compiling.
2. train, three arms on the same random token rows, each on its own copy of the model, alternated in blocks of
   optimizer steps (:mod:`benchmarks.gpu.train_arms`: ``plain qwenft liger plain qwenft liger ...``, the first
   block of each arm untimed): ``plain``, what a user writes by hand (``peft.prepare_model_for_kbit_training`` +
   ``get_peft_model`` + ``transformers.Trainer`` with ``DataCollatorForSeq2Seq``); ``qwenft``
   (``qwenft.model.attach_lora`` + ``qwenft.train.trainer.make_trainer``: its Trainer subclass, chunked loss, collator and
   callbacks; ``train.kernels=none``); ``qwenft_liger`` (the same with ``train.kernels=liger``; only on CUDA with
   liger-kernel installed). Gradient checkpointing, bf16 autocast, paged 8-bit AdamW in all.

Seconds per step: median of the timed steps (CUDA synchronised at every step boundary) with p25/p75 and min/max, and
the ratio to plain per alternation round. Final losses must agree with plain's within 1e-2 relative.
The planner's prediction (``qwenft.plan``: weights as loaded, the training-step peak, the KV cache) is
recorded beside each measurement. ``--tiny`` runs the same code on a shape-reduced model on the CPU (fp32
compute, NF4 through bitsandbytes' CPU backend, seq 64, 3 blocks of 1 step, 8 new tokens), as the test suite does.

    bash benchmarks/gpu/run.sh                 # full: 7B shape, CUDA (about 3-5 minutes on one H200)
    bash benchmarks/gpu/run.sh --tiny          # CPU, seconds
    bash benchmarks/gpu/run.sh --tiny --device cuda   # the tiny model on the GPU: a smoke check first

Results: ``$OUT/gpu_qlora_7b.json`` when ``OUT`` is set, else benchmarks/results/ (``gpu_qlora_tiny.json`` in
tiny mode).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402
from benchmarks.gpu.build import (PLAN_FIELDS, QWEN25_7B, TINY, build_nf4_model, tensor_bytes,  # noqa: E402
                                  tiny_overrides)
from benchmarks.gpu.decode import build_models, decode_arms, eval_timing  # noqa: E402
from benchmarks.gpu.phases import Memory, copy_bandwidth, random_rows  # noqa: E402
from benchmarks.gpu.train_arms import plain_builder, qwenft_builder, round_ratios, run_arms  # noqa: E402
from qwenft.kernels import liger_installed  # noqa: E402



def _size(nbytes) -> str:
    """Bytes in binary units (GiB, MiB or KiB), or ``-``."""
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="shape-reduced model, CPU by default: seq 64, 3 steps")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    parser.add_argument("--block", type=int, default=None, help="optimizer steps per block (default 4; tiny 1)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="blocks per arm, the first untimed (default 6: 20 timed steps; tiny 3)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per training row (default 2048; tiny 64)")
    parser.add_argument("--batch", type=int, default=1, help="training batch size")
    parser.add_argument("--new-tokens", type=int, default=None, help="decoded tokens per row (default 128; tiny 8)")
    parser.add_argument("--decode-batches", default="1,16", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per row (default 32; tiny 16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of short + long calls per arm (>= 3)")
    parser.add_argument("--eval-prompts", type=int, default=None, help="prompts of the eval timing (default 256; "
                        "tiny 12)")
    parser.add_argument("--decode-only", action="store_true", help="skip the training arms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 for --tiny on a CPU, where bitsandbytes' many tiny kernels "
                             "suffer most from a busy machine; else torch's)")
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.block = args.block or (1 if args.tiny else 4)
    args.blocks = args.blocks or (3 if args.tiny else 6)
    if args.blocks < 2:
        parser.error("--blocks must be >= 2 (the first block of each arm is not timed)")
    args.steps = args.block * args.blocks
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 128)
    args.prompt_len = args.prompt_len or (16 if args.tiny else 32)
    args.eval_prompts = args.eval_prompts or (12 if args.tiny else 256)
    args.decode_batches = [int(b) for b in args.decode_batches.split(",")]
    if args.threads is None and args.tiny and args.device == "cpu":
        args.threads = 1
    return args


def qwenft_config(args, out_dir: str):
    """The validated qwenft config of this run (LoRA, train settings; the model section feeds the planner)."""
    from qwenft.cli.compose import validate
    from qwenft.cli.compose import register_resolvers

    cuda = args.device.startswith("cuda")
    model = tiny_overrides(TINY) if args.tiny else ["model=qwen2.5-7b-instruct"]
    dtypes = [] if cuda else ["model.dtype=float32", "quant.compute_dtype=float32", "train.precision=fp32"]
    register_resolvers()
    return validate("train", [*model, "quant=nf4", *dtypes, "lora.r=16", f"out_dir={out_dir}",
                              f"train.max_steps={args.steps}", f"train.batch_size={args.batch}",
                              f"data.max_seq_len={args.seq}", "train.gradient_checkpointing=true",
                              "train.save_steps=100000", "train.eval_steps=100000", "train.logging_steps=1",
                              "data.packing=false", "logger=none", "eval.after_train=false",
                              f"plan.device={'cuda' if cuda else 'cpu'}"])[0]


def planner(config, args, shape, kernels: str = "none") -> dict:
    """The planner's numbers for this run (``train.kernels=kernels``), and a check that it plans the model built."""
    import dataclasses

    from qwenft.plan import TrainSetup, kv_cache_bytes, resolve_architecture, training_memory, weight_bytes

    arch = resolve_architecture(config.model)
    for field in PLAN_FIELDS:
        if getattr(arch, field) != shape[field]:
            raise SystemExit(f"the planner's architecture has {field}={getattr(arch, field)}, the built model "
                             f"{shape[field]} ({arch.source})")
    setup = dataclasses.replace(TrainSetup.from_config(config, device=config.plan.device), kernels=kernels)
    train = training_memory(arch, setup, args.batch, args.seq, steady=True)
    context = args.prompt_len + args.new_tokens - 1  # the last token chosen is never fed back
    return {"numbers_from": arch.source, "device": setup.device, "optimizer": setup.optim, "autocast": setup.amp,
            "kernels": kernels,
            "weights_loaded_bytes": weight_bytes(arch, True, setup.double_quant, setup.compute_bytes)["total"],
            "train_peak_bytes": train["peak"], "train_parts": train,
            "kv_cache_bytes_per_token": kv_cache_bytes(arch, 1, setup.compute_bytes),
            "kv_cache_bytes": {str(b): b * kv_cache_bytes(arch, context, setup.compute_bytes)
                               for b in args.decode_batches}}


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from qwenft.config import TinyModelConfig
    from qwenft.model.tiny import build_tokenizer

    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny (CPU) or on a GPU machine")
    shape = TINY if args.tiny else QWEN25_7B
    compute = torch.bfloat16 if cuda else torch.float32
    tokenizer = build_tokenizer(TinyModelConfig())  # the sampler decodes with it; prompts are token ids
    memory = Memory(args.device)
    results = {"build": [], "train": {}}

    def build(phase: str):
        before = memory.current()  # what the previous phase left allocated (should be ~0 on CUDA)
        memory.reset()
        start = time.perf_counter()
        model = build_nf4_model(shape, args.device, compute, tokenizer, seed=args.seed)
        results["build"].append({"phase": phase, "seconds": time.perf_counter() - start,
                                 "allocated_before_bytes": before, "peak_memory_bytes": memory.peak(),
                                 "allocated_bytes": memory.current(),
                                 "tensor_bytes": tensor_bytes(model)})
        print(f"built the {'tiny' if args.tiny else '7B'}-shaped NF4 model for {phase} in "
              f"{results['build'][-1]['seconds']:.1f} s", flush=True)
        return model

    bandwidth = copy_bandwidth(args.device)
    print(f"device copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        config = qwenft_config(args, tmp)
        liger = cuda and liger_installed()
        plan = planner(config, args, shape)
        plans = {"qwenft": plan, **({"qwenft_liger": planner(config, args, shape, "liger")} if liger else {})}
        names = iter(["decode_nf4", "decode_dense", "decode_tuned_ref", "decode_folded"])
        models = build_models(lambda: build(next(names)), tokenizer, config.lora, args.seed)
        results["decode"] = decode_arms(models, tokenizer, args, bandwidth, memory)
        results["eval"] = eval_timing(models, tokenizer, config, args, args.device)
        print(f"  eval: {results['eval']['prompts']} prompts x {args.new_tokens} tokens, base + tuned: "
              f"{results['eval']['seconds_after_compiling']:.1f} s after compiling ({results['eval']['path']})",
              flush=True)
        del models
        _free(cuda)
        if args.decode_only:
            results["memory_measure"] = memory.measure
            report_decode(args, results, bandwidth)
            return
        rows = random_rows(shape["vocab_size"], args.steps * args.batch, args.seq, args.seed)
        builders = {"plain": plain_builder(lambda: build("train_plain"), tokenizer, config, rows, Path(tmp), cuda),
                    "qwenft": qwenft_builder(lambda: build("train_qwenft"), tokenizer, config, rows, Path(tmp), "none")}
        if liger:
            builders["qwenft_liger"] = qwenft_builder(lambda: build("train_qwenft_liger"), tokenizer, config, rows,
                                                      Path(tmp), "liger")
        else:
            results["liger_skipped"] = ("no CUDA device" if not cuda else
                                        "liger-kernel is not installed (pip install 'qwenft[gpu]')")
            print(f"arm qwenft_liger skipped: {results['liger_skipped']}", flush=True)
        results["train"] = run_arms(builders, memory, args.block, args.blocks, args.seq * args.batch, cuda)
        _free(cuda)
    results["memory_measure"] = memory.measure
    report(args, config, shape, plans, results, bandwidth, time.perf_counter() - started)


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


def report(args, config, shape, plans, results, bandwidth, seconds) -> None:
    import torch

    train, decode = results["train"], results["decode"]
    plan = plans["qwenft"]
    plain = train["plain"]
    cuda = args.device.startswith("cuda")
    for arm, t in train.items():
        t["ratio_to_plain"] = t["median_s_per_step"] / plain["median_s_per_step"]
        rounds = round_ratios(train, arm, "plain", args.block)
        t["round_ratios_to_plain"] = rounds
        t["memory_ratio_to_plain"] = (t["peak_memory_bytes"] / plain["peak_memory_bytes"]
                                      if plain["peak_memory_bytes"] else None)
        t["final_loss_rel_diff_to_plain"] = abs(t["final_loss"] / plain["final_loss"] - 1)
        if arm in plans:  # comparable only on CUDA: on a CPU the measure is the process's resident set
            t["planned_peak_bytes"] = plans[arm]["train_peak_bytes"]
            t["plan_peak_error"] = plans[arm]["train_peak_bytes"] / t["peak_memory_bytes"] - 1 if cuda else None
    losses_match = all(t["final_loss_rel_diff_to_plain"] <= 1e-2 for t in train.values())
    ratio = train["qwenft"]["ratio_to_plain"]
    measured_train = train["qwenft"]["peak_memory_bytes"]
    plan["train_peak_error"] = train["qwenft"].get("plan_peak_error")
    build = results["build"][0]
    plan["weights_error"] = plan["weights_loaded_bytes"] / build["tensor_bytes"] - 1
    for row in decode:
        planned = plan["kv_cache_bytes"][str(row["batch"])]
        row["planned_kv_cache_bytes"] = planned
        row["kv_cache_error"] = planned / row["kv_cache_bytes"] - 1 if row["kv_cache_bytes"] else None
    timed = train["qwenft"]["timed_steps"]
    print_table(f"QLoRA training, batch {args.batch} x {args.seq} tokens, {args.blocks} blocks of {args.block} steps "
                f"per arm alternated, {timed} timed (s/step: median [p25, p75] (min-max); memory: "
                f"{results['memory_measure']})",
                ["arm", "s/step", "ratio to plain [rounds]", "tokens/s", "peak memory", "x plain", "plan peak",
                 "final loss (rel. diff)"],
                [[arm, f"{t['median_s_per_step']:.3f} [{t['p25_s_per_step']:.3f}, {t['p75_s_per_step']:.3f}] "
                       f"({t['min_s_per_step']:.3f}-{t['max_s_per_step']:.3f})",
                  f"{t['ratio_to_plain']:.3f} [{min(t['round_ratios_to_plain']):.3f}-"
                  f"{max(t['round_ratios_to_plain']):.3f}]" if t["round_ratios_to_plain"] else "-",
                  f"{t['tokens_per_s']:.0f}", _size(t["peak_memory_bytes"]), f"{t['memory_ratio_to_plain']:.2f}" if t["memory_ratio_to_plain"] is not None else "-",
                  _size(t["planned_peak_bytes"]) if "planned_peak_bytes" in t else "-",
                  f"{t['final_loss']:.4f} ({t['final_loss_rel_diff_to_plain']:.1e})"] for arm, t in train.items()])
    print(f"qwenft / plain seconds per step: {ratio:.3f}; final losses within 1e-2 of plain's: {losses_match}"
          + (f"; {results['liger_skipped']}: no liger arm" if "liger_skipped" in results else ""))
    print_decode(args, results)
    print(f"\nweights: {_size(build['tensor_bytes'])} built, planner {_size(plan['weights_loaded_bytes'])}; training "
          f"peak: planner {_size(plan['train_peak_bytes'])} vs measured {_size(measured_train)}"
          f"{'' if cuda else ' (process RSS: not comparable)'}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"total {seconds:.0f} s")
    name = "gpu_qlora_tiny" if args.tiny else "gpu_qlora_7b"
    save_json(name, {
        "benchmark": name, "mode": "tiny" if args.tiny else "full", "environment": _environment(args.device),
        "settings": {"device": args.device, "shape": shape, "quant": "nf4, double quant",
                     "compute_dtype": "bfloat16" if args.device.startswith("cuda") else "float32",
                     "lora": {"r": config.lora.r, "lora_alpha": config.lora.lora_alpha,
                              "lora_dropout": config.lora.lora_dropout,
                              "target_modules": list(config.lora.target_modules)},
                     "train": {"steps": args.steps, "block": args.block, "blocks": args.blocks,
                               "timed_steps_per_arm": timed, "batch": args.batch, "seq": args.seq,
                               "gradient_checkpointing": True, "optimizer": plan["optimizer"],
                               "autocast_bf16": plan["autocast"], "lr": config.train.lr},
                     "decode": _decode_settings(args),
                     "memory_measure": results["memory_measure"], "seed": args.seed,
                     "threads": torch.get_num_threads()},
        "copy_bandwidth_bytes_per_s": bandwidth, "build": results["build"], "train": train,
        "ratio_train_qwenft_over_plain": ratio, "losses_match_plain": losses_match,
        "liger_skipped": results.get("liger_skipped"), "decode": decode, "eval": results["eval"], "plan": plan,
        "plans": plans,
        "seconds_total": seconds,
    })


def _decode_settings(args) -> dict:
    return {"new_tokens": args.new_tokens, "short_tokens": max(1, args.new_tokens // 4), "prompt_len": args.prompt_len,
            "batches": args.decode_batches, "repeats": args.repeats, "eval_prompts": args.eval_prompts,
            "decoding": "greedy, min_new_tokens=max_new_tokens, repetition_penalty 1.05"}


def print_decode(args, results) -> None:
    """The decode table: per batch and arm, tokens/s (median of rounds [min-max]), x transformers' generate, the
    bandwidth fraction, warm-up seconds, tokens vs the arm's reference; then the eval timing."""
    for row in results["decode"]:
        print_table(f"greedy decode at batch {row['batch']}: {args.prompt_len} prompt tokens, tokens/s from "
                    f"{row['long_tokens']} - {row['short_tokens']} new tokens, median of {args.repeats} rounds",
                    ["arm", "tokens/s [min-max]", "x HF generate", "ceiling tok/s", "fraction", "warm-up s",
                     "peak memory", "vs reference"],
                    [[name, f"{a['tokens_per_s']:.1f} [{min(a['rounds']):.1f}-{max(a['rounds']):.1f}]",
                      f"{a['ratio_to_hf_generate']:.2f}", f"{a['ceiling_tokens_per_s']:.0f}",
                      f"{a['fraction_of_ceiling']:.1%}", f"{a['warmup_s']:.1f}", _size(a["peak_memory_bytes"]),
                      "same" if a["same_tokens"] else "row {row}, position {position}: margin {margin:.3g}".format(
                          **a["first_difference"])]
                     for name, a in row["arms"].items()])
    e = results["eval"]
    print(f"eval generation: {e['prompts']} prompts x {e['new_tokens']} tokens at batch {e['batch_size']}, base + "
          f"tuned {e['seconds_after_compiling']:.1f} s after compiling (first base pass {e['seconds']['base_first_pass']:.1f}"
          f" s); {e['path']}")


def report_decode(args, results, bandwidth) -> None:
    """``--decode-only``: the decode table and ``gpu_decode_7b.json`` (``gpu_decode_tiny.json`` in tiny mode)."""
    import torch

    print_decode(args, results)
    name = "gpu_decode_tiny" if args.tiny else "gpu_decode_7b"
    save_json(name, {"benchmark": name, "mode": "tiny" if args.tiny else "full",
                     "environment": _environment(args.device),
                     "settings": {"device": args.device, "decode": _decode_settings(args), "seed": args.seed,
                                  "threads": torch.get_num_threads()},
                     "copy_bandwidth_bytes_per_s": bandwidth, "build": results["build"], "decode": results["decode"],
                     "eval": results["eval"], "memory_measure": results["memory_measure"]})


def _environment(device: str) -> dict:
    import torch

    info = environment()
    info["accelerate"] = __import__("accelerate").__version__
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update({"gpu": props.name, "gpu_memory_bytes": props.total_memory,
                     "cuda_runtime": torch.version.cuda, "capability": f"{props.major}.{props.minor}"})
    return info


if __name__ == "__main__":
    main()
