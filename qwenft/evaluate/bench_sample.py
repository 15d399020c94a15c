"""Which questions of a benchmark are asked: blocks per subject, subjects stratified by category, all seeded.

The scorer (:mod:`qwenft.evaluate.bench_score`) computes a subject's few-shot prefix once for all of its questions,
so a question costs the suffix after the shots plus its share of that prefix. Questions spread one or two per subject
pay almost the whole prefix each (2.6-3.5 s a question for MMLU on 2 CPU cores, embedded 0.5B) where blocks of 16
pay ~0.3 s. ``eval.bench_limit=N`` therefore draws its N questions as blocks of at most ``eval.bench_block``
questions from as few subjects as hold them:

1. Subjects are ordered by category in turn (MMLU: STEM, humanities, social sciences, other, from the ``tag`` of
   lm-eval's ``mmlu_SUBJECT`` YAMLs; C-Eval: the four categories of its ``subject_mapping.json``): the categories
   in a seeded order, each category's subjects in a seeded order, then one subject of each category in turn. The
   first K subjects so cover min(K, categories) categories, as evenly as K allows.
2. ``eval.bench_subtasks=K`` keeps the first K subjects of that order (a cap on subjects).
3. The fewest subjects, in that order, whose blocks (``min(bench_block, the subject's questions)``) hold N are
   used, and N is spread over them as evenly as their sizes allow (no block above ``bench_block``). When even all
   kept subjects cannot hold N in blocks of ``bench_block`` (``bench_subtasks`` smaller than N / bench_block, or
   small subjects), every kept subject is used and the blocks grow past ``bench_block``, still as even as possible.
4. A subject's questions are the first of its own seeded shuffle, so they are not the first rows of its file.

``eval.bench_limit=null`` asks every question of the kept subjects (every subject without ``bench_subtasks``). The
same counts, seed and settings give the same questions, for both sides and across runs.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any, Dict, List, Optional

log = logging.getLogger(__name__)

# C-Eval's 52 subjects by category, as in its repository's subject_mapping.json (hkust-nlp/ceval; its
# clinical_medicine entry omits the category: the C-Eval paper, Table 6, lists it under Other).
CEVAL_CATEGORIES = {
    "stem": ("computer_network", "operating_system", "computer_architecture", "college_programming",
             "college_physics", "college_chemistry", "advanced_mathematics", "probability_and_statistics",
             "discrete_mathematics", "electrical_engineer", "metrology_engineer", "high_school_mathematics",
             "high_school_physics", "high_school_chemistry", "high_school_biology", "middle_school_mathematics",
             "middle_school_biology", "middle_school_physics", "middle_school_chemistry", "veterinary_medicine"),
    "social_science": ("college_economics", "business_administration", "marxism", "mao_zedong_thought",
                       "education_science", "teacher_qualification", "high_school_politics",
                       "high_school_geography", "middle_school_politics", "middle_school_geography"),
    "humanities": ("modern_chinese_history", "ideological_and_moral_cultivation", "logic", "law",
                   "chinese_language_and_literature", "art_studies", "professional_tour_guide",
                   "legal_professional", "high_school_chinese", "high_school_history", "middle_school_history"),
    "other": ("civil_servant", "sports_science", "plant_protection", "basic_medicine", "clinical_medicine",
              "urban_and_rural_planner", "accountant", "fire_engineer", "environmental_impact_assessment_engineer",
              "tax_accountant", "physician"),
}
_CEVAL = {subject: category for category, subjects in CEVAL_CATEGORIES.items() for subject in subjects}


def category_of(benchmark: str, task_name: str, task: Any) -> str:
    """The category a task (subject) belongs to, for stratifying: a C-Eval task's (``ceval-valid_SUBJECT``) from
    :data:`CEVAL_CATEGORIES`, any other task's from its lm-eval ``tag`` (MMLU's ``mmlu_stem_tasks`` -> ``stem``: the
    benchmark's name and ``_tasks`` dropped); ``""`` when it has none (all such tasks then form one category).

    Args:
        benchmark: the name in ``eval.benchmarks`` (``mmlu``, ``ceval``, a user's task or group).
        task_name: the lm-eval task name (``mmlu_anatomy``, ``ceval-valid_law``).
        task: the lm-eval ``Task`` (its ``config.tag`` is read), or None.
    """
    if task_name.startswith("ceval-valid_"):  # lm-eval's C-Eval tasks carry no category of their own
        return _CEVAL.get(task_name[len("ceval-valid_"):], "")
    tag = getattr(getattr(task, "config", None), "tag", None)
    if isinstance(tag, (list, tuple)):
        tag = tag[0] if tag else None
    if not isinstance(tag, str) or not tag:
        return ""
    tag = tag[: -len("_tasks")] if tag.endswith("_tasks") else tag
    return tag[len(benchmark) + 1:] if tag.startswith(f"{benchmark}_") else tag


def stratified_order(names: List[str], categories: Dict[str, str], seed: int) -> List[str]:
    """``names`` with one subject of each category in turn (step 1 of the module docstring).

    Args:
        names: task (subject) names; their order does not matter.
        categories: category by name; a name missing from it is in category ``""``.
        seed: seeds the order of the categories and of each category's subjects.

    Returns:
        Every name once.
    """
    groups: Dict[str, List[str]] = {}
    for name in sorted(names):
        groups.setdefault(categories.get(name, ""), []).append(name)
    rng = random.Random(seed)
    order = sorted(groups)
    rng.shuffle(order)
    for category in sorted(groups):  # a fixed order of shuffles: the same seed, the same order
        rng.shuffle(groups[category])
    out: List[str] = []
    for depth in range(max(map(len, groups.values()), default=0)):
        out.extend(groups[category][depth] for category in order if depth < len(groups[category]))
    return out


def _spread(want: int, counts: List[int]) -> List[int]:
    """``want`` questions over subjects holding ``counts``, as evenly as the counts allow (water filling; the
    remainder to the earlier subjects). ``want`` must not exceed ``sum(counts)``."""
    sizes = [0] * len(counts)
    while want:
        open_ = [i for i, count in enumerate(counts) if sizes[i] < count]
        share = max(1, want // len(open_))
        for i in open_:
            add = min(share, counts[i] - sizes[i], want)
            sizes[i] += add
            want -= add
            if not want:
                break
    return sizes


def select(doc_counts: Dict[str, int], limit: Optional[int], seed: int, subtasks: Optional[int] = None,
           block: Optional[int] = None, categories: Optional[Dict[str, str]] = None) -> Dict[str, List[int]]:
    """The doc indices asked of each task (subject), by the rules of the module docstring.

    Args:
        doc_counts: questions per task name.
        limit: questions in all (``eval.bench_limit``); None: every question of the kept subjects.
        seed: ``eval.bench_seed``: the subjects' order and each subject's question order.
        subtasks: keep the first this many subjects of the stratified order (``eval.bench_subtasks``); None: all.
        block: questions per subject at most while the kept subjects can hold ``limit`` so (``eval.bench_block``);
            None: no cap (whole subjects, one after another).
        categories: category by task name (:func:`category_of`); None or missing names: one category.

    Returns:
        Sorted doc indices by task name, only tasks with at least one; ``sum`` of the lengths is
        ``min(limit, questions of the kept subjects)``. The same arguments give the same selection, whatever the
        order of ``doc_counts``.

    Raises:
        ValueError: ``limit``, ``subtasks`` or ``block`` below 1, or a negative count.
    """
    for key, value in (("limit", limit), ("subtasks", subtasks), ("block", block)):
        if value is not None and value < 1:
            raise ValueError(f"select: {key}={value!r}; must be None or >= 1")
    if any(count < 0 for count in doc_counts.values()):
        raise ValueError(f"select: negative question counts in {doc_counts}")
    names = stratified_order(list(doc_counts), categories or {}, seed)
    names = names[:subtasks] if subtasks else names
    if limit is None or limit >= sum(doc_counts[name] for name in names):
        return {name: list(range(doc_counts[name])) for name in names if doc_counts[name]}
    cap = block or max(doc_counts.values())
    used, held = 0, 0
    while used < len(names) and held < limit:  # the fewest subjects whose blocks hold `limit`
        held += min(cap, doc_counts[names[used]])
        used += 1
    names = names[:used]  # held < limit here only when every kept subject is used: the blocks grow past `cap`
    picked = {}
    for name, size in zip(names, _spread(limit, [doc_counts[name] for name in names])):
        ids = list(range(doc_counts[name]))
        random.Random(f"{seed}:{name}").shuffle(ids)
        if size:
            picked[name] = sorted(ids[:size])
    return picked


def resolve_limit(config) -> Optional[int]:
    """``eval.bench_limit`` as a number of questions: ``auto`` is
    :data:`qwenft.config.evaluate.BENCH_LIMIT_AUTO` for this machine's device kind (cuda or cpu)."""
    from qwenft.config.evaluate import BENCH_LIMIT_AUTO

    limit = config.eval.bench_limit
    if limit != "auto":
        return limit
    from qwenft.runtime import default_device

    return BENCH_LIMIT_AUTO["cuda" if default_device().startswith("cuda") else "cpu"]


def plan_line(name: str, samples: Dict[str, List[int]], categories: Dict[str, str], config) -> str:
    """The one line logged before a benchmark runs: N questions from K subjects in blocks of B, the subjects per
    category, and the settings that chose them. ``config`` is the run's :class:`qwenft.config.Config`."""
    sizes = sorted(len(ids) for ids in samples.values())
    blocks = "-" if not sizes else str(sizes[0]) if sizes[0] == sizes[-1] else f"{sizes[0]}-{sizes[-1]}"
    spread = Counter(categories.get(task, "") for task in samples)
    by_category = ", ".join(f"{c or 'uncategorised'} {n}" for c, n in sorted(spread.items()))
    ev = config.eval
    return (f"benchmark {name}: {sum(sizes)} questions from {len(sizes)} subject{'s' if len(sizes) != 1 else ''} "
            f"in blocks of {blocks} "
            f"({by_category}; eval.bench_limit={ev.bench_limit}"
            f"{f' = {resolve_limit(config)} here' if ev.bench_limit == 'auto' else ''}, eval.bench_block={ev.bench_block}, "
            f"eval.bench_subtasks={ev.bench_subtasks}, eval.bench_seed={ev.bench_seed})")


def warn_subtasks(config, name: str, available: int) -> None:
    """A warning when ``eval.bench_subtasks`` asks for more subjects than ``name`` has (all are used)."""
    wanted = config.eval.bench_subtasks
    if wanted and wanted > available:
        log.warning("eval.bench_subtasks=%d but %s has %d subtasks: all %d are used", wanted, name, available,
                    available)
