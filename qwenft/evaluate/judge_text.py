"""report.md's judge section (metrics.json's ``eval.judge``, :func:`qwenft.evaluate.judging.run_judge`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from qwenft.evaluate.judge import LOSS, WIN

LABELS = {"base": "tuned vs base", "reference": "tuned vs reference"}


def _pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _interval(ci: Optional[List[float]]) -> str:
    return "" if not ci else f" [{ci[0]:.1%}, {ci[1]:.1%}]"


def _short(text: Optional[str], limit: int = 240) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[:limit] + " …"


def sanity_line(sanity: Optional[Dict[str, Any]]) -> str:
    """One line: the judge's sanity accuracy and whether it is to be trusted."""
    if not sanity:
        return ("- judge sanity: not checked (eval.judge.sanity_n=0, or fewer than two distinct references): "
                "nothing says this judge can tell a right answer from a wrong one")
    if sanity.get("accuracy") is None:
        return (f"- judge sanity: **not checked**: the requests of all {sanity['asked']} {_prompts(sanity['asked'])} "
                "failed, so its win rates decide no gate")
    verdict = ("trusted" if sanity["trusted"] else
               f"**NOT TO BE TRUSTED** (below {sanity['threshold']:.0%}): its win rates decide no gate")
    failed = f", {sanity['errors']} left out (their requests failed)" if sanity.get("errors") else ""
    return (f"- judge sanity: {_pct(sanity['accuracy'])}{_interval(sanity.get('ci95'))} of {sanity['n']} "
            f"{_prompts(sanity['n'])}: the reference picked over another prompt's reference in both orders "
            f"({sanity['unparsed']} unparsed, counted wrong{failed}); {verdict}")


def _prompts(n: int) -> str:
    return "prompt" if n == 1 else "prompts"


def judge_lines(judged: Optional[Dict[str, Any]]) -> List[str]:
    """``## Judge``: per comparison the wins / ties / losses, win rate with its 95% interval, position-bias rate,
    the mean answer lengths beside them, the sanity line, and the prompts each side was most clearly preferred on.
    Empty without a judge."""
    if not judged:
        return []
    if judged.get("failed"):  # the judge went away: the rest of the evaluation stands
        return ["## Judge (pairwise, both orders)", "", f"**Not completed**: {judged['failed']}. Every number above "
                "stands; a re-run asks the judge only for what it did not answer (the replies received are cached).",
                ""]
    lines = ["## Judge (pairwise, both orders)", "",
             f"- judge: {judged['judge']}; rubric: {judged['rubric']}"
             + ("; the reference answer shown to it" if judged.get("reference_shown") else ""),
             sanity_line(judged.get("sanity")),
             f"- requests: {judged['requests']['games']} games, {judged['requests']['cached']} from the cache, "
             f"{judged['requests']['asked']} asked", "",
             "| comparison | n | wins | ties | losses | win rate [95% CI] | position bias | unparsed | errors "
             "| mean chars (tuned / other) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, c in judged["comparisons"].items():
        lengths = f"{c.get('x_chars') or 0:.0f} / {c.get('y_chars') or 0:.0f}"
        lines.append(f"| {LABELS.get(kind, kind)} (`{c['item']}`) | {c['n']} | {c['wins']} | {c['ties']} | "
                     f"{c['losses']} | {_pct(c['win_rate'])}{_interval(c['ci95'])} | {_pct(c['position_bias'])} | "
                     f"{c['unparsed']} | {c['errors']} | {lengths} |")
    lines += ["", "Win rate = (wins + ties / 2) / n, with Wilson's interval over prompts; a win or a loss needs "
              "both orders to agree. Position bias: the share of prompts whose two orders disagreed. Unparsed "
              "replies and failed requests are outside n. Judges favour longer answers: the lengths are beside "
              "the rate.", ""]
    for kind, c in judged["comparisons"].items():
        notes = []
        if c.get("disagreed"):
            slot = c.get("favoured_slot") or {}
            notes.append(f"the {c['disagreed']} disagreeing {_prompts(c['disagreed'])}' games favoured slot A "
                         f"{slot.get('A', 0)} times, slot B {slot.get('B', 0)} times")
        if c.get("identical"):
            notes.append(f"{c['identical']} {_prompts(c['identical'])} had identical answers: ties, not sent")
        if c.get("longer_won") is not None:
            notes.append(f"the longer answer took {_pct(c['longer_won'])} of the wins and losses")
        if notes:
            lines.append(f"- {LABELS.get(kind, kind)}: " + "; ".join(notes))
    lines.append("")
    for kind, by_verdict in (judged.get("examples") or {}).items():
        for verdict, title in ((WIN, "tuned preferred"), (LOSS, "other preferred")):
            shown = by_verdict.get(verdict) or []
            if not shown:
                continue
            other = judged["comparisons"][kind]["y"]
            lines += [f"### {LABELS.get(kind, kind)}: {title} ({len(shown)} clearest)", ""]
            for ex in shown:
                lines += [f"**{ex['source']} row {ex['row']}**: {_short(ex['prompt'])}", "",
                          f"- tuned: {_short(ex['answers'].get('tuned'))}",
                          f"- {other}: {_short(ex['answers'].get(other))}",
                          f"- judge (tuned as A): {_short(ex['replies'][0], 160)}", ""]
    return lines
