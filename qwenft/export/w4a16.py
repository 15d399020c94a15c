"""GPTQ and AWQ W4A16 of a merged directory by llm-compressor's ``oneshot``, saved in the compressed-tensors format
vLLM serves (``vllm serve DIR``).

The recipe, written once here (:data:`RECIPES`), follows llm-compressor's W4A16 examples: every decoder ``Linear``
(q/k/v/o and the MLP) to 4-bit integer weights in groups of :data:`GROUP_SIZE` input columns with 16-bit activations;
``lm_head`` ignored and the embeddings not Linear, so both stay 16-bit.

- ``gptq``: ``GPTQModifier(scheme="W4A16")`` (symmetric; Frantar et al. 2022, GPTQ: each column rounded in turn, the
  error spread over the columns not yet rounded through the inverse Hessian of the layer's calibration inputs;
  llm-compressor's defaults: block 128, dampening 0.01 of the mean diagonal, static activation order).
- ``awq``: ``AWQModifier`` then ``QuantizationModifier(scheme="W4A16")`` (Lin et al. 2023, AWQ, section 3.2: per input
  channel a scale ``s = s_x^a * s_w^-(1-a)`` chosen on a grid of ``a`` values by the block's output error on the
  calibration activations, folded into the previous norm / projection), with duo scaling (activations and weights).
  The grid search runs the parent block (attention, MLP, and ``down_proj`` alone for the up -> down pair) over every
  calibration token once per grid point: on a CPU it is matmul-bound, about ``n_grid + 1`` forward passes of the
  decoder over the calibration set (~30 MFLOP a token for the 0.5B) plus the pipeline's own two.
  :data:`AWQ_GRID` = 6 grid points (the identity, then ``a`` = 0, 0.25, 0.5, 0.75, 1; llm-compressor's default 20
  steps ``a`` by 1/18) and :data:`AWQ_BATCH` = 16 rows a batch make the 0.5B's AWQ fit the issue's 10 minutes on 2
  cores at 128 rows (docs/merge.md "Quantize" has the measured times and costs). Batched rows are right-padded and the
  padding carries ``loss_mask`` 0, so AWQ's activation means and its grid-search error count real tokens only
  (``use_loss_mask``); with right padding a real token never attends to a pad, so the search sees what row-by-row
  calibration sees. GPTQ stays at one row a batch: its Hessian has no mask, and padding would enter it.
  Symmetric, as GPTQ, not the ``W4A16_ASYM`` of llm-compressor's AWQ examples: transformers 5.24 cannot load
  the asymmetric checkpoint (its packed zero points, ``[out/8, groups]`` int32, do not match the ``[out, groups]``
  parameter transformers creates: "size mismatch"), so its cost could not be measured here.

Calibration rows are the run's own training examples (token ids through the chat template, exactly as trained on:
:func:`calibration_rows`). Quantizing runs in a child interpreter (:data:`SCRIPT`) that imports only torch,
transformers, datasets and llm-compressor: llm-compressor patches ``save_pretrained`` on the model it compresses and
logs through loguru, and neither should reach the process that then measures the artifacts.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

from qwenft.export.gguf_quant import QuantizeError

GROUP_SIZE = 128  # input columns per scale (W4A16's group strategy)
AWQ_GRID = 6  # grid points of AWQ's scale search (llm-compressor's default: 20; see the module docstring)
AWQ_BATCH = 16  # calibration rows a batch for AWQ (padding masked out; GPTQ: one row, see the module docstring)
RECIPES = {"gptq": {"scheme": "W4A16"},
           "awq": {"scheme": "W4A16", "n_grid": AWQ_GRID, "duo_scaling": True, "batch_size": AWQ_BATCH}}

# CPU_PINNING: llm-compressor 0.14.0.1's AWQ pins every cached activation before its grid search (for faster
# host-to-device copies), and torch refuses to pin memory without an accelerator ("Cannot access accelerator device
# when none is available"). Without one the child makes pinning a no-op: the values are the same, only the copy to a
# device it would speed up does not exist.
# First in the child: on Linux it dies with the merge (PR_SET_PDEATHSIG), so a merge killed with SIGKILL leaves no
# orphan still calibrating into a temporary directory the next run would remove from under it. argv[-1]: the
# parent's pid (a parent that died before the prctl is caught by the check after it).
DIE_WITH_PARENT = r'''
import os, signal, sys
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[-1]):
        os._exit(1)
'''

SCRIPT = DIE_WITH_PARENT + r'''
import json, sys, time
from pathlib import Path

spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.pipelines.cache import IntermediatesCache

if not torch.accelerator.is_available():  # see CPU_PINNING
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
torch.manual_seed(spec["seed"])
model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
tokenizer = AutoTokenizer.from_pretrained(spec["model"])
rows, recipe = spec["rows"], spec["recipe"]
ones = [[1] * len(r) for r in rows]
quantize = dict(targets=["Linear"], scheme=recipe["scheme"], ignore=["lm_head"])
if spec["method"] == "gptq":
    modifiers, columns, batching = [GPTQModifier(**quantize)], {"input_ids": rows, "attention_mask": ones}, {}
else:
    modifiers = [AWQModifier(n_grid=recipe["n_grid"], duo_scaling=recipe["duo_scaling"]),
                 QuantizationModifier(**quantize)]
    columns = {"input_ids": rows, "attention_mask": ones, "loss_mask": ones}
    fills = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0, "loss_mask": 0}

    def right_pad(features):  # see AWQ_BATCH: the padding is masked out of AWQ's statistics and error
        width = max(len(f["input_ids"]) for f in features)
        return {key: torch.tensor([list(f[key]) + [fill] * (width - len(f[key])) for f in features])
                for key, fill in fills.items()}

    batching = dict(batch_size=recipe["batch_size"], data_collator=right_pad, use_loss_mask=True)
start = time.perf_counter()
oneshot(model=model, tokenizer=tokenizer, dataset=Dataset.from_dict(columns), recipe=modifiers,
        num_calibration_samples=len(rows), max_seq_length=max(len(r) for r in rows),
        shuffle_calibration_samples=False, **batching)
seconds = time.perf_counter() - start
model.save_pretrained(spec["out"], save_compressed=True)
tokenizer.save_pretrained(spec["out"])
Path(sys.argv[2]).write_text(json.dumps({"calibration_seconds": seconds}), encoding="utf-8")
'''


def width_problem(config: dict, method: str) -> Optional[str]:
    """Why ``method`` cannot quantize a model of this ``config.json`` (its Linear input widths are not multiples of
    :data:`GROUP_SIZE`), or None.

    The widths: ``hidden_size`` (q/k/v, gate/up), ``num_attention_heads * head_dim`` (o_proj) and
    ``intermediate_size`` (down_proj).
    """
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    widths = {"hidden_size": hidden, "intermediate_size": config["intermediate_size"],
              "num_attention_heads x head_dim": heads * (config.get("head_dim") or hidden // heads)}
    bad = {name: value for name, value in widths.items() if value % GROUP_SIZE}
    if not bad:
        return None
    listed = ", ".join(f"{name} {value}" for name, value in bad.items())
    return (f"merge.quantize={method}: W4A16 groups {GROUP_SIZE} input columns per scale, and this model's "
            f"{listed} is not a multiple of {GROUP_SIZE}; use a gguf-* method for it")


def calibration_rows(train, count: int, seed: int) -> Tuple[List[List[int]], int]:
    """``count`` distinct training examples (their ``input_ids``, or for a preference run the prompt and the chosen
    answer, KTO's prompt and answer; ``[seq]`` each) drawn with ``seed``.

    Args:
        train: The run's training set (``DataBundle.train`` built without packing, or its preference rows: prompt and
            answer ids, :mod:`qwenft.preference.pipeline`): one example a row, in training order, repeats included.
        count: How many to draw (``merge.calibration_rows``); all of them when the run has fewer.
        seed: ``merge.calibration_seed``.

    Returns:
        ``(rows, distinct)``: the drawn rows and how many distinct examples the run has.
    """
    names = getattr(train, "column_names", None) or list(train)  # a Dataset, or a dict of columns
    if "input_ids" in names:
        sequences = train["input_ids"]
    else:
        answers = train["chosen_ids"] if "chosen_ids" in names else train["completion_ids"]
        sequences = [list(prompt) + list(answer) for prompt, answer in zip(train["prompt_ids"], answers)]
    seen, distinct = set(), []
    for ids in sequences:
        key = tuple(ids)
        if key not in seen:
            seen.add(key)
            distinct.append(list(ids))
    order = list(range(len(distinct)))
    random.Random(seed).shuffle(order)
    return [distinct[i] for i in order[:count]], len(distinct)


def quantize_w4a16(model_dir: Path, target: Path, method: str, rows: List[List[int]], dtype: str,
                   seed: int) -> float:
    """Write ``target`` (an empty directory) as ``model_dir`` quantized by ``method`` (``gptq`` or ``awq``).

    Args:
        model_dir: The merged 16-bit directory.
        target: Where the compressed-tensors directory is saved (its tokenizer and generation_config included).
        rows: Calibration token ids (:func:`calibration_rows`).
        dtype: The dtype the model is loaded in (the merge's ``merge.dtype``).
        seed: torch's seed in the child (GPTQ and AWQ are deterministic on a CPU; set for the record).

    Returns:
        Seconds llm-compressor's ``oneshot`` took (loading and saving not counted).

    Raises:
        QuantizeError: llm-compressor failed (its output was shown on stderr as it ran).
    """
    spec = {"model": str(model_dir), "out": str(target), "method": method, "recipe": RECIPES[method], "rows": rows,
            "dtype": dtype, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="qwenft-w4a16-") as work:
        spec_path, report_path = Path(work) / "spec.json", Path(work) / "report.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        result = subprocess.run([sys.executable, "-c", SCRIPT, str(spec_path), str(report_path), str(os.getpid())],
                                cwd=work)
        if result.returncode != 0 or not report_path.is_file():
            raise QuantizeError(f"llm-compressor could not quantize {model_dir.name} with {method} "
                                f"(exit {result.returncode}; its output is above)")
        return float(json.loads(report_path.read_text(encoding="utf-8"))["calibration_seconds"])
