"""Rebuild the retention subsets under data/bench/ from the full MIT-licensed files (run from the project root):

    python data/bench/select_subset.py ../shared/data/bench/mmlu ../shared/data/domain/gsm8k

MMLU: every subject's 5 dev questions (the shots) and PER_SUBJECT test questions drawn with a seeded RNG per subject.
GSM8K: the first 5 train problems (the shots, lm-eval's ``first_n`` order) and TEST_ROWS test problems drawn with a
seeded RNG. Rows keep their fields and original order (CSV rows re-written by Python's csv module; JSONL lines as they are).
"""

import csv
import io
import json
import random
import shutil
import sys
from pathlib import Path

PER_SUBJECT = 4
TEST_ROWS = 60
SEED = 0
HERE = Path(__file__).resolve().parent


def _rows(path: Path):
    return list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"), newline="")))


def mmlu(source: Path) -> None:
    out = HERE / "mmlu"
    (out / "dev").mkdir(parents=True, exist_ok=True)
    (out / "test").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "mapping.json", out / "mapping.json")
    for dev in sorted((source / "dev").glob("*_dev.csv")):
        shutil.copyfile(dev, out / "dev" / dev.name)
        subject = dev.name[: -len("_dev.csv")]
        rows = _rows(source / "test" / f"{subject}_test.csv")
        keep = sorted(random.Random(f"{SEED}:{subject}").sample(range(len(rows)), PER_SUBJECT))
        buffer = io.StringIO(newline="")
        csv.writer(buffer, lineterminator="\n").writerows(rows[i] for i in keep)
        (out / "test" / f"{subject}_test.csv").write_text(buffer.getvalue(), encoding="utf-8")


def gsm8k(source: Path) -> None:
    out = HERE / "gsm8k"
    out.mkdir(parents=True, exist_ok=True)
    train = (source / "train.jsonl").read_text(encoding="utf-8").splitlines()
    test = (source / "test.jsonl").read_text(encoding="utf-8").splitlines()
    keep = sorted(random.Random(SEED).sample(range(len(test)), TEST_ROWS))
    for line in train[:5] + [test[i] for i in keep]:
        json.loads(line)  # every line is one JSON object
    (out / "train.jsonl").write_text("".join(line + "\n" for line in train[:5]), encoding="utf-8")
    (out / "test.jsonl").write_text("".join(test[i] + "\n" for i in keep), encoding="utf-8")


if __name__ == "__main__":
    mmlu(Path(sys.argv[1]))
    gsm8k(Path(sys.argv[2]))
