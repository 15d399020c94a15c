"""MMLU questions/s of qwenft's lm-eval model (``QwenftLM``) vs lm-eval's own ``HFLM``, same model, same questions.

Both arms are lm-eval ``LM`` objects over the same loaded model and tokenizer, in one process, asked by
``lm_eval.evaluator.evaluate`` the same MMLU questions (lm-eval's own ``mmlu_SUBJECT`` tasks over the local CSVs,
5-shot, :func:`qwenft.evaluate.bench_tasks.prepare`):

- ``hflm``: ``lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=tokenizer, batch_size=B)``, its defaults
  otherwise (every distinct context run whole; the four one-token choices of a question read from one row, its
  ``logits_cache``; the log-softmax over the full ``[batch, seq, vocab]`` logits, in the model's dtype);
- ``qwenft``: :class:`qwenft.evaluate.bench_lm.QwenftLM` (``batch_size=B``), which scores through
  :func:`qwenft.evaluate.bench_score.score_pairs`: a subject's 5 shots (the prompts' shared prefix) prefilled once
  and their KV cache copied for each batch of that subject's questions, the four choices from one row, only the read
  positions projected onto the vocabulary (fp32 log-softmax).

Questions: K subjects chosen by ``eval.bench_seed`` (the seeded order of ``bench_sample.select``), M questions
from each (the subject's own seeded order), as full MMLU looks (~246 questions a subject, so the shots are shared by
many questions; one question per subject would leave qwenft nothing to share). The arms alternate subject by
subject in ABBA order (qwenft, HFLM | HFLM, qwenft | qwenft, HFLM ...): each arm answers every question once, and a
machine that speeds up or slows down during the run does not favour either. Reported per dtype: questions/s of each
arm (questions / summed seconds), the ratio qwenft / HFLM (target >= 3), the same ratio per subject, accuracy, how
many questions get the same prediction (the arg-max choice) from both arms, the largest |log-likelihood difference|
over every choice, and for each question whose prediction differs the margin by which each arm preferred its choice
(``margin_hflm = ll_hflm[hflm's choice] - ll_hflm[qwenft's choice]`` and the same for qwenft; the question's margin
is the larger of the two: how far from a tie it is in either arm), with the smallest and largest such margin.
Beside the times, the tokens each arm ran through the decoder body (a forward pre-hook; padding included): their
ratio is the work qwenft's plan saves, so ``ratio / token ratio`` is what a token costs HFLM relative to qwenft.

In float32 the predictions should all agree (only summation order separates the arms: cached prefix vs
one pass); the script exits with status 1, after saving the JSON, when a float32 log-likelihood differs by more than
1e-3 or a float32 prediction differs by more than a 1e-3 margin. In bfloat16 HFLM's log-softmax runs in bfloat16
(its default, ``softmax_dtype=None``: ~3 significant digits) while qwenft's runs in fp32, so near ties may flip.

Model: the embedded Qwen2.5-Coder-0.5B-Instruct, ``AutoModelForCausalLM.from_pretrained(dir, dtype=...)`` per dtype
(float32 then bfloat16), eval mode. ``--quick`` (alias ``--tiny``): the tiny-random model, 2 subjects x 2
questions, for the suite's quick mode and the test (seconds; the test gives invented files in MMLU's layout).

    python benchmarks/bench_eval.py                    # 4 subjects x 16 questions, float32 + bfloat16, batch 8
    python benchmarks/bench_eval.py --dtypes float32 --subjects 4 --per-subject 12
    python benchmarks/bench_eval.py --quick            # tiny-random, seconds

Cost on 2 cores (2026-12-02, load average 0.5-2.8): the default run took 8.1 minutes (float32: HFLM 269 s, qwenft
79 s, 3.43x; bfloat16: HFLM 100 s, qwenft 18.5 s, 5.43x; the rest loading and lm-eval's task set-up). The four
subjects seed 0 picks have 286-474-token prompts, of which the shots are 243-414; at 16 questions a subject HFLM runs
4.1x the tokens qwenft does (at 6 a subject 3.2x, and the ratio measured 2.6x / 2.4x on 2026-12-01 at load 5-7; at a
whole subject, ~100-550 questions, the shots are shared far more widely).

Skips (exit status 0, a line starting with ``SKIPPED:``, no JSON) when ``--data``'s (default ../shared/data/bench)
mmlu/ is absent: qwenft ships no benchmark data.
Results: benchmarks/results/bench_eval.json (bench_eval_quick.json).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_BENCH = ROOT.parent / "shared" / "data" / "bench"
FP32_TOLERANCE = 1e-3  # nats: largest float32 |log-likelihood difference| (and differing-prediction margin) allowed
ARMS = ("qwenft", "hflm")


def load_average() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def choose_questions(config, subjects: int, per_subject: int):
    """``(benchmark, samples)``: the mmlu benchmark with ``subjects`` subjects chosen in the seeded order of
    :func:`qwenft.evaluate.bench_sample.select`, and ``per_subject`` doc ids from each (its seeded order)."""
    from qwenft.evaluate.bench_tasks import _docs, prepare, select

    [bench] = prepare(config)  # bench_limit = subjects, bench_block = 1: one question from each of `subjects`
    samples = {}
    for task_name, task in bench.tasks.items():
        samples.update(select({task_name: _docs(task)}, per_subject, config.eval.bench_seed))
    return bench, samples


def _logliks(sample: dict) -> List[float]:
    """Each choice's log-likelihood from one logged lm-eval sample (filter ``none``)."""
    out = []
    for resp in sample["filtered_resps"]:
        value = resp[0] if isinstance(resp, (tuple, list)) else resp
        out.append(float(value))
    return out


def run_arm(lm, bench, task_names: List[str], samples: Dict[str, List[int]]):
    """One timed ``evaluate`` of ``lm`` on ``task_names``; returns ``(seconds, {(task, doc_id): record})``."""
    from lm_eval.evaluator import evaluate

    tasks = {t: bench.tasks[t] for t in task_names}
    chosen = {t: samples[t] for t in task_names}
    start = time.perf_counter()
    out = evaluate(lm, {"tasks": tasks, "groups": {}}, samples=chosen, log_samples=True, bootstrap_iters=0,
                   verbosity="WARNING")
    seconds = time.perf_counter() - start
    records = {}
    for task, rows in out["samples"].items():
        for sample in rows:
            if sample.get("filter", "none") != "none":
                continue
            lls = _logliks(sample)
            records[(task, int(sample["doc_id"]))] = {
                "lls": lls, "pred": max(range(len(lls)), key=lls.__getitem__),  # first arg-max, as lm-eval's acc
                "acc": float(sample["acc"])}
    return seconds, records


def compare(ours: Dict[tuple, dict], hf: Dict[tuple, dict]) -> Dict[str, Any]:
    """Same predictions, largest |log-likelihood difference|, and the questions whose predictions differ."""
    if set(ours) != set(hf):
        raise SystemExit(f"the arms answered different questions: {sorted(set(ours) ^ set(hf))[:5]}")
    differing, max_diff = [], 0.0
    for key in sorted(ours):
        a, b = ours[key], hf[key]
        max_diff = max(max_diff, *(abs(x - y) for x, y in zip(a["lls"], b["lls"])))
        if a["pred"] != b["pred"]:
            differing.append({"task": key[0], "doc_id": key[1], "qwenft_choice": a["pred"], "hflm_choice": b["pred"],
                              "margin_hflm": b["lls"][b["pred"]] - b["lls"][a["pred"]],
                              "margin_qwenft": a["lls"][a["pred"]] - a["lls"][b["pred"]],
                              "qwenft_logliks": a["lls"], "hflm_logliks": b["lls"]})
    margins = [max(d["margin_hflm"], d["margin_qwenft"]) for d in differing]
    return {"same_predictions": len(ours) - len(differing), "differing": differing,
            "smallest_margin_of_differing": min(margins, default=None),
            "largest_margin_of_differing": max(margins, default=None), "max_abs_loglik_diff": max_diff}


def context_tokens(bench, samples, tokenizer) -> Dict[str, float]:
    """Mean prompt length (tokens, shots included) per subject, as lm-eval renders the prompt."""
    out = {}
    for task_name, ids in samples.items():
        task = bench.tasks[task_name]
        docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
        lengths = [len(tokenizer(task.fewshot_context(docs[i], num_fewshot=5)).input_ids) for i in ids]
        out[task_name] = sum(lengths) / len(lengths)
    return out


def run_dtype(dtype_name: str, model_dir: str, bench, samples, batch: int) -> Dict[str, Any]:
    """Load the model in ``dtype_name``, run both arms subject by subject in ABBA order, compare."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    from qwenft.evaluate.bench_lm import QwenftLM
    from qwenft.generation import Sampler
    from qwenft.model import load_tokenizer

    dtype = getattr(torch, dtype_name)
    start = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    load_seconds = time.perf_counter() - start
    # Both built before anything is timed: whatever HFLM's constructor sets on the shared tokenizer/model holds for
    # every call of both arms.
    lms = {"qwenft": QwenftLM(model, tokenizer, Sampler(model, tokenizer), batch_size=batch),
           "hflm": HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch)}
    with torch.inference_mode():  # warm-up: kernels, thread pools, allocator (not timed, both arms alike)
        model(input_ids=torch.arange(64)[None] + 100)
    # Tokens through the decoder body per arm (padding included): both arms call it (HFLM via the causal LM's
    # forward, qwenft directly, with a cached prefix), so the counts say how much work each arm's plan asks for.
    arm_now = [None]
    tokens = {arm: {"tokens": 0, "forwards": 0} for arm in ARMS}

    def count(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if arm_now[0] is not None and ids is not None:
            tokens[arm_now[0]]["tokens"] += int(ids.numel())
            tokens[arm_now[0]]["forwards"] += 1

    hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
    seconds = {arm: {} for arm in ARMS}
    records: Dict[str, Dict[tuple, dict]] = {arm: {} for arm in ARMS}
    loads, order = [], []
    subjects = sorted(samples)
    print(f"\n{dtype_name}: model loaded in {load_seconds:.1f} s; {sum(map(len, samples.values()))} questions, "
          f"{len(subjects)} subjects, batch {batch}, ABBA by subject", flush=True)
    for index, subject in enumerate(subjects):
        for arm in (ARMS if index % 2 == 0 else ARMS[::-1]):
            before = load_average()
            arm_now[0] = arm
            took, got = run_arm(lms[arm], bench, [subject], samples)
            arm_now[0] = None
            seconds[arm][subject] = took
            records[arm].update(got)
            loads.append({"subject": subject, "arm": arm, "before": before, "after": load_average()})
            order.append(arm)
            print(f"  {dtype_name} {subject} {arm}: {len(got)} questions in {took:.1f} s "
                  f"({len(got) / took:.3f} q/s), load average {load_average()}", flush=True)
    hook.remove()
    n = len(records["qwenft"])
    totals = {arm: sum(seconds[arm].values()) for arm in ARMS}
    qps = {arm: n / totals[arm] for arm in ARMS}
    result = {"dtype": dtype_name, "questions": n, "model_load_seconds": load_seconds, "order": order,
              "seconds": totals, "seconds_by_subject": seconds, "questions_per_s": qps,
              "ratio_qwenft_over_hflm": qps["qwenft"] / qps["hflm"],
              "ratio_by_subject": {s: seconds["hflm"][s] / seconds["qwenft"][s] for s in subjects},
              "model_tokens": tokens,
              "token_ratio_hflm_over_qwenft": tokens["hflm"]["tokens"] / max(1, tokens["qwenft"]["tokens"]),
              "accuracy": {arm: sum(r["acc"] for r in records[arm].values()) / n for arm in ARMS},
              **compare(records["qwenft"], records["hflm"]), "load_average": loads}
    del lms, model
    gc.collect()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", "--tiny", action="store_true",
                        help="tiny-random model, 2 subjects x 2 questions")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes, run in order")
    parser.add_argument("--subjects", type=int, default=None, help="MMLU subjects (default 4; quick 2)")
    parser.add_argument("--per-subject", type=int, default=None, help="questions per subject (default 16; quick 2)")
    parser.add_argument("--batch", type=int, default=8, help="batch_size of both arms")
    parser.add_argument("--seed", type=int, default=0, help="eval.bench_seed: which subjects and questions")
    parser.add_argument("--data", default=None, help="directory holding mmlu/ (default ../shared/data/bench; "
                                                     "qwenft ships no benchmark data)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    data = Path(args.data) if args.data else SHARED_BENCH
    if not (data / "mmlu").is_dir():
        print(f"SKIPPED: {data / 'mmlu'} is not present (this benchmark reads MMLU's CSVs)")
        return 0
    import torch

    from qwenft.model.sources import resolve_model_dir
    from tests.conftest import compose_config

    if args.threads:
        torch.set_num_threads(args.threads)
    started, load_start = time.perf_counter(), load_average()
    subjects = args.subjects or (2 if args.quick else 4)
    per_subject = args.per_subject or (2 if args.quick else 16)
    config = compose_config(*(["model=tiny-random"] if args.quick else []), "eval.benchmarks=[mmlu]",
                            f"eval.bench_data=[{data.resolve()}]", f"eval.bench_limit={subjects}", "eval.bench_block=1",
                            f"eval.bench_seed={args.seed}", "out_dir=/tmp/qwenft-bench-eval", command="eval")
    model_dir = resolve_model_dir(config.model)
    torch.manual_seed(0)
    bench, samples = choose_questions(config, subjects, per_subject)
    from qwenft.model import load_tokenizer

    prompt_tokens = context_tokens(bench, samples, load_tokenizer(model_dir))
    print(f"{config.model.name}: {sum(map(len, samples.values()))} MMLU questions from {data / 'mmlu'}: "
          + ", ".join(f"{t} x{len(ids)} (~{prompt_tokens[t]:.0f} prompt tokens)" for t, ids in samples.items()),
          flush=True)
    runs = [run_dtype(name.strip(), model_dir, bench, samples, args.batch)
            for name in args.dtypes.split(",") if name.strip()]
    total = time.perf_counter() - started

    print_table(f"MMLU 5-shot, {runs[0]['questions']} questions ({len(samples)} subjects x {per_subject}), "
                f"{config.model.name}, batch {args.batch}, qwenft vs lm-eval HFLM, {total / 60:.1f} min",
                ["dtype", "arm", "seconds", "questions/s", "ratio", "model tokens", "accuracy", "same preds",
                 "max |dll|", "differing (smallest margin)"],
                [[r["dtype"], arm, f"{r['seconds'][arm]:.1f}", f"{r['questions_per_s'][arm]:.3f}",
                  f"{r['ratio_qwenft_over_hflm']:.2f}x" if arm == "qwenft" else "1 (baseline)",
                  f"{r['model_tokens'][arm]['tokens']} in {r['model_tokens'][arm]['forwards']} forwards",
                  f"{r['accuracy'][arm]:.3f}", f"{r['same_predictions']}/{r['questions']}",
                  f"{r['max_abs_loglik_diff']:.1e}",
                  f"{len(r['differing'])}" + (f" ({r['smallest_margin_of_differing']:.2e})" if r["differing"] else "")]
                 for r in runs for arm in ARMS])
    for r in runs:
        print(f"{r['dtype']}: ratio qwenft / HFLM questions/s {r['ratio_qwenft_over_hflm']:.2f} (target >= 3); "
              "by subject " + ", ".join(f"{s.removeprefix('mmlu_')} {v:.2f}" for s, v in r["ratio_by_subject"].items())
              + f"; HFLM runs {r['token_ratio_hflm_over_qwenft']:.2f}x the tokens through the model")
    load_end = load_average()
    print(f"load average (1, 5, 15 min) at start {load_start}, at end {load_end}; {os.cpu_count()} CPUs")
    save_json("bench_eval_quick" if args.quick else "bench_eval", {
        "benchmark": "bench_eval", "environment": environment(),
        "settings": {"model": config.model.name, "model_dir": model_dir, "data": str(data / "mmlu"),
                     "subjects": sorted(samples), "per_subject": per_subject,
                     "questions": dict(sorted(samples.items())),
                     "seed": args.seed, "batch": args.batch, "shots": 5, "threads": torch.get_num_threads(),
                     "order": "ABBA by subject (qwenft first on even subjects, HFLM first on odd)",
                     "hflm": f"HFLM(pretrained=model, tokenizer=tokenizer, batch_size={args.batch}), defaults",
                     "qwenft": f"QwenftLM(model, tokenizer, Sampler(model, tokenizer), batch_size={args.batch})",
                     "prompt_tokens_by_subject": prompt_tokens},
        "seconds_total": total, "load_average_start": load_start, "load_average_end": load_end,
        "runs": runs, "ratio_qwenft_over_hflm": {r["dtype"]: r["ratio_qwenft_over_hflm"] for r in runs},
        "target": "ratio >= 3 (questions/s); identical predictions in float32", "fp32_tolerance": FP32_TOLERANCE,
    })
    bad = [r for r in runs if r["dtype"] == "float32" and (r["max_abs_loglik_diff"] > FP32_TOLERANCE or any(
        max(d["margin_hflm"], d["margin_qwenft"]) > FP32_TOLERANCE for d in r["differing"]))]
    if bad:
        print(f"FAILED: float32 log-likelihoods differ by {bad[0]['max_abs_loglik_diff']:.2e} (tolerance "
              f"{FP32_TOLERANCE:g}) or a float32 prediction differs beyond a near tie", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
