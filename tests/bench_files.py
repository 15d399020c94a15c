"""Benchmark files in the published layouts, with invented questions, for tests (qwenft ships no benchmark data).

``write_bench(root)`` writes ``root/mmlu/{dev,test}/SUBJECT_{dev,test}.csv`` (MMLU's CSVs: no header; question, A, B,
C, D, answer letter) for :data:`SUBJECTS` (real MMLU subject names, so lm-eval's ``mmlu_SUBJECT`` tasks load them) and
``root/gsm8k/{train,test}.jsonl`` (GSM8K's ``{question, answer ending "#### N"}``, from data/examples/math_qa.jsonl:
the first 5 rows are the shots). Every question is arithmetic made up here: content never matters to these tests,
only the shapes and the counts.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBJECTS = ("abstract_algebra", "anatomy", "astronomy", "college_physics", "world_religions")
TEST_ROWS = (6, 4, 5, 3, 6)  # questions per subject (different, so per-subject counts are checked)


def _question(rng: random.Random, tag: str) -> list:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    right = a + b
    wrong = sorted({right + d for d in (-3, -1, 2, 5)} - {right})[:3]
    letter = "ABCD"[rng.randrange(4)]
    choices = wrong[:]
    choices.insert("ABCD".index(letter), right)
    return [f"{tag}: what is {a} + {b}?", *map(str, choices), letter]


def write_bench(root: Path) -> Path:
    """Write the tree under ``root`` (created); returns ``root``."""
    rng = random.Random(0)
    for subject, count in zip(SUBJECTS, TEST_ROWS):
        for split, rows in (("dev", 5), ("test", count)):
            folder = root / "mmlu" / split
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"{subject}_{split}.csv", "w", newline="", encoding="utf-8") as handle:
                csv.writer(handle).writerows(_question(rng, f"{subject} {split} {i}") for i in range(rows))
    math = [json.loads(line) for line in (ROOT / "data/examples/math_qa.jsonl").read_text().splitlines() if line]
    (root / "gsm8k").mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", math[:5]), ("test", math[5:11])):
        (root / "gsm8k" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root
