"""Benchmarks inside `eval` and the evaluation after `train` (issue 26).

On tiny-random: lm-eval tasks over local files and the prompts they render (plain text unless
eval.bench_chat_template=true), the seeded question selection (blocks per subject, categories in turn; issue 44),
the cost per question in the report, the prefix-cached log-likelihoods against a full
forward, one model load for both sides with the benchmark in metrics.json / report.md, the paired (Newcombe) CI,
and bad input refused with exit 2 before any model loads. Slow: 20 MMLU questions on the embedded 0.5B model
through qwenft and through lm-eval's own HFLM give the same prediction for every question.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from qwenft.evaluate import bench_tasks
from qwenft.evaluate.intervals import paired_bootstrap
from qwenft.evaluate.bench_sample import category_of, select, stratified_order
from qwenft.evaluate.bench_score import MAX_ROWS_FACTOR, MIN_PREFIX, full_forward_scores, score_pairs, suffix_rows
from tests.conftest import compose_config, qwenft_in_process

LETTERS = ["A", "B", "C", "D"]


# --------------------------------------------------------------------------------------------------- helpers
def csv_rows(path: Path) -> list:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


def mmlu_block(row: list) -> str:
    """lm-eval's MMLU doc_to_text: the question, four lettered choices, ``Answer:``."""
    return f"{row[0].strip()}\nA. {row[1]}\nB. {row[2]}\nC. {row[3]}\nD. {row[4]}\nAnswer:"


def mmlu_description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


@pytest.fixture(autouse=True)
def bench_env(bench_dir, monkeypatch):
    """Every test here finds the invented benchmark files through $QWENFT_BENCH_DATA (eval.bench_data is empty by
    default: qwenft ships no benchmark data)."""
    monkeypatch.setenv("QWENFT_BENCH_DATA", str(bench_dir))
    return bench_dir


@pytest.fixture(scope="module")
def tiny():
    """The tiny-random model in fp32 (eval mode) and its tokenizer (ChatML template)."""
    from qwenft.model import load_model

    config = compose_config("model=tiny-random", "quant=none", command="eval")
    model, tokenizer = load_model(config, device="cpu")
    return model.float().eval(), tokenizer


def record_loglikelihood(monkeypatch) -> list:
    """Record ``(task, doc_id, context, continuation)`` of every request lm-eval hands QwenftLM.loglikelihood."""
    from qwenft.evaluate.bench_lm import QwenftLM

    seen = []
    original = QwenftLM.loglikelihood

    def recording(self, requests, disable_tqdm=False):
        seen.extend((r.task_name, r.doc_id, *r.args) for r in requests)
        return original(self, requests, disable_tqdm)

    monkeypatch.setattr(QwenftLM, "loglikelihood", recording)
    return seen


# ------------------------------------------------------------------------------ 1. local tasks and their prompts
def test_prepare_loads_mmlu_and_gsm8k_files_as_lm_eval_tasks(bench_dir):
    from lm_eval.api.task import ConfigurableTask
    from tests.bench_files import SUBJECTS

    BENCH = bench_dir

    config = compose_config("model=tiny-random", "eval.benchmarks=[mmlu, gsm8k]", command="eval")
    mmlu, gsm8k = bench_tasks.prepare(config)
    subjects = sorted(p.name[:-len("_test.csv")] for p in (BENCH / "mmlu" / "test").glob("*_test.csv"))
    assert mmlu.name == "mmlu" and sorted(mmlu.tasks) == [f"mmlu_{s}" for s in subjects] and subjects == list(SUBJECTS)
    assert mmlu.source == str(BENCH / "mmlu") and (mmlu.metric, mmlu.filter, mmlu.shots) == ("acc", "none", 5)
    assert all(isinstance(t, ConfigurableTask) and t.OUTPUT_TYPE == "multiple_choice" for t in mmlu.tasks.values())
    # no limit: every row of every test CSV is asked
    assert {t: len(ids) for t, ids in mmlu.samples.items()} == {
        f"mmlu_{s}": len(csv_rows(BENCH / "mmlu" / "test" / f"{s}_test.csv")) for s in subjects}
    assert gsm8k.name == "gsm8k" and list(gsm8k.tasks) == ["gsm8k"]
    assert (gsm8k.metric, gsm8k.filter) == ("exact_match", "strict-match")
    test = [json.loads(line) for line in (BENCH / "gsm8k" / "test.jsonl").read_text().splitlines() if line.strip()]
    train = [json.loads(line) for line in (BENCH / "gsm8k" / "train.jsonl").read_text().splitlines() if line.strip()]
    assert gsm8k.questions == len(test) and gsm8k.tasks["gsm8k"].OUTPUT_TYPE == "generate_until"
    # GSM8K's prompt: the first five train rows as worked shots (first_n), then the question
    task = gsm8k.tasks["gsm8k"]
    task.build_all_requests(samples=[0])
    context, generation = task.instances[0].args
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train[:5])
    assert context == shots + f"Question: {test[0]['question']}\nAnswer:"
    assert "Question:" in generation["until"]


@pytest.mark.parametrize("chat", [False, True])
def test_mmlu_prompt_is_lm_evals_plain_text_unless_bench_chat_template(tiny, chat, monkeypatch, bench_dir):
    """docs/eval.md: "benchmark prompts are plain text as lm-eval renders them (no chat template) unless
    eval.bench_chat_template=true". The contexts are the ones lm-eval hands QwenftLM on the run's code path
    (BenchRunner.run_side), checked character for character against the subject's CSVs."""
    from qwenft.evaluate.bench_run import BenchRunner
    from qwenft.generation import Sampler

    model, tokenizer = tiny
    BENCH = bench_dir
    assert "<|im_start|>" in tokenizer.chat_template  # ChatML, as Qwen2.5
    config = compose_config("model=tiny-random", "quant=none", "eval.benchmarks=[mmlu]", "eval.bench_limit=2",
                            f"eval.bench_chat_template={str(chat).lower()}", command="eval")
    benchmarks = bench_tasks.prepare(config)
    seen = record_loglikelihood(monkeypatch)
    runner = BenchRunner(benchmarks, tokenizer, Sampler(model, tokenizer), batch_size=8,
                         chat_template=config.eval.bench_chat_template)
    runner.run_side("base", model)
    samples = benchmarks[0].samples
    assert sum(map(len, samples.values())) == 2 and len(seen) == 8
    for task, position, context, continuation in seen:
        doc_id = samples[task][position]  # lm-eval numbers the asked docs of a task 0, 1, ...
        subject = task[len("mmlu_"):]
        shots = csv_rows(BENCH / "mmlu" / "dev" / f"{subject}_dev.csv")
        question = csv_rows(BENCH / "mmlu" / "test" / f"{subject}_test.csv")[doc_id]
        assert len(shots) == 5
        if not chat:
            assert "<|im_start|>" not in context and "<|im_end|>" not in context
            assert context == (mmlu_description(subject) + "".join(f"{mmlu_block(s)} {s[5]}\n\n" for s in shots)
                               + mmlu_block(question))
            assert continuation in (" A", " B", " C", " D")
        else:  # the description as the system turn, each shot a user / assistant pair, then the question
            turns = "".join(f"<|im_start|>user\n{mmlu_block(s)}<|im_end|>\n<|im_start|>assistant\n{s[5]}<|im_end|>\n"
                            for s in shots)
            assert context == (f"<|im_start|>system\n{mmlu_description(subject)}<|im_end|>\n" + turns
                               + f"<|im_start|>user\n{mmlu_block(question)}<|im_end|>\n<|im_start|>assistant\n")
            assert context.count("<|im_start|>user") == 6 and continuation in LETTERS
    summary, rows = runner.report()
    assert summary["mmlu"]["n"] == 2 and summary["mmlu"]["base"] in (0.0, 0.5, 1.0) and len(rows["mmlu"]) == 2
    # the cost the user sees: the side's wall seconds, and per question; the subjects asked per category
    seconds = summary["mmlu"]["seconds"]["base"]
    assert seconds > 0 and summary["mmlu"]["seconds_per_question"] == {"base": pytest.approx(seconds / 2)}
    assert summary["mmlu"]["categories"] == dict(Counter(benchmarks[0].categories.values()))
    assert sum(summary["mmlu"]["categories"].values()) == summary["mmlu"]["subtasks"] == len(samples)
    for row in rows["mmlu"]:  # a row's doc_id is the question's row in the test CSV
        assert row["id"] == f"{row['task']}/{row['doc_id']}" and row["doc_id"] in samples[row["task"]]
        question = csv_rows(BENCH / "mmlu" / "test" / f"{row['task'][len('mmlu_'):]}_test.csv")[row["doc_id"]]
        assert row["question"] == mmlu_block(question) and row["reference"] == question[5]


# ------------------------------------------------------------------------------------------- 2. select()
# 12 subjects in 4 categories (5 / 3 / 2 / 2 subjects), 30 questions each but one with 1 and one with 7
COUNTS = {f"mmlu_{c}{i}": 30 for c, n in (("s", 5), ("h", 3), ("o", 2), ("x", 2)) for i in range(n)}
COUNTS.update(mmlu_s4=1, mmlu_h2=7)
CATEGORIES = {name: {"s": "stem", "h": "humanities", "o": "other", "x": "social_sciences"}[name[5]]
              for name in COUNTS}


def sizes(picked: dict) -> dict:
    return {task: len(ids) for task, ids in picked.items()}


def test_select_is_seeded_and_deterministic():
    first = select(COUNTS, 40, 0, block=16, categories=CATEGORIES)
    assert select(COUNTS, 40, 0, block=16, categories=CATEGORIES) == first  # same settings: the same questions
    shuffled = dict(reversed(COUNTS.items()))
    assert select(shuffled, 40, 0, block=16, categories=dict(reversed(CATEGORIES.items()))) == first  # dict order
    others = [select(COUNTS, 40, seed, block=16, categories=CATEGORIES) for seed in range(1, 6)]
    assert all(other != first for other in others)
    for picked in (first, *others):
        assert sum(map(len, picked.values())) == 40
        for task, ids in picked.items():  # a subject's questions: its own seeded shuffle, not its first rows
            assert ids == sorted(set(ids)) and all(0 <= i < COUNTS[task] for i in ids)
    assert any(ids != list(range(len(ids))) for picked in (first, *others) for ids in picked.values())


def test_select_draws_blocks_from_the_fewest_subjects():
    """N questions in blocks of at most `block` from the fewest subjects that hold them, spread evenly; the limit
    is met exactly for every N; a small subject's block is all it has, and the next subject makes up the rest."""
    for seed in range(6):
        for limit in range(1, sum(COUNTS.values()) + 1):
            picked = sizes(select(COUNTS, limit, seed, block=16, categories=CATEGORIES))
            assert sum(picked.values()) == limit
            if limit <= sum(min(16, n) for n in COUNTS.values()):
                assert max(picked.values()) <= 16  # the blocks never pass `block` while the subjects hold N so
            left = [t for t, n in picked.items() if n < COUNTS[t]]  # subjects with questions left: within 1
            assert not left or max(picked[t] for t in left) - min(picked[t] for t in left) <= 1
    # MMLU-sized subjects: 64 in blocks of 16 is 4 subjects of 16; 40 is 3 of 14 / 13 / 13; 3 is 1 subject of 3
    big = {name: 100 for name in COUNTS}
    assert sorted(sizes(select(big, 64, 0, block=16, categories=CATEGORIES)).values()) == [16, 16, 16, 16]
    assert sorted(sizes(select(big, 40, 0, block=16, categories=CATEGORIES)).values()) == [13, 13, 14]
    assert list(sizes(select(big, 3, 0, block=16, categories=CATEGORIES)).values()) == [3]
    # block 1: one question from each of N subjects (the spread this sampling replaced: the most prefixes per question)
    assert sorted(sizes(select(big, 5, 0, block=1, categories=CATEGORIES)).values()) == [1] * 5


def test_select_takes_subjects_from_every_category_in_turn():
    """The first 4 subjects cover the 4 categories, the first 8 two of each that has two (stem, humanities) plus
    the other categories' two each; for every seed."""
    big = {name: 100 for name in COUNTS}
    for seed in range(10):
        four = select(big, 64, seed, block=16, categories=CATEGORIES)
        assert sorted(CATEGORIES[t] for t in four) == ["humanities", "other", "social_sciences", "stem"]
        eight = select(big, 128, seed, block=16, categories=CATEGORIES)
        assert sorted(Counter(CATEGORIES[t] for t in eight).values()) == [2, 2, 2, 2]
        order = stratified_order(list(big), CATEGORIES, seed)
        assert sorted(order) == sorted(big) and len({CATEGORIES[t] for t in order[:4]}) == 4
        assert Counter(CATEGORIES[t] for t in order[:10]) == {"stem": 3, "humanities": 3, "other": 2,
                                                              "social_sciences": 2}
    # without categories the subjects are one seeded order, all of them eventually
    assert sorted(stratified_order(list(big), {}, 0)) == sorted(big) and stratified_order(list(big), {}, 0) == \
        stratified_order(sorted(big, reverse=True), {}, 0)


def test_select_bench_subtasks_caps_the_subjects_and_null_means_all():
    big = {name: 100 for name in COUNTS}
    # a cap above what the blocks need changes nothing: 32 in blocks of 16 is 2 subjects, 8 allowed
    assert select(big, 32, 0, subtasks=8, block=16, categories=CATEGORIES) == select(big, 32, 0, block=16,
                                                                                      categories=CATEGORIES)
    # a cap below it: the blocks grow past `block` (64 from 2 subjects: 32 each), the same first subjects
    two = select(big, 64, 0, subtasks=2, block=16, categories=CATEGORIES)
    assert sorted(sizes(two).values()) == [32, 32] and set(two) <= set(select(big, 64, 0, block=16,
                                                                              categories=CATEGORIES))
    assert len({CATEGORIES[t] for t in two}) == 2
    # no limit: every question of the kept subjects; of every subject without a cap
    every = {t: list(range(n)) for t, n in COUNTS.items()}
    assert select(COUNTS, None, 0, block=16, categories=CATEGORIES) == every
    assert select(COUNTS, 10 ** 6, 0, block=16, categories=CATEGORIES) == every  # more than there are: all
    three = select(COUNTS, None, 0, subtasks=3, block=16, categories=CATEGORIES)
    assert len(three) == 3 and all(ids == list(range(COUNTS[t])) for t, ids in three.items())
    assert len({CATEGORIES[t] for t in three}) == 3
    # a limit above what the capped subjects hold: all of theirs
    assert select(big, 1000, 0, subtasks=2, block=16, categories=CATEGORIES) == {t: list(range(100)) for t in two}
    for bad in ({"limit": 0}, {"subtasks": 0}, {"block": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=0"):
            select(COUNTS, **{"limit": 5, "seed": 0, **bad})


def test_category_of_reads_lm_evals_tags_and_c_evals_mapping():
    """MMLU's four groups come from the tag in each lm-eval mmlu_SUBJECT YAML (19 STEM, 13 humanities, 12 social
    sciences, 13 other subjects in lm-eval 0.4.13); C-Eval's 52 subjects from its subject_mapping.json."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    from qwenft.evaluate.bench_sample import CEVAL_CATEGORIES

    class Task:  # what category_of reads of an lm-eval Task
        def __init__(self, tag):
            self.config = type("Config", (), {"tag": tag})()

    folder = Path(lm_eval.tasks.__file__).parent
    mmlu = Counter(category_of("mmlu", p.stem, Task(load_yaml(p)["tag"]))
                   for p in (folder / "mmlu" / "default").glob("mmlu_*.yaml"))
    assert mmlu == {"stem": 19, "humanities": 13, "social_sciences": 12, "other": 13}
    ceval = [p.stem for p in (folder / "ceval").glob("ceval-valid_*.yaml")]
    assert len(ceval) == 52 and sum(map(len, CEVAL_CATEGORIES.values())) == 52
    assert Counter(category_of("ceval", t, None) for t in ceval) == {"stem": 20, "social_science": 10,
                                                                      "humanities": 11, "other": 11}
    assert category_of("mytask", "mytask", Task(None)) == "" and category_of("x", "x", Task(["a_tasks", "b"])) == "a"


def bench_samples(caplog, *extra):
    """prepare() on the invented files (abstract_algebra, anatomy, astronomy, college_physics: STEM, 6 / 4 / 5 / 3
    questions; world_religions: humanities, 6): (the benchmark, the INFO and WARNING lines it logged)."""
    config = compose_config("model=tiny-random", "eval.benchmarks=[mmlu]", *extra, command="eval")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qwenft"):
        bench = bench_tasks.prepare(config)[0]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("qwenft")]
    return bench, said


def test_bench_limit_draws_blocks_the_same_for_the_same_seed(caplog):
    bench, said = bench_samples(caplog, "eval.bench_limit=5", "eval.bench_block=3")
    assert sum(map(len, bench.samples.values())) == 5 and sorted(map(len, bench.samples.values())) == [2, 3]
    assert set(bench.categories.values()) == {"stem", "humanities"} and set(bench.categories) == set(bench.samples)
    plan = [m for level, m in said if level == logging.INFO and m.startswith("benchmark mmlu:")]
    assert plan and plan[0].startswith("benchmark mmlu: 5 questions from 2 subjects in blocks of 2-3 (humanities 1, "
                                       "stem 1; eval.bench_limit=5, eval.bench_block=3, eval.bench_subtasks=None, "
                                       "eval.bench_seed=0)")
    assert bench_samples(caplog, "eval.bench_limit=5", "eval.bench_block=3")[0].samples == bench.samples
    assert bench_samples(caplog, "eval.bench_limit=5", "eval.bench_block=3", "eval.bench_seed=1")[0].samples != \
        bench.samples
    default, _ = bench_samples(caplog, "eval.bench_limit=5")  # eval.bench_block=16: one subject holds all 5
    assert sorted(map(len, default.samples.values())) == [5] and default.subjects == 1
    every, _ = bench_samples(caplog)  # eval.bench_limit=null: every question
    assert every.questions == 24 and every.subjects == 5


def test_more_subtasks_than_there_are_is_said(caplog):
    """bench_subtasks is lowered, never refused: the warning says to what (the test files have 5 subjects); a cap
    above what bench_limit needs is no warning (it is a cap)."""
    bench, said = bench_samples(caplog, "eval.bench_subtasks=100")
    warned = [m for level, m in said if level == logging.WARNING]
    assert bench.subjects == 5 and warned == ["eval.bench_subtasks=100 but mmlu has 5 subtasks: all 5 are used"]
    bench, said = bench_samples(caplog, "eval.bench_subtasks=4", "eval.bench_limit=3")
    assert bench.subjects == 1 and not [m for level, m in said if level == logging.WARNING]
    bench, _ = bench_samples(caplog, "eval.bench_subtasks=2", "eval.bench_limit=10")  # blocks grow: 5 + 5
    assert sorted(map(len, bench.samples.values())) == [5, 5]


@pytest.mark.parametrize("value, said", [("0", "eval.bench_block=0 is not accepted; must be >= 1"),
                                         ("-2", "eval.bench_block=-2 is not accepted"),
                                         ("abc", "eval.bench_block"), ("null", "eval.bench_block")])
def test_a_bad_bench_block_is_refused_naming_the_key(tmp_path, capsys, monkeypatch, value, said):
    out = tmp_path / "run"
    refused = run_in_process(["eval", "model=tiny-random", "quant=none", "data.sources=[]", "eval.benchmarks=[mmlu]",
                              f"eval.bench_block={value}", f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, said)


# ----------------------------------------------------------------- 3. prefix-cached scores == the full forward
def scoring_pairs(model, seed: int = 0):
    """Three "subjects" of 120 shared shot tokens, four questions each with single-token choices, the greedy
    token, a greedy 2-token and a random 3-token continuation; plus short pairs sharing nothing and a duplicate.

    Returns (pairs, subjects, distinct inputs in subjects, distinct inputs outside them)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(20, 400, (n,), generator=generator).tolist()

    def greedy(ids):
        with torch.inference_mode():
            return int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())

    pairs, grouped, single = [], set(), set()
    for subject in range(3):
        shots = [400 + subject] + tokens(119)  # distinct first tokens: the subjects share no prefix
        for _ in range(4):
            context = shots + tokens(int(torch.randint(3, 30, (1,), generator=generator)))
            first = greedy(context)
            for continuation in ([5], [6], [7], [8], [first], [first, greedy(context + [first])], tokens(3)):
                pairs.append((context, continuation))
                grouped.add(tuple((context + continuation)[:-1]))
    for length in (4, 9, 17, 25, 31):
        context = tokens(length)
        for continuation in ([5], [6], tokens(2)):
            pairs.append((context, continuation))
            single.add(tuple((context + continuation)[:-1]))
    pairs.append(pairs[3])  # the same request twice
    return pairs, 3, len(grouped), len(single)


def test_score_pairs_equals_the_full_forward_and_caches_each_shared_prefix(tiny):
    """fp32: the cached prefix's keys / values are the same numbers a full pass computes; only the summation
    order differs (attention split over cache + suffix, right padding, the chunked vocabulary projection), which
    moves a log-probability by ~1e-6 here. 1e-4 on sums of at most 3 tokens leaves a wide margin and still fails
    on any real error (a wrong position or a missing prefix shifts log-probabilities by > 0.01)."""
    model, _ = tiny
    pairs, subjects, grouped, single = scoring_pairs(model)
    reference = full_forward_scores(model, pairs)
    calls = []

    def count(module, args, kwargs):
        ids = kwargs["input_ids"]
        kind = "suffix" if kwargs.get("cache") is not None else "prefill" if kwargs.get("use_cache") else "whole"
        calls.append((kind, ids.shape[0], ids.shape[1]))

    hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        scored = score_pairs(model, pairs, batch_size=3, max_length=2048)
    finally:
        hook.remove()
    diff = max(abs(a[0] - b[0]) for a, b in zip(scored, reference))
    assert diff < 1e-4, diff
    assert [g for _, g in scored] == [g for _, g in reference]
    assert {g for _, g in reference} == {True, False}  # both flags are exercised
    # one prefill per subject, over (at least) its 120 shot tokens; every suffix batch runs on a copy of that
    # cache without the shots; the four single-token choices and the greedy token share one row
    prefills = [c for c in calls if c[0] == "prefill"]
    suffixes = [c for c in calls if c[0] == "suffix"]
    wholes = [c for c in calls if c[0] == "whole"]
    assert len(prefills) == subjects and all(rows == 1 and width >= 120 for _, rows, width in prefills)
    assert sum(rows for _, rows, _ in suffixes) == grouped == subjects * 4 * 3
    assert all(width < 120 for _, _, width in suffixes)
    # suffix batches hold as many tokens as batch_size whole rows would (suffix_rows), so more than 3 rows each here
    groups = []  # each prefill, then the suffix batches that run on its cache
    for kind, rows, w in calls:
        if kind == "prefill":
            groups.append((w, []))
        elif kind == "suffix":
            groups[-1][1].append((rows, w))
    for prefix, batches in groups:
        step = suffix_rows(3, prefix, prefix + max(w for _, w in batches))
        assert 3 < step <= MAX_ROWS_FACTOR * 3 and all(rows <= step for rows, _ in batches)
        assert len(batches) == math.ceil(4 * 3 / step)
    assert sum(rows for _, rows, _ in wholes) == single and all(width <= MIN_PREFIX for _, _, width in wholes)


def test_score_pairs_other_batch_sizes_no_grouping_and_truncation(tiny):
    model, _ = tiny
    pairs = scoring_pairs(model, seed=1)[0]
    reference = full_forward_scores(model, pairs)
    for kwargs in ({"batch_size": 1}, {"batch_size": 64}, {"batch_size": 4, "min_prefix": 10_000}):
        scored = score_pairs(model, pairs, max_length=2048, **kwargs)
        assert max(abs(a[0] - b[0]) for a, b in zip(scored, reference)) < 1e-4, kwargs
        assert [g for _, g in scored] == [g for _, g in reference], kwargs
    # inputs longer than max_length keep their last max_length tokens, as lm-eval's HFLM does
    short = full_forward_scores(model, pairs, max_length=64)
    scored = score_pairs(model, pairs, batch_size=5, max_length=64)
    assert max(abs(a[0] - b[0]) for a, b in zip(scored, short)) < 1e-4
    assert max(abs(a[0] - b[0]) for a, b in zip(short, reference)) > 1e-3  # the truncation did change something
    with pytest.raises(ValueError, match="empty continuation"):
        score_pairs(model, [([1, 2], [])], batch_size=1, max_length=64)


# ------------------------------------------- 5. the paired bootstrap (char_f1 / rouge_l gates; qwenft.evaluate.intervals)
def test_paired_bootstrap_constant_difference_is_a_point():
    assert paired_bootstrap([0.0] * 7, [1.0] * 7) == (1.0, 1.0)
    assert paired_bootstrap([1, 0, 1, 0, 1], [1, 0, 1, 0, 1]) == (0.0, 0.0)
    assert paired_bootstrap([1.0] * 4, [0.0] * 4) == (-1.0, -1.0)


def test_paired_bootstrap_hand_checked_case():
    """10 questions, tuned right on 5 more (wrong -> right on 5, no right -> wrong): delta 0.5. The resampled
    mean is k/10 with k ~ Binomial(10, 0.5): its 2.5th / 97.5th percentiles are 0.2 and 0.8."""
    base = [0.0] * 10
    tuned = [1.0] * 5 + [0.0] * 5
    low, high = paired_bootstrap(base, tuned, seed=0)
    assert -1.0 <= low < 0.5 < high <= 1.0
    assert low == pytest.approx(0.2) and high == pytest.approx(0.8)
    assert paired_bootstrap(base, tuned, seed=0) == (low, high)  # deterministic with the seed
    assert paired_bootstrap(list(reversed(base)), list(reversed(tuned)), seed=0) == pytest.approx((low, high), abs=0.11)
    # mixed flips: 6 wrong -> right, 2 right -> wrong of 20: delta 0.2, an interval around it, wider than 0
    base = [0.0] * 6 + [1.0] * 2 + [1.0] * 6 + [0.0] * 6
    tuned = [1.0] * 6 + [0.0] * 2 + [1.0] * 6 + [0.0] * 6
    low, high = paired_bootstrap(base, tuned, seed=3)
    assert -1.0 <= low <= 0.2 <= high <= 1.0 and high - low > 0.1


def test_paired_bootstrap_rejects_unequal_or_empty_lists():
    with pytest.raises(ValueError, match="equal"):
        paired_bootstrap([1.0, 0.0], [1.0])
    with pytest.raises(ValueError):
        paired_bootstrap([], [])


# ------------------------------------------------------------------------- 4. one model load, both sides
COUNT_LOADS = """
import atexit, json
import qwenft.model, qwenft.model.load, qwenft.model.lora
from transformers import AutoModelForCausalLM
_calls = {"load_model": 0, "from_pretrained": 0}
_load, _from = qwenft.model.load.load_model, AutoModelForCausalLM.from_pretrained
def _counted_load(*a, **k):
    _calls["load_model"] += 1
    return _load(*a, **k)
def _counted_from(*a, **k):
    _calls["from_pretrained"] += 1
    return _from(*a, **k)
qwenft.model.load_model = qwenft.model.load.load_model = qwenft.model.lora.load_model = _counted_load
AutoModelForCausalLM.from_pretrained = _counted_from
atexit.register(lambda: print("MODEL LOADS " + json.dumps(_calls), file=sys.stderr))
"""


def count_loads(monkeypatch) -> dict:
    """Count, in this process, the model loads (qwenft's load_model and transformers' from_pretrained)."""
    import qwenft.model
    import qwenft.model.lora
    import qwenft.model.load
    from transformers import AutoModelForCausalLM

    calls = {"load_model": 0, "from_pretrained": 0}
    load, from_pretrained = qwenft.model.load.load_model, AutoModelForCausalLM.from_pretrained

    def counted_load(*args, **kwargs):
        calls["load_model"] += 1
        return load(*args, **kwargs)

    def counted_from(*args, **kwargs):
        calls["from_pretrained"] += 1
        return from_pretrained(*args, **kwargs)

    for module in (qwenft.model, qwenft.model.load, qwenft.model.lora):
        monkeypatch.setattr(module, "load_model", counted_load)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted_from)
    return calls


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, bench_dir):
    """A 1-step tiny-random `train` whose evaluation asks 3 MMLU questions (invented files) on both sides."""
    from tests.conftest import run_train, train_overrides

    tmp = tmp_path_factory.mktemp("bench")
    run_dir = tmp / "run"
    args = [a for a in train_overrides(tmp, run_dir) if not a.startswith(("eval.after_train", "train.max_steps"))]
    started = time.perf_counter()
    result = run_train([*args, "train.max_steps=1", "eval.max_new_tokens=4", "eval.batch_size=4",
                      "eval.benchmarks=[mmlu]", "eval.bench_limit=3", f"eval.bench_data=[{bench_dir}]"],
                     patch=COUNT_LOADS)
    return tmp, run_dir, result, time.perf_counter() - started


def test_train_then_benchmark_with_one_model_load(bench_run):
    _, run_dir, result, _ = bench_run
    assert result.returncode == 0, result.stderr[-3000:]
    loads = json.loads(result.stderr.split("MODEL LOADS ")[-1].splitlines()[0])
    assert loads == {"load_model": 1, "from_pretrained": 1}  # train and both evaluated sides on one load
    mmlu = json.loads((run_dir / "metrics.json").read_text())["eval"]["benchmarks"]["mmlu"]
    # 3 questions in one block (eval.bench_block=16): one subject, one 5-shot prefix per side
    assert mmlu["n"] == 3 and mmlu["subtasks"] == 1 and mmlu["metric"] == "acc" and mmlu["shots"] == 5
    assert set(mmlu["seconds_per_question"]) == {"base", "tuned"} and sum(mmlu["categories"].values()) == 1
    for side, seconds in mmlu["seconds"].items():
        assert mmlu["seconds_per_question"][side] == pytest.approx(seconds / 3)
    for side in ("base", "tuned"):
        assert mmlu[side] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert mmlu["delta"] == pytest.approx(mmlu["tuned"] - mmlu["base"])
    low, high = mmlu["ci95"]
    assert low <= mmlu["delta"] <= high and -1.0 <= low and high <= 1.0
    assert mmlu["ci_method"] == "Newcombe paired score interval"  # right / wrong questions: the gates' interval
    report = (run_dir / "report.md").read_text()
    table = report.split("## Benchmarks\n\n", 1)[1]
    assert table.startswith("| benchmark | metric | n | base | tuned | delta | 95% CI |")
    assert "| mmlu | acc | 3 | " in table.split("\n\n")[0]
    rows = [json.loads(line) for line in (run_dir / "benchmarks.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["benchmark"] == "mmlu" and {"base", "tuned"} <= set(r) for r in rows)
    assert sum(r["base"]["correct"] for r in rows) == round(3 * mmlu["base"])


# --------------------------------------------------------------------------------- 6. bad input, user tasks
def run_in_process(args, capsys, monkeypatch) -> tuple:
    """``python -m qwenft ARGS`` in this process: (exit code, stderr lines, model loads)."""
    loads = count_loads(monkeypatch)
    result = qwenft_in_process(capsys, *args)
    return result.returncode, result.stderr.strip().splitlines(), loads


def assert_refused(code, err, loads, out_dir: Path, *names: str) -> None:
    assert code == 2, err[-20:]
    errors = [line for line in err if line.startswith("qwenft: error: ")]
    assert len(errors) == 1 and err[-1] == errors[0], err[-20:]
    assert not any("Traceback" in line for line in err)
    for name in names:
        assert name in errors[0], (name, errors[0])
    assert loads == {"load_model": 0, "from_pretrained": 0}
    assert not out_dir.exists()


def mmlu_dir(tmp_path: Path, subject: str, test_rows: list) -> Path:
    root = tmp_path / "bench"
    for split, rows in (("dev", [[f"shot {i}?", "a", "b", "c", "d", "ABCDA"[i]] for i in range(5)]),
                        ("test", test_rows)):
        (root / "mmlu" / split).mkdir(parents=True, exist_ok=True)
        with open(root / "mmlu" / split / f"{subject}_{split}.csv", "w", newline="", encoding="utf-8") as handle:
            csv.writer(handle).writerows(rows)
    return root


def test_bad_data_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("QWENFT_BENCH_DATA")
    base = ["model=tiny-random", "quant=none", "data.sources=[]"]
    out = tmp_path / "run"
    refused = run_in_process(["eval", *base, "eval.benchmarks=[mmlu]", "eval.bench_data=[/nonexistent]",
                              f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, "eval.benchmarks: mmlu", "/nonexistent/mmlu")
    # a test row with 5 fields: the file, the row and the missing field
    bench = mmlu_dir(tmp_path, "anatomy", [["q1?", "a", "b", "c", "d", "A"], ["q2?", "a", "b", "c", "d"]])
    refused = run_in_process(["eval", *base, "eval.benchmarks=[mmlu]", f"eval.bench_data=[{bench}]",
                              f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, str(bench / "mmlu" / "test" / "anatomy_test.csv"), "row 2", "field 'answer'")
    # an answer that is not a letter
    bench = mmlu_dir(tmp_path / "letter", "anatomy", [["q1?", "a", "b", "c", "d", "E"]])
    refused = run_in_process(["eval", *base, "eval.benchmarks=[mmlu]", f"eval.bench_data=[{bench}]",
                              f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, "anatomy_test.csv", "row 1", "field 'answer'", "'E'")
    # a file named after no MMLU subject lm-eval defines
    bench = mmlu_dir(tmp_path / "subject", "x", [["q1?", "a", "b", "c", "d", "A"]])
    refused = run_in_process(["eval", *base, "eval.benchmarks=[mmlu]", f"eval.bench_data=[{bench}]",
                              f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, "x_test.csv", "'x' is not a subject")
    # an empty test file; a row with a seventh field; an empty question; a dev file short of the 5 shots
    for label, rows, words in (("empty", [], ["anatomy_test.csv", "no questions"]),
                               ("extra", [["q1?", "a", "b", "c", "d", "A", "x"]], ["row 1", "7 fields"]),
                               ("blank", [[" ", "a", "b", "c", "d", "A"]], ["row 1", "field 'question': empty"])):
        bench = mmlu_dir(tmp_path / label, "anatomy", rows)
        refused = run_in_process(["eval", *base, "eval.benchmarks=[mmlu]", f"eval.bench_data=[{bench}]",
                                  f"out_dir={out}"], capsys, monkeypatch)
        assert_refused(*refused, out, *words)
    bench = mmlu_dir(tmp_path / "short", "anatomy", [["q1?", "a", "b", "c", "d", "A"]])
    with open(bench / "mmlu" / "dev" / "anatomy_dev.csv", "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["shot?", "a", "b", "c", "d", "A"]] * 2)
    refused = run_in_process(["eval", *base, "eval.benchmarks=[mmlu]", f"eval.bench_data=[{bench}]",
                              f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, "anatomy_dev.csv", "2 rows", "5-shot")
    # `train` refuses the same way, before its run directory is written
    from tests.conftest import train_overrides

    args = [a for a in train_overrides(tmp_path, out) if not a.startswith("eval.after_train")]
    refused = run_in_process(["train", *args, "eval.after_train=true",
                              "eval.benchmarks=[gsm8k]", "eval.bench_data=[/nonexistent]"], capsys, monkeypatch)
    assert_refused(*refused, out, "eval.benchmarks: gsm8k", "/nonexistent/gsm8k")


def test_bench_data_then_the_environment_is_searched(tmp_path, bench_dir, capsys, monkeypatch):
    """qwenft ships no benchmark data: eval.bench_data's directories come first, then $QWENFT_BENCH_DATA's (joined
    by os.pathsep); with neither, the error says both ways to point at the files."""
    import os

    def source(*extra):
        config = compose_config("model=tiny-random", "eval.benchmarks=[mmlu]", "eval.bench_limit=1", *extra,
                                command="eval")
        return bench_tasks.prepare(config)[0].source

    monkeypatch.setenv("QWENFT_BENCH_DATA", os.pathsep.join([str(tmp_path / "none"), "", str(bench_dir)]))
    assert source() == str(bench_dir / "mmlu")  # the second entry of the variable (an empty one is no entry)
    mine = mmlu_dir(tmp_path / "mine", "anatomy", [["q1?", "a", "b", "c", "d", "A"]])
    assert source(f"eval.bench_data=[{mine}]") == str(mine / "mmlu")  # the config's before the variable's
    monkeypatch.delenv("QWENFT_BENCH_DATA")
    out = tmp_path / "run"
    refused = run_in_process(["eval", "model=tiny-random", "quant=none", "data.sources=[]", "eval.benchmarks=[mmlu]",
                              f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, "eval.benchmarks: mmlu: no data directory",
                   "eval.bench_data is empty and $QWENFT_BENCH_DATA is unset", "eval.bench_data=[DIR]",
                   "qwenft ships none")
    refused = run_in_process(["eval", "model=tiny-random", "quant=none", "data.sources=[]", "eval.benchmarks=[mmlu]",
                              "eval.bench_missing=maybe", f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, "eval.bench_missing='maybe'", "error, skip")


def test_a_wrong_data_directory_is_named_with_why(tmp_path, bench_dir, monkeypatch):
    """A newcomer's wrong pointers each get their reason in the one line: a directory that does not exist, a file,
    the benchmark folder itself (one level too deep), a folder holding the files themselves (MMLU's tarball
    unpacks to data/{dev,test}); a right one among them is still found."""
    import os

    from qwenft.config import ConfigError
    from qwenft.evaluate.bench_data import data_folder

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "unpacked" / "dev").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    dirs = [tmp_path / "none", tmp_path / "a_file", bench_dir / "mmlu", tmp_path / "unpacked", tmp_path / "empty"]
    monkeypatch.setenv("QWENFT_BENCH_DATA", os.pathsep.join(map(str, dirs)))
    with pytest.raises(ConfigError) as info:
        data_folder("mmlu", [])
    message = str(info.value)
    assert "\n" not in message
    for said in (f"{tmp_path / 'none'} does not exist", f"{tmp_path / 'a_file'} is a file, not a directory",
                 f"{bench_dir / 'mmlu'} is mmlu/ itself: point at {bench_dir}",
                 f"{tmp_path / 'unpacked'} holds a benchmark's files themselves: they go in "
                 f"{tmp_path / 'unpacked' / 'mmlu'}/", f"{tmp_path / 'empty' / 'mmlu'}. Point"):
        assert said in message, said
    assert data_folder("mmlu", [str(tmp_path / "a_file"), str(bench_dir)]) == bench_dir / "mmlu"


def test_bench_missing_skip_runs_the_rest_and_says_what_was_skipped(tmp_path, bench_dir, capsys, monkeypatch):
    """eval.bench_missing=skip (the quickstart and domain recipes): a benchmark without data is left out with a
    warning, the others run, and metrics.json / report.md say which was skipped and why."""
    monkeypatch.delenv("QWENFT_BENCH_DATA")
    only_gsm8k = tmp_path / "only_gsm8k"
    only_gsm8k.mkdir()
    (only_gsm8k / "gsm8k").symlink_to(bench_dir / "gsm8k")
    out = tmp_path / "run"
    code, err, loads = run_in_process(["eval", "model=tiny-random", "quant=none", "data.sources=[]",
                                       "eval.benchmarks=[mmlu, gsm8k]", "eval.bench_missing=skip",
                                       f"eval.bench_data=[{only_gsm8k}]", "eval.bench_limit=1",
                                       "eval.bench_max_gen_tokens=2", f"out_dir={out}"], capsys, monkeypatch)
    assert code == 0, err[-20:]
    assert loads == {"load_model": 1, "from_pretrained": 1}
    assert "[WARNING] - benchmark mmlu skipped (eval.bench_missing=skip): no data" in (out / "eval.log").read_text()
    evaluated = json.loads((out / "metrics.json").read_text())["eval"]
    assert set(evaluated["benchmarks"]) == {"gsm8k"} and evaluated["benchmarks"]["gsm8k"]["n"] == 1
    assert set(evaluated["benchmarks_skipped"]) == {"mmlu"}
    assert str(only_gsm8k / "mmlu") in evaluated["benchmarks_skipped"]["mmlu"]
    report = (out / "report.md").read_text()
    assert f"- mmlu: skipped, no data directory; tried {only_gsm8k / 'mmlu'}" in report.split("## Benchmarks", 1)[1]


def test_unknown_benchmark_name_is_refused(tmp_path, capsys, monkeypatch):
    """lm-eval's TaskManager indexes its whole registry to know a name is not there (~15-20 s on 2 busy cores)."""
    out = tmp_path / "run"
    refused = run_in_process(["eval", "model=tiny-random", "quant=none", "data.sources=[]",
                              "eval.benchmarks=[nosuchbench]", f"out_dir={out}"], capsys, monkeypatch)
    assert_refused(*refused, out, "unknown benchmark 'nosuchbench'")


MY_TASK = """task: mytask
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def task_dir(tmp_path: Path, output_type: str) -> Path:
    folder = tmp_path / f"tasks-{output_type}"
    folder.mkdir()
    data = folder / "mytask.jsonl"
    rows = [{"question": f"What colour is thing {i}?", "choices": ["red", "blue", "green"], "answer": i % 3}
            for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "mytask.yaml").write_text(MY_TASK.format(data=data, output_type=output_type), encoding="utf-8")
    return folder


def test_a_task_yaml_lm_eval_rejects_is_named(tmp_path, capsys, monkeypatch):
    folder = task_dir(tmp_path, "nonsense")
    out = tmp_path / "run"
    refused = run_in_process(["eval", "model=tiny-random", "quant=none", "data.sources=[]",
                              "eval.benchmarks=[mytask]", f"eval.bench_tasks={folder}", f"out_dir={out}"],
                             capsys, monkeypatch)
    assert_refused(*refused, out, "mytask", str(folder / "mytask.yaml"), "output_type")


def test_a_users_task_directory_runs_base_and_tuned(bench_run, tmp_path, capsys, monkeypatch):
    """A user's own lm-eval task (multiple choice over a local JSON file), with the adapter trained above: both
    sides on one model load, into metrics.json and report.md."""
    _, run_dir, result, _ = bench_run
    assert result.returncode == 0, result.stderr[-3000:]
    folder = task_dir(tmp_path, "multiple_choice")
    out = tmp_path / "eval"
    code, err, loads = run_in_process(["eval", "model=tiny-random", "quant=none", "data.sources=[]",
                                       f"adapter={run_dir / 'adapter'}", "eval.benchmarks=[mytask]",
                                       f"eval.bench_tasks={folder}", "eval.bench_limit=null",  # the run's was 3
                                       f"out_dir={out}"], capsys, monkeypatch)
    assert code == 0, err[-20:]
    assert loads == {"load_model": 1, "from_pretrained": 1}
    mine = json.loads((out / "metrics.json").read_text())["eval"]["benchmarks"]["mytask"]
    assert mine["n"] == 4 and mine["metric"] == "acc" and mine["source"] == str(folder)
    assert mine["base"] in (0.0, 0.25, 0.5, 0.75, 1.0) and mine["delta"] == pytest.approx(mine["tuned"] - mine["base"])
    assert mine["ci95"][0] <= mine["delta"] <= mine["ci95"][1]
    assert "| mytask | acc | 4 | " in (out / "report.md").read_text()


# --------------------------------------------------------------------- 7. slow: qwenft vs lm-eval's HFLM
# The two MMLU subjects with the shortest 5-shot prompts in ../shared/data/bench: 6 questions each. Fewer shots
# would not be MMLU; fewer subjects share their shots across more questions (qwenft's prefix cache), and short
# prompts keep HFLM (every context run whole) within the time of a slow test.
SLOW_SUBJECTS = ("world_religions", "abstract_algebra")


@pytest.mark.slow  # the real 0.5B: MMLU predictions equal lm-eval's HFLM
def test_same_mmlu_predictions_as_lm_eval_hflm(embedded_dir, shared_data, tmp_path):
    """12 questions (6 per subject; 20 cost 116 s of CI), the same fp32 model object through QwenftLM and through HFLM: the same letter (argmax of
    the four log-likelihoods) for every question, and log-likelihoods within 1e-3 nats. Both run the same
    fp32 arithmetic; qwenft's differs only in summation order (a cached prefix, right padding, the chunked
    projection), measured at ~4e-5 on the embedded model, so 1e-3 is a 25x margin that a real error (a shifted
    position, a missing shot) exceeds by orders of magnitude."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    from qwenft.evaluate.bench_lm import QwenftLM
    from qwenft.generation import Sampler
    from qwenft.model import load_tokenizer

    bench = tmp_path / "bench"
    for split in ("dev", "test"):
        (bench / "mmlu" / split).mkdir(parents=True)
        for subject in SLOW_SUBJECTS:
            (bench / "mmlu" / split / f"{subject}_{split}.csv").symlink_to(
                shared_data / "bench" / "mmlu" / split / f"{subject}_{split}.csv")
    config = compose_config("model=tiny-random", "eval.benchmarks=[mmlu]", "eval.bench_limit=12",
                            "eval.bench_block=6", f"eval.bench_data=[{bench}]", command="eval")
    (questions,) = bench_tasks.prepare(config)
    assert questions.questions == 12 and {len(ids) for ids in questions.samples.values()} == {6}

    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(embedded_dir))
    model = AutoModelForCausalLM.from_pretrained(str(embedded_dir), dtype=torch.float32).eval()

    def answers(lm):
        started = time.perf_counter()
        out = evaluate(lm, {"tasks": questions.tasks, "groups": {}}, samples=questions.samples, log_samples=True,
                       bootstrap_iters=0, verbosity="WARNING")
        by_question = {}
        for task, logged in out["samples"].items():
            for sample in logged:
                lls = [r[0][0] if isinstance(r[0], tuple) else r[0] for r in sample["resps"]]
                by_question[(task, sample["doc_id"])] = lls
        return by_question, time.perf_counter() - started

    ours, ours_s = answers(QwenftLM(model, tokenizer, Sampler(model, tokenizer), batch_size=8))
    theirs, theirs_s = answers(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8))
    assert set(ours) == set(theirs) and len(ours) == 12
    same = sum(max(range(4), key=ours[q].__getitem__) == max(range(4), key=theirs[q].__getitem__) for q in ours)
    worst = max(abs(a - b) for q in ours for a, b in zip(ours[q], theirs[q]))
    print(f"qwenft {ours_s:.1f} s, HFLM {theirs_s:.1f} s, same prediction {same}/12, max |dLL| {worst:.2e}")
    assert same == 12
    assert worst < 1e-3
