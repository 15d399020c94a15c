"""Wall time of merge.quantize's GPTQ and AWQ steps on a finished merge at a given calibration size (default: the
command's default, 128 rows).

    python -m benchmarks.quantize_time --merged DIR --adapter RUN/adapter [--rows 128] [--methods gptq,awq]

DIR is a finished merge of RUN/adapter. The calibration rows are drawn by the command's own
:func:`qwenft.export.w4a16.calibration_rows` from the run's training examples (the data its ``qwenft.json``
records), with the first source's ``max_rows`` lifted so that a small run such as the quickstart (60 distinct
examples) still yields 128 rows of the same data and lengths. Each method runs exactly as the merge command runs it
(:func:`qwenft.export.w4a16.quantize_w4a16`: a child interpreter that loads the merge, runs llm-compressor's
``oneshot`` and saves the compressed-tensors directory). Recorded per method: the step's wall time (child start to
saved directory), ``oneshot``'s own seconds, the child's CPU seconds, the load average before and after, and the
directory's size; the directory is then removed. There is no baseline arm: the issue's target is absolute (<= 10
minutes for the 0.5B on 2 cores), so the load average and the CPU seconds are what qualify the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _child_cpu() -> float:
    """CPU seconds (user + system) of the finished children so far: with the machine shared, a child's CPU time
    over its threads (2 here) estimates its wall time on an idle machine better than its wall time does."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merged", required=True, type=Path, help="a finished merge directory")
    parser.add_argument("--adapter", required=True, type=Path, help="the run's adapter the merge was made from")
    parser.add_argument("--rows", type=int, default=128, help="calibration rows (merge.calibration_rows)")
    parser.add_argument("--methods", default="gptq,awq")
    parser.add_argument("--awq-n-grid", type=int, default=None, help="try another AWQ grid than the command's")
    parser.add_argument("--name", default="quantize_time", help="results file name (benchmarks/results/NAME.json)")
    args = parser.parse_args()

    from benchmarks.common import environment, print_table, save_json
    from qwenft import data as data_lib
    from qwenft.export import w4a16
    from qwenft.export.quantize import run_config
    from qwenft.model import load_tokenizer
    from tests.conftest import compose_config

    config = compose_config(f"adapter={args.adapter}", f"out={args.merged}", command="merge")
    cfg = run_config(config, args.adapter)
    sources = [dataclasses.replace(cfg.data.sources[0], max_rows=None), *cfg.data.sources[1:]]
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=sources))
    bundle = data_lib.build(cfg, load_tokenizer(str(args.merged)))
    rows, distinct = w4a16.calibration_rows(bundle.train, args.rows, config.merge.calibration_seed)
    tokens = sum(len(r) for r in rows)
    print(f"{len(rows)} calibration rows of {distinct} distinct, {tokens} tokens")
    if args.awq_n_grid is not None:  # the child reads RECIPES through the spec it is given
        w4a16.RECIPES["awq"] = {**w4a16.RECIPES["awq"], "n_grid": args.awq_n_grid}

    results = {}
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory(prefix="qwenft-bench-", dir=args.merged.parent) as work:  # beside DIR
            target = Path(work) / method
            target.mkdir()
            before, start, cpu = _load(), time.perf_counter(), _child_cpu()
            oneshot = w4a16.quantize_w4a16(args.merged, target, method, rows, config.merge.dtype,
                                           config.merge.calibration_seed)
            wall, cpu = time.perf_counter() - start, _child_cpu() - cpu
            size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
            results[method] = {"recipe": w4a16.RECIPES[method], "wall_seconds": round(wall, 1),
                               "oneshot_seconds": round(oneshot, 1), "cpu_seconds": round(cpu, 1),
                               "bytes": size,
                               "load_average_before": before, "load_average_after": _load()}
            shutil.rmtree(target)
        print(method, results[method])
    header = ["method", "wall s", "oneshot s", "CPU s", "load"]
    print_table(f"quantize step, {len(rows)} rows / {tokens} tokens", header,
                [[m, r["wall_seconds"], r["oneshot_seconds"], r["cpu_seconds"], f"{r['load_average_before']} -> "
                  f"{r['load_average_after']}"] for m, r in results.items()])
    save_json(args.name, {"benchmark": "quantize_time", "environment": environment(),
                          "torch_threads": os.environ.get("OMP_NUM_THREADS", "torch default"),
                          "calibration": {"rows": len(rows), "distinct": distinct, "tokens": tokens},
                          "methods": results})


if __name__ == "__main__":
    main()
