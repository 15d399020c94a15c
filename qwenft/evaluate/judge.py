"""A pairwise judge of open answers: which of two answers to a held-out prompt is better, asked in both orders.

Protocol (after FastChat's MT-Bench pairwise judge and Arena-Hard's two games per prompt; docs/eval.md, "A judge"):

- every *match* (a prompt and two answers X and Y: tuned vs base, tuned vs the reference, or, in the sanity set, the
  reference vs another prompt's reference) is two *games*: X shown as answer A, then X shown as answer B;
- each reply is parsed strictly (:func:`parse_verdict`): a JSON object ``{"verdict": "A" | "B" | "C"}`` or, else, the
  last line holding an ``[[A]]`` / ``[[B]]`` / ``[[C]]`` marker, naming one verdict only (a judge states its verdict
  after its reasons); anything else is *unparsed* and the match is recorded as unparsed, never guessed;
- the match is a win (or a loss) only when both games pick the same answer; a tie in either or games that disagree
  is a tie, and games that disagree count toward the position-bias rate; two identical answers are a tie without
  asking;
- win rate = (wins + ties / 2) / judged matches, with Wilson's 95% score interval over prompts (one prompt, one
  trial, however many games; a tie half a success). A tie varies less than a coin flip, so with many ties the
  interval is wider than it need be: conservative, and never of zero width, as a bootstrap over prompts is when
  every prompt tied (Arena-Hard's bootstrap resamples games, which is narrower still).

The sanity set asks whether the judge can be trusted: for ``eval.judge.sanity_n`` held-out prompts, the reference
answer against another prompt's reference (same source where it has another). Its accuracy is the share of judged
matches the reference won in both orders; below ``eval.judge.sanity_threshold`` the judge is flagged, and gates on its
win rate read INCONCLUSIVE.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Dict, List, Optional, Sequence

from qwenft.config import ConfigError
import qwenft.evaluate.intervals as intervals

VERDICTS = ("A", "B", "C")
WIN, LOSS, TIE, UNPARSED, ERROR = "win", "loss", "tie", "unparsed", "error"
SCORES = {WIN: 1.0, TIE: 0.5, LOSS: 0.0}
WIN_RATE_INTERVAL = "Wilson score interval over prompts, a tie half a win"
PLACEHOLDERS = ("question", "answer_a", "answer_b", "reference")
NO_REFERENCE = "(no reference answer is given for this comparison)"

_ASK = """
Which answer is better? Weigh correctness first, then how well the answer helps the user: relevance, \
completeness, clarity. Do not let the order of the answers, their length or their style sway you. Give your reasons \
in a few sentences. Then write your verdict alone on the last line: [[A]] if answer A is better, [[B]] if answer B \
is better, [[C]] if they are equally good.
"""

RUBRIC_WITH_REFERENCE = """You are judging two AI assistants' answers to the same question. A reference answer is \
given: treat it as correct, and prefer the answer that agrees with it.

[Question]
{question}

[Reference answer]
{reference}

[Answer A]
{answer_a}

[Answer B]
{answer_b}
""" + _ASK

RUBRIC = """You are judging two AI assistants' answers to the same question.

[Question]
{question}

[Answer A]
{answer_a}

[Answer B]
{answer_b}
""" + _ASK

_MARK = re.compile(r"\[\[([ABC])\]\]")
_ECHO = re.compile(r"\[\[[ABC]\]\]\s*if\b", re.I)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)
_FIELD = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


def parse_verdict(reply: Optional[str]) -> Optional[str]:
    """The verdict of one judge reply: ``"A"``, ``"B"``, ``"C"`` (a tie) or None (unparsed).

    A reply that is a JSON object (alone, or alone in a fenced block) is read by its ``verdict`` key ("A", "B",
    "C", "[[A]]", ... or "tie"); one that is not JSON by the last line holding an ``[[A]]`` / ``[[B]]`` / ``[[C]]``
    marker, which must name one verdict only (FastChat took the first "[[A]]" anywhere, a bias toward A, FastChat PR
    #3921; a weak judge that repeats the rubric's "[[A]] if ..., [[B]] if ..., [[C]] if ...", or a part of it such
    as "[[A]] if answer A is better", gives no verdict, not a tie). Nothing else is guessed.
    """
    if not reply:
        return None
    text = reply.strip()
    fenced = _FENCE.fullmatch(text)
    body = fenced.group(1) if fenced else text
    if body.startswith("{") and body.endswith("}"):
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            value = obj.get("verdict")
            if not isinstance(value, str):
                return None
            value = value.strip().strip("[]").strip().upper()
            return "C" if value == "TIE" else value if value in VERDICTS else None
    lines = [line for line in text.splitlines() if _MARK.search(line)]
    if not lines or _ECHO.search(lines[-1]):  # "[[A]] if answer A is better": the rubric's words, not a verdict
        return None
    named = set(_MARK.findall(lines[-1]))
    return named.pop() if len(named) == 1 else None


def load_rubric(path: Optional[str]) -> Optional[str]:
    """The text of a rubric file (``eval.judge.rubric``), or None for the built-in rubrics.

    Raises:
        ConfigError: no such file, not UTF-8, or missing ``{question}``, ``{answer_a}`` or ``{answer_b}``.
    """
    if path is None:
        return None
    from qwenft.data import resolve_path

    file = resolve_path(path)
    if not file.is_file():
        raise ConfigError(f"eval.judge.rubric={path!r}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"eval.judge.rubric={path!r}: not UTF-8 text (byte {exc.start})") from None
    missing = [f"{{{name}}}" for name in PLACEHOLDERS[:3] if f"{{{name}}}" not in text]
    if missing:
        raise ConfigError(f"eval.judge.rubric={path!r}: the rubric has no {', '.join(missing)}; it needs {{question}}, "
                          "{answer_a} and {answer_b} (and {reference} to show the reference answer)")
    return text


def render(rubric: Optional[str], question: str, answer_a: str, answer_b: str, reference: Optional[str]) -> str:
    """The judge's prompt: the rubric with its ``{question}``, ``{answer_a}``, ``{answer_b}``, ``{reference}``
    filled in one pass (braces inside the answers are left as they are). The built-in rubric shows the reference
    only when one is given; a custom rubric's ``{reference}`` reads :data:`NO_REFERENCE` then."""
    template = rubric or (RUBRIC_WITH_REFERENCE if reference is not None else RUBRIC)
    values = {"question": question, "answer_a": answer_a, "answer_b": answer_b,
              "reference": reference if reference is not None else NO_REFERENCE}
    return _FIELD.sub(lambda m: values[m.group(1)], template)


def match(kind: str, slot: Dict[str, Any], x: str, y: str, x_text: str, y_text: str,
          reference: Optional[str], rubric: Optional[str]) -> Dict[str, Any]:
    """One match of ``x`` (the side whose wins are counted) against ``y`` on one held-out prompt, with its two
    games' prompts: ``games[0]`` shows ``x`` as answer A, ``games[1]`` as answer B. ``slot`` is the prompt's row of
    the evaluation (``source``, ``row``, ``prompt``, ``history``)."""
    question = question_text(slot)
    return {"kind": kind, "source": slot.get("source"), "row": slot.get("row"), "prompt": question,
            "x": x, "y": y, "answers": {x: x_text, y: y_text}, "reference": reference,
            "games": [{"x_as": "A", "prompt": render(rubric, question, x_text, y_text, reference)},
                      {"x_as": "B", "prompt": render(rubric, question, y_text, x_text, reference)}]}


def question_text(slot: Dict[str, Any]) -> str:
    """The prompt as the judge reads it: the final user turn, after the earlier turns when there were any."""
    history = slot.get("history") or []
    if not history:
        return slot.get("prompt", "")
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in history]
    return "\n".join([*turns, f"User: {slot.get('prompt', '')}"])


def settle(m: Dict[str, Any], replies: Sequence[Optional[Dict[str, Any]]]) -> Dict[str, Any]:
    """Record both games' replies in match ``m`` and decide it (module docstring).

    Args:
        replies: per game ``{"reply": text}`` or ``{"error": text}``; None for both when the answers are identical
            (no game was asked).

    Returns:
        ``m`` with ``verdict`` (win / loss / tie / unparsed / error, from ``x``'s side), ``consistent`` (both games
        picked the same; None unless both parsed) and per game ``reply``, ``parsed`` and ``winner``.
    """
    if all(r is None for r in replies):
        m.update(verdict=TIE, consistent=True, identical=True)
        return m
    winners = []
    for game, reply in zip(m["games"], replies):
        game.update(reply or {})
        if "error" in game:
            winners.append(ERROR)
            continue
        game["parsed"] = parse_verdict(game.get("reply"))
        if game["parsed"] is None:
            game["winner"] = None
            winners.append(UNPARSED)
            continue
        game["winner"] = TIE if game["parsed"] == "C" else m["x"] if game["parsed"] == game["x_as"] else m["y"]
        winners.append(game["winner"])
    if ERROR in winners:
        m.update(verdict=ERROR, consistent=None)
    elif UNPARSED in winners:
        m.update(verdict=UNPARSED, consistent=None)
    else:
        same = winners[0] == winners[1]
        verdict = TIE if not same or winners[0] == TIE else WIN if winners[0] == m["x"] else LOSS
        m.update(verdict=verdict, consistent=same)
    return m


def summarise(matches: Sequence[Dict[str, Any]], lengths: Optional[Dict[str, List[float]]] = None
              ) -> Dict[str, Any]:
    """Counts, win rate and its 95% interval, position-bias rate and the answers' lengths of one comparison.

    Args:
        matches: settled matches (:func:`settle`) of one kind.
        lengths: per side (``x`` / ``y``), the answers' lengths in characters, in the order of ``matches``.

    Returns:
        ``{"n" (judged: win, tie or loss), "wins", "ties", "losses", "unparsed", "errors", "identical",
        "win_rate", "ci95", "ci_method", "position_bias" (share of the matches whose two games were both parsed
        that disagreed), "disagreed", "favoured_slot" ({"A": n, "B": n}: which slot won games that disagreed),
        "x_chars", "y_chars" (mean answer lengths, characters), "longer_won" (share of wins and losses the longer
        answer took)}``; win_rate and ci95 None when nothing was judged.
    """
    judged = [m for m in matches if m["verdict"] in SCORES]
    scores = [SCORES[m["verdict"]] for m in judged]
    both_parsed = [m for m in judged if not m.get("identical")]
    disagreed = [m for m in both_parsed if not m["consistent"]]
    slots = {"A": 0, "B": 0}
    for m in disagreed:
        for game in m["games"]:
            if game["winner"] not in (TIE, None):
                slots["A" if (game["winner"] == m["x"]) == (game["x_as"] == "A") else "B"] += 1
    out: Dict[str, Any] = {"n": len(judged), "wins": sum(m["verdict"] == WIN for m in judged),
                           "ties": sum(m["verdict"] == TIE for m in judged),
                           "losses": sum(m["verdict"] == LOSS for m in judged),
                           "unparsed": sum(m["verdict"] == UNPARSED for m in matches),
                           "errors": sum(m["verdict"] == ERROR for m in matches),
                           "identical": sum(bool(m.get("identical")) for m in matches),
                           "win_rate": None, "ci95": None, "ci_method": None,
                           "position_bias": len(disagreed) / len(both_parsed) if both_parsed else None,
                           "disagreed": len(disagreed), "favoured_slot": slots}
    if scores:
        low, high = intervals.wilson(sum(scores), len(scores))  # wins + ties / 2 successes of n prompts
        out.update(win_rate=sum(scores) / len(scores), ci95=[round(low, 9), round(high, 9)],
                   ci_method=WIN_RATE_INTERVAL)
    if lengths:
        for side in ("x", "y"):
            values = lengths.get(side) or []
            out[f"{side}_chars"] = sum(values) / len(values) if values else None
        decided = [(m, i) for i, m in enumerate(matches) if m["verdict"] in (WIN, LOSS)
                   and lengths["x"][i] != lengths["y"][i]]
        longer = [(m["verdict"] == WIN) == (lengths["x"][i] > lengths["y"][i]) for m, i in decided]
        out["longer_won"] = sum(longer) / len(longer) if longer else None
    return out


def sanity_matches(slots: Sequence[Dict[str, Any]], n: int, seed: int, rubric: Optional[str]) -> List[Dict[str, Any]]:
    """The sanity set: up to ``n`` prompts (seeded) whose reference meets a deliberately worse answer, the
    reference of another prompt (of the same source where it has one with a different reference). Fewer than two
    distinct references: none. The judge does not see the reference as such (it is one of the answers)."""
    usable = [s for s in slots if (s.get("reference") or "").strip()]
    if n <= 0 or len({s["reference"].strip() for s in usable}) < 2:
        return []
    rng = random.Random(seed)
    chosen = rng.sample(usable, min(n, len(usable)))
    out = []
    for slot in chosen:
        own = slot["reference"].strip()
        same = [s for s in usable if s.get("source") == slot.get("source") and s["reference"].strip() != own]
        others = same or [s for s in usable if s["reference"].strip() != own]
        wrong = rng.choice(others)
        m = match("sanity", slot, "reference", "other", slot["reference"], wrong["reference"], None, rubric)
        m["other_row"] = {"source": wrong.get("source"), "row": wrong.get("row")}
        out.append(m)
    return out


def sanity_summary(matches: Sequence[Dict[str, Any]], threshold: float) -> Dict[str, Any]:
    """The judge's accuracy on the sanity set: the share of its matches the reference won in both orders (an
    unparsed reply counts as not picking it: a judge that cannot answer in the format is not one to trust; a
    request that failed is left out), its Wilson interval, and ``trusted`` (accuracy >= ``threshold``; None when
    no match was asked or every request failed)."""
    judged = [m for m in matches if m["verdict"] != ERROR]
    right = sum(m["verdict"] == WIN for m in judged)
    out: Dict[str, Any] = {"n": len(judged), "right": right, "asked": len(matches),
                           "unparsed": sum(m["verdict"] == UNPARSED for m in matches),
                           "errors": sum(m["verdict"] == ERROR for m in matches), "threshold": threshold,
                           "accuracy": None, "ci95": None, "trusted": None}
    if judged:
        accuracy = right / len(judged)
        out.update(accuracy=accuracy, ci95=[round(v, 9) for v in intervals.wilson(right, len(judged))],
                   trusted=accuracy >= threshold - 1e-9)
    return out
