"""The decode phase of the one-GPU check (issue 18): qwenft's decode paths against transformers' generate.

Arms, all greedy with exactly N new tokens per row (``min_new_tokens = max_new_tokens``) from the same random
token-id prompts, on a random 7B-shaped model (same seed, same weights in every copy):

- ``nf4_dynamic``: qwenft's sampler on the NF4 model, dynamic cache (what 4-bit decoding costs);
- ``nf4_compiled``: the same with ``generate.compile=true`` (static cache + CUDA graphs; static cache only on a CPU);
- ``bf16_compiled``: the NF4 weights dequantized once to 16-bit, compiled (eval's fast path, base side);
- ``tuned_folded_compiled``: a LoRA adapter (random B) folded into those 16-bit weights, compiled (tuned side);
- ``hf_generate``: ``model.generate`` on the NF4 model (transformers' default dynamic cache).

Timing: every arm is warmed up first (its compiles happen there and are timed apart), then the arms alternate over
``repeats`` rounds. Each round times one short call (``N // 4`` tokens) and one long call (``N`` tokens), each a
whole call with the device synchronised after it and no hooks inside; decode tokens/s is
``batch * (N - N // 4) / (t_long - t_short)``, so the prefill and fixed per-call costs cancel. Static-cache arms run
both calls at one cache length, so the difference is only decode steps.

Agreement: each arm's tokens against its reference (``nf4_dynamic`` for the base arms, adapter-on-base in 16-bit
for the folded arm): equal, or the first (row, position) where they differ and the reference's logit margin there
(its logit of its own token minus its logit of the other arm's token: a small margin is a float-noise near-tie).

Bandwidth: each arm's ceiling is ``batch * bandwidth / bytes read per step`` (the weights it reads,
:func:`benchmarks.sampler.weight_bytes_per_step`, plus the KV cache it attends over) and its fraction is measured
over ceiling.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Dict, List


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def build_models(build, tokenizer, lora_cfg, seed: int) -> Dict[str, object]:
    """The three weight sets: ``nf4``; ``dense`` (a second NF4 build, dequantized); ``folded`` (a third, LoRA with
    random B attached, dequantized, then unwrapped and folded) and ``tuned_ref`` (a fourth: adapter-on-base, 16-bit,
    the folded arm's reference)."""
    import torch

    from qwenft.config import QuantConfig
    from qwenft.model import attach_lora
    from qwenft.model.fold import unwrap
    from qwenft.model.load import dequantize_for_inference

    models = {"nf4": build()}
    dense = build()
    dequantize_for_inference(dense, QuantConfig(), enabled=True)
    models["dense"] = dense

    def tuned():
        peft_model = attach_lora(build(), lora_cfg, gradient_checkpointing=False)
        torch.manual_seed(seed + 7)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
        peft_model.eval()
        dequantize_for_inference(peft_model, QuantConfig(), enabled=True)
        return peft_model

    models["tuned_ref"] = tuned()
    plain, fold = unwrap(tuned())
    fold.fold_()
    models["folded"] = plain
    return models


def _first_difference(ref_tokens, ref_logits, other_tokens):
    """``None`` when equal, else ``{"row", "position", "margin"}`` of the first differing token (margin from the
    reference's raw logits at that step: its token's logit minus the other's)."""
    for row, (a, b) in enumerate(zip(ref_tokens, other_tokens)):
        for pos, (x, y) in enumerate(zip(a, b)):
            if x != y:
                step = ref_logits[pos][row]
                return {"row": row, "position": pos, "margin": float(step[x] - step[y])}
    return None


def decode_arms(models, tokenizer, args, bandwidth: float, memory) -> List[dict]:
    """Run every arm at each of ``args.decode_batches``; one result row per batch (see the module docstring)."""
    import torch

    from benchmarks.sampler import weight_bytes_per_step
    from qwenft.config import GenerateConfig
    from qwenft.generation import Sampler
    from qwenft.generation.generate import bucket_length
    from qwenft.plan import kv_cache_bytes
    from qwenft.plan.arch import Architecture

    device = args.device
    cuda = device.startswith("cuda")
    compiled = GenerateConfig(compile="true") if cuda else GenerateConfig(compile="false", static_cache=True)
    plain = GenerateConfig(compile="false")
    samplers = {"nf4_dynamic": Sampler(models["nf4"], tokenizer, plain),
                "nf4_compiled": Sampler(models["nf4"], tokenizer, compiled),
                "bf16_compiled": Sampler(models["dense"], tokenizer, compiled),
                "tuned_folded_compiled": Sampler(models["folded"], tokenizer, compiled)}
    refs = {"tuned_folded_compiled": Sampler(models["tuned_ref"], tokenizer, plain)}
    weights = {"nf4_dynamic": weight_bytes_per_step(models["nf4"]), "hf_generate": weight_bytes_per_step(models["nf4"])}
    weights["nf4_compiled"] = weights["nf4_dynamic"]
    weights["bf16_compiled"] = weight_bytes_per_step(models["dense"])
    weights["tuned_folded_compiled"] = weight_bytes_per_step(models["folded"])
    arch = Architecture.from_config_dict(models["nf4"].config.to_dict(), "built model")
    long, short = args.new_tokens, max(1, args.new_tokens // 4)
    generator = torch.Generator().manual_seed(args.seed + 1)
    vocab = models["nf4"].config.vocab_size
    rows = []
    for batch in args.decode_batches:
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=generator)
        lists, ids = prompts.tolist(), prompts.to(device)
        length = bucket_length(args.prompt_len + long)

        def ours(name, n, keep=False):
            sampler = samplers.get(name) or refs[name]
            shape = {"cache_len": length} if sampler.static else {}
            return sampler.generate(lists, max_new_tokens=n, min_new_tokens=n, do_sample=False, keep_logits=keep,
                                    **shape)

        def hf(n):
            with torch.inference_mode():
                return models["nf4"].generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                              min_new_tokens=n, do_sample=False)

        calls = {name: (lambda n, name=name: ours(name, n)) for name in samplers}
        calls["hf_generate"] = hf
        result = {"batch": batch, "prompt_len": args.prompt_len, "long_tokens": long, "short_tokens": short,
                  "static_cache_len": length, "arms": {}}
        for name, fn in calls.items():  # warm-up: the compiles of both call lengths happen here
            memory.reset()
            _, first = _timed(lambda: fn(long), device)
            _, second = _timed(lambda: fn(short), device)
            result["arms"][name] = {"warmup_s": first + second, "peak_memory_bytes": memory.peak(), "rounds": []}
        for _ in range(args.repeats):
            for name, fn in calls.items():
                _, t_short = _timed(lambda: fn(short), device)
                _, t_long = _timed(lambda: fn(long), device)
                result["arms"][name]["rounds"].append(batch * (long - short) / max(t_long - t_short, 1e-9))
        reference = ours("nf4_dynamic", long, keep=True)
        ref_tokens = [s.token_ids for s in reference.sequences]
        tuned_reference = refs["tuned_folded_compiled"].generate(lists, max_new_tokens=long, min_new_tokens=long,
                                                                 do_sample=False, keep_logits=True)
        tokens = {name: [s.token_ids for s in ours(name, long).sequences] for name in samplers}
        tokens["hf_generate"] = hf(long)[:, args.prompt_len:].tolist()
        for name, arm in result["arms"].items():
            if name == "tuned_folded_compiled":
                ref_t = [s.token_ids for s in tuned_reference.sequences]
                diff = _first_difference(ref_t, tuned_reference.logits, tokens[name])
                arm["reference"] = "adapter-on-base, 16-bit, dynamic cache"
            else:
                diff = _first_difference(ref_tokens, reference.logits, tokens[name])
                arm["reference"] = "nf4_dynamic"
            arm["same_tokens"] = diff is None
            arm["first_difference"] = diff
            arm["tokens_per_s"] = statistics.median(arm["rounds"])
            attended = length if name.endswith("compiled") else args.prompt_len + (short + long) // 2
            arm["bytes_per_step"] = weights[name] + batch * kv_cache_bytes(arch, attended)
            arm["ceiling_tokens_per_s"] = batch * bandwidth / arm["bytes_per_step"]
            arm["fraction_of_ceiling"] = arm["tokens_per_s"] / arm["ceiling_tokens_per_s"]
        hf_speed = result["arms"]["hf_generate"]["tokens_per_s"]
        for arm in result["arms"].values():
            arm["ratio_to_hf_generate"] = arm["tokens_per_s"] / hf_speed
        result["generated_per_row"] = [len(t) for t in ref_tokens]
        result["kv_cache_bytes"] = reference.stats.kv_cache_bytes
        rows.append(result)
        print(f"  decode batch {batch}: " + ", ".join(f"{n} {a['tokens_per_s']:.1f} tok/s "
                                                      f"({a['fraction_of_ceiling']:.1%})"
                                                      for n, a in result["arms"].items()), flush=True)
    return rows


def eval_timing(models, tokenizer, config, args, device: str) -> dict:
    """An evaluation's generation as ``qwenft eval`` runs it: ``args.eval_prompts`` prompts of 16-64 random tokens,
    ``args.new_tokens`` each, base side then tuned side folded, through :func:`qwenft.generation.batches.generate_many`
    on one sampler. The base side runs twice: the first pass compiles (timed apart), the second and the tuned side
    are the evaluation "after compiling"."""
    import dataclasses

    import torch

    from qwenft.generation import Sampler
    from qwenft.generation.batches import generate_many
    from qwenft.generation.engine import batch_sizes, prepare_for_decoding

    generator = torch.Generator().manual_seed(args.seed + 2)
    vocab = models["nf4"].config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(16, 65, (args.eval_prompts,), generator=generator)]
    prompt_len = max(len(p) for p in prompts)
    model = copy.deepcopy(models["tuned_ref"])
    # fold_lora=true: the CUDA default, forced so that a CPU run takes the same path (compile stays auto: CUDA only)
    config = dataclasses.replace(config, generate=dataclasses.replace(config.generate, fold_lora="true"))
    engine = prepare_for_decoding(model, config, cache_len=prompt_len + args.new_tokens, prompt_len=prompt_len)
    rows, _ = batch_sizes(config, engine.model, prompt_len + args.new_tokens, prompt_len)
    settings = engine.settings(config.generate)
    sampler = Sampler(engine.model, tokenizer, settings)
    seconds = {}
    for label, side in (("base_first_pass", "base"), ("base", "base"), ("tuned", "tuned")):
        with engine.side(side):
            _, seconds[label] = _timed(lambda: generate_many(sampler, prompts, rows, max_new_tokens=args.new_tokens,
                                                             min_new_tokens=args.new_tokens, do_sample=False), device)
    return {"prompts": len(prompts), "new_tokens": args.new_tokens, "batch_size": rows, "path": engine.path.reason,
            "compiled": sampler.compiled, "seconds": seconds,
            "seconds_after_compiling": seconds["base"] + seconds["tuned"]}
