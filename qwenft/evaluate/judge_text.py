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
        return f"- judge sanity: no match judged ({sanity['errors']} requests failed): **not checked**"
    verdict = ("trusted" if sanity["trusted"] else
               f"**NOT TO BE TRUSTED** (below {sanity['threshold']:.0%}): its win rates decide no gate")
    return (f"- judge sanity: {_pct(sanity['accuracy'])}{_interval(sanity.get('ci95'))} of {sanity['n']} prompts "
            f"picked their own reference over another prompt's in both orders ({sanity['unparsed']} unparsed "
            f"counted wrong); {verdict}")


def judge_lines(judged: Optional[Dict[str, Any]]) -> List[str]:
    """``## Judge``: per comparison the wins / ties / losses, win rate with its 95% interval, position-bias rate,
    the mean answer lengths beside them, the sanity line, and the prompts each side was most clearly preferred on.
    Empty without a judge."""
    if not judged:
        return []
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
    lines += ["", "Win rate = (wins + ties / 2) / n; a win or a loss needs both orders to agree. Position bias: "
              "the share of prompts whose two orders disagreed. Judges favour longer answers: the lengths are "
              "beside the rate"]
    for kind, c in judged["comparisons"].items():
        if c.get("longer_won") is not None:
            lines[-1] += f"; {LABELS.get(kind, kind)}: the longer answer took {_pct(c['longer_won'])} of decided prompts"
    lines[-1] += "."
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
