"""Which benchmark questions an evaluation asks: lm-eval tasks over local files, checked before any model loads.

Built in, offline (the data read from the first directory of ``eval.bench_data``, then ``$QWENFT_BENCH_DATA``, that
holds ``NAME/``: :mod:`qwenft.evaluate.bench_data`):

==========  ==================================================================  =====================================
name        files                                                               lm-eval task (its YAML, unchanged but
                                                                                the data source)
==========  ==================================================================  =====================================
``mmlu``    ``mmlu/dev/SUBJECT_dev.csv`` (5 shots), ``mmlu/test/SUBJECT_test.csv``  ``mmlu_SUBJECT``, 5-shot
            (scored): no header; question, A, B, C, D, answer letter
``ceval``   ``ceval/dev/SUBJECT_dev.csv`` (shots), ``ceval/val/SUBJECT_val.csv``    ``ceval-valid_SUBJECT``, 5-shot
            (scored; the test answers are not public): header id, question,
            A, B, C, D, answer[, explanation]
``gsm8k``   ``gsm8k/train.jsonl`` (shots), ``gsm8k/test.jsonl``: {question,     ``gsm8k``, 5-shot, shots the first
            answer ending ``#### N``}                                              five train rows (``first_n``)
==========  ==================================================================  =====================================

Prompts, few-shot formatting, answer extraction and metrics are lm-eval's own task definitions, loaded from the
installed lm-eval package with only the data source replaced. Any other name is an lm-eval task (or group) found in
``eval.bench_tasks`` (a directory of task YAMLs) or in lm-eval's registry, which loads its own data (online).

``eval.bench_limit=N`` asks N questions per benchmark in blocks of at most ``eval.bench_block`` per subject, from
as few subjects as hold them, taken from the benchmark's categories in turn, all seeded (``eval.bench_subtasks=K``:
from K subjects at most): both sides get the same questions (:mod:`qwenft.evaluate.bench_sample`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from qwenft.config import Config, ConfigError, QwenftError
from qwenft.config.gates import BUILTIN_BENCHMARKS
from qwenft.evaluate.bench_sample import category_of, plan_line, resolve_limit, select, warn_subtasks

log = logging.getLogger(__name__)

LETTERS = ("A", "B", "C", "D")


@dataclass
class Benchmark:
    """One benchmark of an evaluation.

    Attributes:
        name: as in ``eval.benchmarks``.
        tasks: lm-eval ``Task`` objects by task name (data loaded).
        samples: the doc indices asked, by task name (``evaluate(samples=...)``).
        metric: the per-question metric that decides right / wrong (``acc``, ``exact_match``).
        filter: the lm-eval filter whose answers are scored (``none``, ``strict-match``).
        source: where the questions come from (a directory, or ``lm-eval registry``).
        categories: the category of each asked task (:func:`qwenft.evaluate.bench_sample.category_of`; ``""``: none).
    """

    name: str
    tasks: Dict[str, Any]
    samples: Dict[str, List[int]]
    metric: str
    filter: str
    source: str
    shots: Optional[int] = None
    categories: Dict[str, str] = field(default_factory=dict)
    subjects: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.subjects = len(self.samples)

    @property
    def questions(self) -> int:
        return sum(len(ids) for ids in self.samples.values())


# --- local files -----------------------------------------------------------------------------------------------
def _csv_rows(path: Path, header: bool) -> List[List[str]]:
    from qwenft.data.read import read_text

    rows = list(csv.reader(io.StringIO(read_text(str(path)), newline="")))
    return rows[1:] if header else rows


def _answer(value: str, path: Path, row: int) -> int:
    value = value.strip()
    if value not in LETTERS:
        raise QwenftError(f"{path}: row {row}: field 'answer': {value!r} is not one of A, B, C, D")
    return LETTERS.index(value)


MMLU_FIELDS = ("question", "A", "B", "C", "D", "answer")
SHOTS = 5  # few-shot examples of every built-in benchmark (MMLU's and C-Eval's papers; lm-eval's gsm8k.yaml)


def _nonempty(row: Dict[str, str], names, path: Path, number: int) -> None:
    for name in names:
        if not str(row.get(name, "")).strip():
            raise QwenftError(f"{path}: row {number}: field '{name}': empty")


def read_mmlu(path: Path) -> List[dict]:
    """MMLU's published CSV (no header: question, A, B, C, D, answer letter) as cais/mmlu rows:
    ``{question, choices [4], answer (0-3)}``.

    Raises:
        QwenftError: a row without exactly 6 fields, an empty question or choice, or an answer that is not A-D,
            naming the file, row and field.
    """
    out = []
    for number, fields in enumerate(_csv_rows(path, header=False), start=1):
        if len(fields) != 6:
            what = (f"field '{MMLU_FIELDS[len(fields)]}': missing" if len(fields) < 6 else
                    f"{len(fields)} fields, one too many at least (a comma inside a field needs the field quoted)")
            raise QwenftError(f"{path}: row {number}: {what} (MMLU rows are question, A, B, C, D, answer letter; "
                              f"this row has {len(fields)} fields)")
        _nonempty(dict(zip(MMLU_FIELDS, fields)), MMLU_FIELDS[:5], path, number)
        out.append({"question": fields[0], "choices": fields[1:5], "answer": _answer(fields[5], path, number)})
    return out


def read_ceval(path: Path) -> List[dict]:
    """C-Eval's CSV (header id, question, A, B, C, D, answer[, explanation]) as ceval/ceval-exam rows.

    Raises:
        QwenftError: a missing column (naming it) or an answer that is not A-D.
    """
    rows = _csv_rows(path, header=False)
    if not rows:
        raise QwenftError(f"{path}: empty file (expected a header id,question,A,B,C,D,answer)")
    header = [h.strip() for h in rows[0]]
    for column in ("question", "A", "B", "C", "D", "answer"):
        if column not in header:
            raise QwenftError(f"{path}: row 1: field '{column}': missing from the header ({', '.join(header)})")
    out = []
    for number, fields in enumerate(rows[1:], start=2):
        row = dict(zip(header, fields))
        _nonempty(row, ("question", "A", "B", "C", "D"), path, number)
        _answer(row.get("answer", ""), path, number)
        out.append({"id": row.get("id", str(number - 2)), "question": row["question"], "A": row["A"], "B": row["B"],
                    "C": row["C"], "D": row["D"], "answer": row["answer"].strip(),
                    "explanation": row.get("explanation", "")})
    return out


def read_gsm8k(path: Path) -> List[dict]:
    """GSM8K's JSONL (``{question, answer}``, the answer's last line ``#### N``).

    Raises:
        QwenftError: a line that is not a JSON object, or without a question or an answer, naming file, line, field.
    """
    from qwenft.data.read import read_text

    out = []
    for number, line in enumerate(read_text(str(path)).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise QwenftError(f"{path}: line {number}: not valid JSON ({error})") from None
        for name in ("question", "answer"):
            if not isinstance(row, dict) or not isinstance(row.get(name), str) or not row[name].strip():
                raise QwenftError(f"{path}: line {number}: field '{name}': missing or empty")
        out.append({"question": row["question"], "answer": row["answer"]})
    return out


def _dataset(splits: Dict[str, List[dict]]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def _loader(splits: Dict[str, List[dict]]) -> Callable[..., Any]:
    """A ``custom_dataset`` for lm-eval: it is called with the task's metadata as keywords."""
    return lambda **_: _dataset(splits)


# --- the built-in benchmarks -------------------------------------------------------------------------------------
def _lm_eval_yaml(relative: str) -> Dict[str, Any]:
    """An installed lm-eval task YAML (its ``include`` resolved) as a dict."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(Path(lm_eval.tasks.__file__).parent / relative)


def _subjects(folder: Path, split: str) -> List[str]:
    suffix = f"_{split}.csv"
    return sorted(p.name[: -len(suffix)] for p in (folder / split).glob(f"*{suffix}"))


def _multiple_choice(name: str, folder: Path, scored: str, reader, yaml_of) -> Dict[str, Any]:
    subjects = _subjects(folder, scored)
    if not subjects:
        raise ConfigError(f"eval.benchmarks: {name}: no {folder / scored}/*_{scored}.csv files")
    tasks = {}
    for subject in subjects:
        dev = folder / "dev" / f"{subject}_dev.csv"
        if not dev.is_file():
            raise ConfigError(f"eval.benchmarks: {name}: {dev} is missing (the subject's 5 shots)")
        split = {"mmlu": "test", "ceval": "val"}[name]
        rows = {split: reader(folder / scored / f"{subject}_{scored}.csv"), "dev": reader(dev)}
        if not rows[split]:
            raise ConfigError(f"eval.benchmarks: {name}: {folder / scored / f'{subject}_{scored}.csv'}: no "
                              "questions (an empty file); remove it or give it rows")
        if len(rows["dev"]) < SHOTS:
            raise ConfigError(f"eval.benchmarks: {name}: {dev}: {len(rows['dev'])} rows; the {SHOTS}-shot prompt "
                              f"takes the subject's first {SHOTS}")
        try:
            config = yaml_of(subject)
        except FileNotFoundError:  # a file named after a subject lm-eval's task does not define
            raise ConfigError(f"eval.benchmarks: {name}: {folder / scored / f'{subject}_{scored}.csv'}: "
                              f"{subject!r} is not a subject of lm-eval's {name} task") from None
        config.update(custom_dataset=_loader(rows), num_fewshot=SHOTS)
        tasks[config["task"]] = config
    return tasks


def _builtin(name: str, folder: Path) -> Dict[str, Dict[str, Any]]:
    """Task configs by task name for a built-in benchmark whose files are in ``folder``."""
    if name == "mmlu":
        return _multiple_choice(name, folder, "test", read_mmlu,
                                lambda s: _lm_eval_yaml(f"mmlu/default/mmlu_{s}.yaml"))
    if name == "ceval":
        return _multiple_choice(name, folder, "val", read_ceval,
                                lambda s: _lm_eval_yaml(f"ceval/ceval-valid_{s}.yaml"))
    for split in ("train", "test"):
        if not (folder / f"{split}.jsonl").is_file():
            raise ConfigError(f"eval.benchmarks: gsm8k: {folder / f'{split}.jsonl'} is missing")
    config = _lm_eval_yaml("gsm8k/gsm8k.yaml")
    splits = {split: read_gsm8k(folder / f"{split}.jsonl") for split in ("train", "test")}
    if len(splits["train"]) < SHOTS or not splits["test"]:
        short = "train" if len(splits["train"]) < SHOTS else "test"
        raise ConfigError(f"eval.benchmarks: gsm8k: {folder / f'{short}.jsonl'}: {len(splits[short])} rows; "
                          + (f"the {SHOTS}-shot prompt takes its first {SHOTS}" if short == "train" else
                             "no questions"))
    config.update(custom_dataset=_loader(splits),
                  fewshot_config={"sampler": "first_n"})
    return {config["task"]: config}


BUILTIN = BUILTIN_BENCHMARKS  # name -> (metric, filter): one home, qwenft.config.gates


# --- user tasks and lm-eval's registry ----------------------------------------------------------------------------
def _registry(config: Config, name: str) -> Dict[str, Any]:
    """lm-eval ``Task`` objects for ``name`` from ``eval.bench_tasks`` or lm-eval's registry."""
    from lm_eval.tasks import TaskManager

    where = "lm-eval's registry"
    if config.eval.bench_tasks:
        from qwenft.data import resolve_path

        folder = resolve_path(config.eval.bench_tasks)
        if not folder.is_dir():
            raise ConfigError(f"eval.bench_tasks={config.eval.bench_tasks!r}: no such directory ({folder})")
        manager, where = TaskManager(include_path=str(folder)), f"eval.bench_tasks ({folder})"
        mention = [p for p in sorted(folder.rglob("*.yaml"))
                   if f"task: {name}" in p.read_text(encoding="utf-8", errors="replace")]
        if mention:
            where = str(mention[0])  # a load error below names the file that defines the task
        if name not in manager.all_tasks and mention:
            raise ConfigError(f"eval.benchmarks: {name}: {mention[0]}: lm-eval rejected the task "
                              "YAML (check it with `lm-eval validate --tasks ... --include_path ...`)")
    else:
        manager = TaskManager()
    if name not in manager.all_tasks:
        raise ConfigError(f"eval.benchmarks: unknown benchmark {name!r}: not one of {', '.join(BUILTIN)} and no "
                          f"lm-eval task or group of that name in {where}")
    try:
        return manager.load([name])["tasks"]
    except Exception as error:  # lm-eval raises many types; the user needs the task and the reason, one line
        reason = " ".join(str(error).split())[:300]
        raise ConfigError(f"eval.benchmarks: {name} ({where}): lm-eval could not load it: "
                          f"{type(error).__name__}: {reason}") from None


def _metric_of(task) -> tuple:
    """The first metric and filter of an lm-eval task (what decides right / wrong for a user's task)."""
    metrics = task.config.metric_list or [{"metric": "acc"}]
    filters = task.config.filter_list or [{"name": "none"}]
    return metrics[0]["metric"], filters[0].get("name", "none")


def _docs(task) -> int:
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    return len(docs)


class _CustomDatasetNotice(logging.Filter):
    """Drops lm-eval's per-task notice that a ``custom_dataset`` takes ``--metadata`` keywords (every built-in task
    here has one; the notice is advice for lm-eval's command line, printed once per MMLU subject)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def prepare(config: Config) -> List[Benchmark]:
    """Resolve ``eval.benchmarks`` into lm-eval tasks with their questions chosen, before any model loads.

    Raises:
        ConfigError: an unknown benchmark name, a missing data directory (unless ``eval.bench_missing=skip``: then the
            benchmark is left out with a warning) or file, a task lm-eval rejects.
        QwenftError: a data file row without its answer (file, row, field).
    """
    if not config.eval.benchmarks:
        return []
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    task_log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _CustomDatasetNotice) for f in task_log.filters):
        task_log.addFilter(_CustomDatasetNotice())
    from lm_eval.api.task import ConfigurableTask

    from qwenft.evaluate.bench_data import data_folder, warn_skipped

    out = []
    skip = warn_skipped(config)
    for name in config.eval.benchmarks:
        if name in skip:
            continue
        if name in BUILTIN:
            folder = data_folder(name, config.eval.bench_data)
            tasks = {}
            for task_name, task_config in _builtin(name, folder).items():
                try:
                    tasks[task_name] = ConfigurableTask(config=task_config)
                except Exception as error:  # lm-eval's own checks of a task config
                    raise ConfigError(f"eval.benchmarks: {name}: lm-eval rejected task {task_name}: "
                                      f"{type(error).__name__}: {error}") from None
            metric, filter_name = BUILTIN[name]
            source, shots = str(folder), SHOTS
        else:
            tasks = _registry(config, name)
            metric, filter_name = _metric_of(next(iter(tasks.values())))
            source, shots = config.eval.bench_tasks or "lm-eval registry", None
        counts = {t: _docs(task) for t, task in tasks.items()}
        categories = {t: category_of(name, t, task) for t, task in tasks.items()}
        ev = config.eval
        samples = select(counts, resolve_limit(config), ev.bench_seed, ev.bench_subtasks, ev.bench_block, categories)
        warn_subtasks(config, name, len(counts))
        tasks = {t: task for t, task in tasks.items() if t in samples}
        bench = Benchmark(name, tasks, samples, metric, filter_name, source, shots,
                          {t: categories[t] for t in samples})
        log.info("%s (%s)", plan_line(name, samples, categories, config), source)
        out.append(bench)
    return out
