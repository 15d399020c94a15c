"""The judge over one evaluation: the matches of every held-out prompt, the sanity set, the replies (cached) and
the results that metrics.json, judgments.jsonl, report.md and the gates read (protocol: :mod:`qwenft.evaluate.judge`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from qwenft.config import Config
from qwenft.config.gates import JUDGE_ITEMS
from qwenft.evaluate.judge import (LOSS, WIN, load_rubric, match, sanity_matches, sanity_summary, settle,
                                   summarise)
from qwenft.evaluate.judge_client import (EndpointJudge, JudgeUnavailable, ReplyCache, cache_root, check_cache_dir,
                                          make_judge, preset_model)

log = logging.getLogger(__name__)

OPPONENT = {"base": "base", "reference": "reference"}  # eval.judge.compare -> what the tuned answer meets


def check_judge(config: Config) -> None:
    """Refuse a judge that cannot work before any model loads (``train`` checks before training): the rubric file
    is read, the cache directory is usable, a local preset exists, an endpoint answers a short request
    (:meth:`EndpointJudge.preflight`: the one request before judging). Nothing for ``eval`` without an adapter
    (no tuned side to judge: a warning).

    Raises:
        ConfigError: a bad rubric file, cache directory or preset name.
        JudgeUnavailable: the endpoint is down or refuses the key or the model (one line, exit 2).
    """
    judge = config.eval.judge
    if not judge.enabled:
        return
    if config.command == "eval" and not config.adapter:
        log.warning("eval.judge is set but there is no adapter: the base alone has nothing to be judged against")
        return
    load_rubric(judge.rubric)
    check_cache_dir(cache_root(judge))
    if judge.local:
        preset_model(judge.local)
    else:
        EndpointJudge(judge).preflight()


def judged_slots(config: Config, report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The held-out rows the judge reads: every row of ``eval.judge.sources`` (null: every source) with a base and
    a tuned answer, each with its ``source``, ``row``, ``prompt``, ``history`` and ``reference``."""
    wanted = config.eval.judge.sources
    return [slot for name, rows in (report.get("rows") or {}).items() if wanted is None or name in wanted
            for slot in rows if "base" in slot and "tuned" in slot]


def build_matches(config: Config, slots: List[Dict[str, Any]], rubric: Optional[str] = None
                  ) -> Dict[str, List[Dict[str, Any]]]:
    """Per comparison of ``eval.judge.compare`` (and ``sanity``), its matches (:func:`qwenft.evaluate.judge.match`);
    ``rubric``: the text of ``eval.judge.rubric`` when already read (None: read it here)."""
    judge = config.eval.judge
    rubric = rubric if rubric is not None else load_rubric(judge.rubric)
    out: Dict[str, List[Dict[str, Any]]] = {}
    for kind in judge.compare:
        matches = []
        for slot in slots:
            if kind == "base":
                reference = slot.get("reference") if judge.reference else None
                matches.append(match(kind, slot, "tuned", "base", slot["tuned"]["text"], slot["base"]["text"],
                                     reference, rubric))
            else:
                matches.append(match(kind, slot, "tuned", "reference", slot["tuned"]["text"], slot["reference"],
                                     None, rubric))
        out[kind] = matches
    out["sanity"] = sanity_matches(slots, judge.sanity_n, judge.seed, rubric)
    return out


def ask(client, config: Config, matches: Dict[str, List[Dict[str, Any]]]) -> Dict[str, int]:
    """Settle every match: its games' replies from the cache or the judge (each distinct prompt asked once, in one
    pool); identical answers are a tie without asking. Replies are cached as they arrive.

    Returns:
        ``{"games", "asked", "cached"}``: games needing a reply, prompts sent, replies the cache held.

    Raises:
        JudgeUnavailable: see :class:`qwenft.evaluate.judge_client.EndpointJudge`, or every request asked failed
            after its retries (replies received so far are cached).
    """
    judge = config.eval.judge
    cache = ReplyCache(cache_root(judge))
    replies: Dict[str, Dict[str, str]] = {}
    pending: Dict[str, str] = {}
    games = 0
    for m in (m for ms in matches.values() for m in ms):
        if _identical(m):
            continue
        for game in m["games"]:
            games += 1
            game["key"] = ReplyCache.key(client.id, game["prompt"], judge)
            cached = cache.get(game["key"])
            if cached is not None:
                replies[game["key"]] = {"reply": cached, "cached": True}
            elif game["key"] not in replies:
                pending[game["key"]] = game["prompt"]
    keys = list(pending)

    def keep(index: int, result: Dict[str, str]) -> None:
        replies[keys[index]] = result
        if "reply" in result:
            cache.put(keys[index], result["reply"])

    log.info("judge %s: %d games, %d cached, %d to ask", client.describe(), games, games - len(keys), len(keys))
    if keys:
        results = client.complete_all([pending[k] for k in keys], "judge", keep)
        failed = [r["error"] for r in results if "error" in r]
        if failed and len(failed) == len(results):  # nothing answered: as good as down
            raise JudgeUnavailable(f"judge endpoint {getattr(client, 'url', client.describe())}: all {len(failed)} "
                                   f"requests failed after their retries (first: {failed[0]})")
        if failed:
            log.warning("judge: %d of %d requests failed after their retries (first: %s); their prompts are counted "
                        "as errors, outside n; a re-run asks only for them", len(failed), len(results), failed[0])
    for m in (m for ms in matches.values() for m in ms):
        settle(m, [None, None] if _identical(m) else [replies[g["key"]] for g in m["games"]])
    return {"games": games, "asked": len(keys), "cached": games - len(keys)}


def _identical(m: Dict[str, Any]) -> bool:
    texts = list(m["answers"].values())
    return len(texts) == 2 and texts[0].strip() == texts[1].strip()


def run_judge(config: Config, report: Dict[str, Any], client=None) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Judge the tuned answers of ``report`` (what :func:`qwenft.evaluate.run.evaluate` returns, both sides).

    Args:
        client: the judge (default: :func:`qwenft.evaluate.judge_client.make_judge`).

    Returns:
        ``(summary, judgments)``: ``summary`` for metrics.json's ``eval.judge`` (``judge``, ``rubric``,
        ``comparisons`` {compare: :func:`~qwenft.evaluate.judge.summarise` + ``item``}, ``sanity``, ``requests``,
        ``examples``); ``judgments`` one record per match for judgments.jsonl.

    Raises:
        JudgeUnavailable: the endpoint is down or refuses the key or the model.
    """
    judge = config.eval.judge
    if client is None:
        client = make_judge(config)
        client.resolve()  # the endpoint was asked before any model loaded (check_judge)
    slots = judged_slots(config, report)
    rubric = load_rubric(judge.rubric)  # read once: the matches and the summary's reference_shown
    matches = build_matches(config, slots, rubric)
    requests = ask(client, config, matches)
    comparisons: Dict[str, Any] = {}
    examples: Dict[str, Any] = {}
    for kind in judge.compare:
        ms = matches[kind]
        lengths = {"x": [len(m["answers"][m["x"]]) for m in ms], "y": [len(m["answers"][m["y"]]) for m in ms]}
        comparisons[kind] = {"item": JUDGE_ITEMS[kind], "x": "tuned", "y": OPPONENT[kind],
                             **summarise(ms, lengths)}
        examples[kind] = clearest(ms, judge.examples)
    sanity = sanity_summary(matches["sanity"], judge.sanity_threshold) if matches["sanity"] else None
    shown = judge.reference and (rubric is None or "{reference}" in rubric)
    summary = {"judge": client.describe(), "rubric": judge.rubric or "built-in",
               "reference_shown": shown, "comparisons": comparisons, "sanity": sanity,
               "requests": requests, "examples": examples,
               "settings": {"temperature": judge.temperature, "max_tokens": judge.max_tokens,
                            "sanity_threshold": judge.sanity_threshold}}
    judgments = [record(m) for ms in matches.values() for m in ms]
    return summary, judgments


def clearest(matches: List[Dict[str, Any]], n: int) -> Dict[str, List[Dict[str, Any]]]:
    """Up to ``n`` prompts the judge preferred each side on, clearest first: wins and losses are matches both orders
    agreed on; among them, first the ones where the preferred answer is the shorter (a preference a length bias
    cannot explain), by how much shorter."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for verdict, side in ((WIN, "x"), (LOSS, "y")):
        won = [m for m in matches if m["verdict"] == verdict]
        won.sort(key=lambda m: len(m["answers"][m[side]]) - len(m["answers"][m["y" if side == "x" else "x"]]))
        out[verdict] = [{"source": m["source"], "row": m["row"], "prompt": m["prompt"],
                         "answers": m["answers"], "replies": [g.get("reply") for g in m["games"]]}
                        for m in won[:n]]
    return out


def record(m: Dict[str, Any]) -> Dict[str, Any]:
    """One line of judgments.jsonl: the prompt, both answers, both games' raw replies and parsed verdicts, the
    match's verdict."""
    out = {"comparison": m["kind"], "source": m["source"], "row": m["row"], "prompt": m["prompt"],
           "x": m["x"], "y": m["y"], "answers": m["answers"], "reference_shown": m["reference"],
           "verdict": m["verdict"], "consistent": m.get("consistent"), "identical": bool(m.get("identical")),
           "games": [{**{k: g.get(k) for k in ("x_as", "reply", "parsed", "winner", "error")},
                      "cached": bool(g.get("cached"))} for g in m["games"]] if not m.get("identical") else []}
    if "other_row" in m:
        out["other_row"] = m["other_row"]
    return out


def write_judgments(path: Path, judgments: List[Dict[str, Any]]) -> None:
    """judgments.jsonl, one match a line, written to a temp name and renamed."""
    from qwenft.files import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(j, ensure_ascii=False) + "\n" for j in judgments))


def judge_item(name: str, comparison: Dict[str, Any], sanity: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The verdict's item of one comparison (:func:`qwenft.evaluate.verdict.items`): win rate as ``tuned``, 0.5 (a
    side against itself) as ``base``, intervals on both; ``distrust`` names a failed (or unjudged) sanity check,
    which leaves the item INCONCLUSIVE; ``eval.judge.sanity_n=0`` asks for none, and none is held against it."""
    rate, ci = comparison.get("win_rate"), comparison.get("ci95")
    distrust = None
    if sanity and sanity.get("trusted") is False:
        distrust = (f"the judge failed its sanity check: accuracy {sanity['accuracy']:.2f} < "
                    f"{sanity['threshold']:.2f} (n = {sanity['n']})")
    elif sanity and sanity.get("trusted") is None:  # asked for, but every sanity request failed
        distrust = f"the judge's sanity check was not judged ({sanity['errors']} of {sanity['asked']} failed)"
    return {"name": name, "kind": "judge", "metric": "win_rate", "n": comparison.get("n", 0), "base": 0.5,
            "tuned": rate, "delta": None if rate is None else rate - 0.5,
            "ci95": None if ci is None else [ci[0] - 0.5, ci[1] - 0.5], "ci_method": comparison.get("ci_method"),
            "tuned_ci95": ci, "has_tuned": True, "distrust": distrust}
