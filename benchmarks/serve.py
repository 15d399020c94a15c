"""qwenft serve under concurrent streaming clients: aggregate tokens/s at N clients vs 1, from batching.

The server (``python -m qwenft serve``, a child process on 127.0.0.1 and a free port) serves the embedded 0.5B
model (or ``--model tiny-random``). First every prompt is asked alone, greedy and not streamed: the reference
answers. Then the arms alternate for ``--rounds`` rounds: the same ``len(prompts)`` streaming greedy requests sent
by 1 client (one after another) or by N clients at once (each its share). Per arm: failed requests, answers equal
to the reference, aggregate tokens/s (completion tokens / wall seconds), time to first token p50 / p95 (from
sending to the first content chunk). The ratio is N-client tokens/s over 1-client tokens/s, median over rounds
(target >= 3 at 8 clients on 2 cores). Bounded: ``--max-tokens`` per request, ``--timeout`` seconds per request, the
server stopped with SIGTERM at the end (or killed). Results: ``benchmarks/results/serve.json`` (or ``$OUT``).

    python benchmarks/serve.py                         # embedded 0.5B, 1 vs 8 clients, 8 prompts x 32 tokens
    python benchmarks/serve.py --model tiny-random --clients 1,4 --max-tokens 8 --rounds 1   # a quick check
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from benchmarks.common import environment, print_table, save_json  # noqa: E402

PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?", "Name three prime numbers.",
           "Explain what a KV cache is in one sentence.", "Translate 'good morning' into French.",
           "Give a synonym for 'quick'.", "What colour is the sky on Mars?", "Write one line of Python that sums a list."]


def start_server(model: str, max_batch: int, startup_s: float):
    """Start ``qwenft serve`` on a free port; returns ``(process, base_url)``."""
    args = [sys.executable, "-m", "qwenft", "serve", "serve.port=0", f"serve.max_batch={max_batch}"]
    if model != "embedded":
        args += [f"model={model}", "quant=none"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if line.startswith("qwenft serve: http://"):
            return proc, line.split()[2].rstrip("/")
    proc.kill()
    raise SystemExit(f"the server did not start within {startup_s:.0f} s")


def stop_server(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stream_one(client, prompt: str, max_tokens: int) -> dict:
    """One streaming greedy request: its text, completion tokens, time to first token (s), or its error."""
    start = time.perf_counter()
    first, parts, tokens = None, [], 0
    try:
        stream = client.chat.completions.create(model="base", messages=[{"role": "user", "content": prompt}],
                                                temperature=0, max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first if first is not None else time.perf_counter() - start
                    parts.append(choice.delta.content)
    except Exception as exc:  # counted as a failed request, the benchmark goes on
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"text": "".join(parts), "tokens": tokens, "ttft_s": first if first is not None else float("nan")}


def run_arm(client, prompts, clients: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(lambda p: stream_one(client, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    done = [r for r in results if "error" not in r]
    return {"clients": clients, "wall_s": wall, "results": results, "failed": len(results) - len(done),
            "tokens": sum(r["tokens"] for r in done), "tokens_per_s": sum(r["tokens"] for r in done) / wall}


def percentile(values, q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded (the default 0.5B) or a conf/model preset")
    parser.add_argument("--clients", default="1,8", help="client counts, the first the baseline (default 1,8)")
    parser.add_argument("--prompts", type=int, default=8, help="requests per arm (default 8)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the arms (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request at most")
    parser.add_argument("--startup", type=float, default=600.0, help="seconds for the server to load at most")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results or $OUT)")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(args.prompts)]
    from openai import OpenAI

    proc, url = start_server(args.model, max(counts), args.startup)
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=args.timeout)
        stream_one(client, "warm up", 4)
        reference = {}
        for prompt in prompts:  # alone, not streamed: the sequential answers
            reply = client.chat.completions.create(model="base", messages=[{"role": "user", "content": prompt}],
                                                   temperature=0, max_tokens=args.max_tokens)
            reference[prompt] = reply.choices[0].message.content
        arms = {n: [] for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                arm = run_arm(client, prompts, n, args.max_tokens)
                arm["equal_to_sequential"] = sum(r.get("text") == reference[p] for p, r in zip(prompts, arm["results"]))
                arms[n].append(arm)
    finally:
        exit_code = stop_server(proc)
    base = counts[0]
    summary = {}
    for n, runs in arms.items():
        ttfts = [r["ttft_s"] for run in runs for r in run["results"] if "ttft_s" in r]
        summary[n] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                      "failed": sum(r["failed"] for r in runs),
                      "equal_to_sequential": sum(r["equal_to_sequential"] for r in runs),
                      "requests": sum(len(r["results"]) for r in runs),
                      "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95)}
    for n in counts:
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(arms[n], arms[base]) if b["tokens_per_s"]]
        summary[n]["ratio_to_baseline"] = statistics.median(ratios) if ratios else float("nan")
    print_table(f"qwenft serve, {args.model}, {args.prompts} requests x {args.max_tokens} tokens, greedy, streamed",
                ["clients", "tokens/s", f"vs {base}", "failed", "equal", "TTFT p50 s", "TTFT p95 s"],
                [[n, f"{s['tokens_per_s']:.1f}", f"{s['ratio_to_baseline']:.2f}x", s["failed"],
                  f"{s['equal_to_sequential']}/{s['requests']}", f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p95_s']:.3f}"]
                 for n, s in summary.items()])
    for runs in arms.values():
        for run in runs:
            run["results"] = [{k: v for k, v in r.items() if k != "text"} for r in run["results"]]
    save_json("serve" if args.model == "embedded" else f"serve_{args.model}", {
        "environment": environment(), "settings": vars(args), "server_exit_code": exit_code,
        "summary": {str(n): s for n, s in summary.items()}, "arms": {str(n): runs for n, runs in arms.items()}},
        Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
