"""The cost measurement of a GGUF, run by llama.cpp itself (llama-cpp-python, in a child interpreter that imports only
``llama_cpp`` and numpy, as :mod:`qwenft.export.llama_check` does).

It scores what the transformers side scores (:mod:`qwenft.export.costs`), on the same token ids:

- perplexity rows (:func:`qwenft.evaluate.perplexity.window_rows` / ``label_rows``): each row evaluated once with
  every position's logits kept; the NLL of each scored token ``t`` is ``logsumexp(z[t-1]) - z[t-1][ids[t]]`` in
  float64 (the same formula as :func:`qwenft.kernels.target_logprobs`), summed per row group;
- greedy answers to the held-out prompts (argmax each step, stopping on the generation_config's EOS ids or after
  ``max_new_tokens``), decoded and scored by the parent with the evaluation's metrics;
- forced sequences (a prompt + the 16-bit merge's greedy answer): llama.cpp's argmax at every answer position, for
  the agreement with the 16-bit merge, and how far it prefers its token to the 16-bit merge's (``gaps``);
- the chat template and end-token facts :mod:`qwenft.export.llama_check` judges (its ``CHAT_SCRIPT``);
- decode speed: one prompt, then :data:`SPEED_TOKENS` greedy tokens one decode call each (EOS not honoured), timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from qwenft.export.gguf_quant import QuantizeError
from qwenft.export.llama_check import CHAT_SCRIPT, PLAIN_BUFFERS, TWO_TURNS

THREADS = 2  # llama.cpp's threads, fixed: the machine's other work then changes the speed, not the results
SPEED_TOKENS = 64

SCRIPT = r'''
import json, sys, time
from pathlib import Path
import numpy as np
import llama_cpp
''' + PLAIN_BUFFERS + r'''

spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
def tick():  # one step done: a line the parent's progress bar counts
    print("qwenft-step", flush=True)
longest = max([len(r[0]) for g in spec["ppl"].values() for r in g] + [len(p) + len(a) for p, a in spec["forced"]]
              + [len(p) + spec["max_new_tokens"] for p in spec["prompts"]]
              + [len(spec["speed_prompt"]) + spec["speed_tokens"]])
llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=longest + 8, n_batch=512, n_threads=spec["threads"],
                      n_threads_batch=spec["threads"], n_gpu_layers=0, seed=0, logits_all=True, verbose=False)
report = {"ppl": {}, "generated": [], "forced_argmax": [], "gaps": [], "extra_bufts": report_extra_bufts}

for name, rows in spec["ppl"].items():
    nll, count = 0.0, 0
    for ids, scored in rows:
        llm.reset()
        llm.eval(ids)
        for t in scored:
            z = llm.scores[t - 1].astype(np.float64)
            top = z.max()
            nll += float(top + np.log(np.exp(z - top).sum()) - z[ids[t]])
            count += 1
        tick()
    report["ppl"][name] = [nll, count]

eos = set(spec["eos"])
for prompt in spec["prompts"]:
    llm.reset()
    llm.eval(prompt)
    out = []
    while len(out) < spec["max_new_tokens"]:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        if token in eos:
            break
        llm.eval([token])
    report["generated"].append(out)
    tick()

for (prompt, answer), expected in zip(spec["forced"], spec["expected"]):
    llm.reset()
    llm.eval(prompt + answer[:-1])
    rows = [llm.scores[len(prompt) - 1 + k] for k in range(len(answer))]
    report["forced_argmax"].append([int(np.argmax(z)) for z in rows])
    report["gaps"].append([float(z.max() - z[e]) for z, e in zip(rows, expected)])  # its token over the 16-bit's
    tick()

llm.reset()
llm.eval(spec["speed_prompt"])
start = time.perf_counter()
for _ in range(spec["speed_tokens"]):
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
report["decode_tokens_per_s"] = spec["speed_tokens"] / (time.perf_counter() - start)
''' + CHAT_SCRIPT + r'''
Path(sys.argv[2]).write_text(json.dumps(report), encoding="utf-8")
llm.close()
'''


def measure_gguf(path: Path, ppl: Dict[str, Sequence[Tuple[List[int], List[bool]]]], prompts: List[List[int]],
                 eos: List[int], max_new_tokens: int, forced: List[Tuple[List[int], List[int]]],
                 expected: List[List[int]], desc: Optional[str] = None) -> dict:
    """Run :data:`SCRIPT` on the GGUF ``path`` (with ``desc``: a progress bar of that name over its rows, prompts and
    forced pairs, on stderr).

    Args:
        ppl: Row groups by name, each row ``(ids [seq], scored [seq])``.
        prompts: Generation prompts (token ids); the first one is also the speed prompt.
        eos: The ids that end an answer.
        max_new_tokens: Answer length at most.
        forced: ``(prompt ids, answer ids)`` pairs; ``answer`` non-empty.
        expected: Per forced pair, the 16-bit merge's argmax at each answer position (for ``gaps``).

    Returns:
        ``{"ppl": {name: [nll, tokens]}, "generated": [[ids]], "forced_argmax": [[ids]], "gaps": [[logits]],
        "decode_tokens_per_s"}`` and the chat-template / end-token fields of
        :data:`qwenft.export.llama_check.CHAT_SCRIPT` (``has_template``, ``chat_text``, ``chat_ids``, ``eos``, ``eot``,
        ``eog``).

    Raises:
        QuantizeError: llama.cpp could not load or run the file.
    """
    spec = {"gguf": str(path), "threads": THREADS, "eos": list(eos), "max_new_tokens": max_new_tokens,
            "ppl": {name: [[list(ids), [t for t, on in enumerate(scored) if on]] for ids, scored in rows]
                    for name, rows in ppl.items()},
            "prompts": [list(p) for p in prompts], "forced": [[list(p), list(a)] for p, a in forced],
            "speed_prompt": list(prompts[0]) if prompts else [0], "speed_tokens": SPEED_TOKENS,
            "expected": [list(e) for e in expected], "messages": TWO_TURNS, "eos_token_id": list(eos)}
    with tempfile.TemporaryDirectory(prefix="qwenft-llama-eval-") as work:
        spec_path, report_path = Path(work) / "spec.json", Path(work) / "report.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        steps = sum(len(rows) for rows in ppl.values()) + len(prompts) + len(forced)
        code, output = _run(SCRIPT, [str(spec_path), str(report_path)], work, env, steps, desc)
        if code != 0:
            said = " | ".join(output.strip().splitlines()[-5:]) or f"exit status {code}, nothing printed"
            raise QuantizeError(f"llama.cpp could not run {path.name}: {said}")
        return json.loads(report_path.read_text(encoding="utf-8"))


def _run(script: str, args: List[str], cwd: str, env: dict, steps: int, desc: Optional[str]) -> Tuple[int, str]:
    """Run ``script`` in a child interpreter, its step lines counted on a tqdm bar named ``desc`` (None: no bar).

    Returns:
        ``(exit status, stderr)``, or its other stdout lines when stderr is empty.
    """
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, desc=desc, unit="step", leave=False, file=sys.stderr) if desc else None
    other = []
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8") as err:
        with subprocess.Popen([sys.executable, "-c", script, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=err, text=True) as child:
            for line in child.stdout:
                if line.rstrip("\n") != "qwenft-step":
                    other.append(line)
                elif bar is not None:
                    bar.update()
        if bar is not None:
            bar.close()
        err.seek(0)
        return child.returncode, err.read() or "".join(other)
