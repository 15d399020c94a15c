"""Checks on one source's rows between reading and the eval split, and the ``replace`` fill of placeholders.

- :func:`fill`: ``data.sources[].replace={name: ...}`` writes a value for every ``{{name}}`` in a record's text.
- :func:`skipped_lines`: what ``data.on_bad_row=skip`` dropped (a count, the first rows, "... and N more").
- :func:`placeholder_warning` (:class:`Placeholders` as rows stream past): answers that still hold ``{{name}}``
  (public "identity" files ship this way, meant to be filled before training).
- :func:`eval_share_warning`: ``eval_rows`` holding out more than a third of a source.
- :func:`eval_rows_for`: ``eval_rows`` larger than a source, clamped with a warning or refused.

The warnings are one line each; the caller logs them.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from qwenft.config import ConfigError, DataSource, QwenftError
from qwenft.runtime import world_size

# {{name}} or {{ name }}: an identifier only, so template code such as Go's {{.Name}} or Jinja's
# {{ user.name }} in a code answer is not taken for a placeholder.
PLACEHOLDER = re.compile(r"\{\{\s*([^\W\d]\w*)\s*\}\}")
LISTED_SKIPS = 3  # skipped rows named one by one; the rest are counted
MAX_EVAL_SHARE = 1 / 3


def fill(value: Any, mapping: Dict[str, str], used: Optional[Set[str]] = None) -> Any:
    """``value`` (a record: dicts, lists, text) with each ``{{key}}`` of ``mapping`` replaced in every text.

    Placeholders whose name is not in ``mapping`` stay as they are. ``used`` collects the keys replaced.
    """
    if isinstance(value, str):
        def sub(match: "re.Match[str]") -> str:
            name = match.group(1)
            if name not in mapping:
                return match.group(0)
            if used is not None:
                used.add(name)
            return mapping[name]

        return PLACEHOLDER.sub(sub, value) if "{{" in value else value
    if isinstance(value, dict):
        return {key: fill(item, mapping, used) for key, item in value.items()}
    if isinstance(value, list):
        return [fill(item, mapping, used) for item in value]
    return value


def skipped_lines(name: str, skipped: Sequence[str], total: int, count: Optional[int] = None) -> List[str]:
    """Log lines for the rows ``data.on_bad_row=skip`` dropped from source ``name`` (``total`` rows read).

    Args:
        skipped: the messages of the skipped rows (at least the first :data:`LISTED_SKIPS` of them).
        count: how many rows were skipped (default ``len(skipped)``; more when only the first messages were kept).

    Returns:
        ``[]`` when none was skipped; else a count line, the first :data:`LISTED_SKIPS` messages, and
        ``... and N more`` when there are more.
    """
    count = len(skipped) if count is None else count
    if not count:
        return []
    lines = [f"{name}: {count} of {total} rows were skipped as bad (data.on_bad_row=skip)"]
    lines += [f"  skipped: {message}" for message in skipped[:LISTED_SKIPS]]
    if count > LISTED_SKIPS:
        lines.append(f"  ... and {count - LISTED_SKIPS} more")
    return lines


def _texts(row: dict, answers_only: bool) -> List[str]:
    if row["text"] is not None:
        return [row["text"]]
    return [m["content"] for m in row["messages"] if not answers_only or m["role"] == "assistant"]


class Placeholders:
    """Unfilled ``{{name}}`` placeholders in the answers of rows added a batch at a time (:meth:`add`), for
    :meth:`warning`: a source's rows are counted as they stream past, never held."""

    def __init__(self) -> None:
        self.answers = self.holding = 0
        self.names: Dict[str, None] = {}  # in the order first seen

    def add(self, rows: Sequence[dict]) -> "Placeholders":
        """Count the answers of ``rows`` (normalised rows, see :func:`qwenft.data.read_source`)."""
        for row in rows:
            for text in _texts(row, answers_only=True):
                self.answers += 1
                found = PLACEHOLDER.findall(text) if "{{" in text else []
                self.holding += bool(found)
                self.names.update(dict.fromkeys(found))
        return self

    def warning(self, source: DataSource, index: int) -> Optional[str]:
        """The warning of :func:`placeholder_warning` for the rows added so far."""
        if not self.holding:
            return None
        shown = list(self.names)[:5]
        listed = ", ".join(f"{{{{{n}}}}}" for n in shown) + (", ..." if len(self.names) > len(shown) else "")
        fills = ", ".join(f"{n}: ..." for n in shown)
        return (f"{source.name}: {self.holding} of {self.answers} answers contain unfilled placeholders ({listed}); "
                f"the model would learn them as written: fill them with 'data.sources.{index}.replace={{{fills}}}' "
                "or edit the file")


def placeholder_warning(rows: Sequence[dict], source: DataSource, index: int) -> Optional[str]:
    """A warning when answers of ``rows`` hold unfilled ``{{name}}`` placeholders, else None.

    Args:
        rows: the source's normalised rows (see :func:`qwenft.data.read_source`).
        source: its config entry (for its name).
        index: its position in ``data.sources`` (for the ``data.sources.N.replace`` to suggest).

    Returns:
        e.g. ``domain: 4 of 4 answers contain unfilled placeholders ({{name}}, {{author}}); ...``.
    """
    return Placeholders().add(rows).warning(source, index)


def eval_share_warning(source: DataSource, index: int, n_rows: int) -> Optional[str]:
    """A warning when ``source.eval_rows`` holds out more than a third of its ``n_rows`` usable rows (a training
    source only: an evaluation-only source, weight 0, is held out entirely on purpose), else None."""
    held = source.eval_rows
    if source.weight <= 0 or not n_rows or held <= n_rows * MAX_EVAL_SHARE or held >= n_rows:  # >=: clamped
        return None
    return (f"{source.name}: eval_rows={held} holds out {held} of its {n_rows} rows ({held / n_rows:.0%}); only "
            f"{n_rows - held} are trained on. Set data.sources.{index}.eval_rows=N for a smaller share")


def eval_rows_for(source: DataSource, index: int, n_rows: int) -> Tuple[int, Optional[str]]:
    """The rows to hold out of ``source`` (``data.sources[index]``), which has ``n_rows`` usable rows.

    ``eval_rows`` when the source has more rows (an evaluation-only source: at least that many). When a training
    source has no more (a recipe's default, e.g. the ``domain`` recipe's 50, on a small file of the user's; equal
    counts too, which would leave nothing to train on), the run goes on with a warning naming the key: it is
    clamped to a third of its rows (the share :func:`eval_share_warning` allows), so most rows are still trained on;
    an evaluation-only source (weight 0) is held out entirely. A training source with fewer than
    3 rows has no such split and is refused.

    Returns:
        ``(n_eval, warning)``: the rows to hold out and the one-line warning (None when not clamped).

    Raises:
        ConfigError: a training source too small to hold out a row and still train on one, naming
            ``data.sources.N.eval_rows`` and its largest valid value.
    """
    asked, key = source.eval_rows, f"data.sources.{index}.eval_rows"
    if asked < n_rows or (asked == n_rows and source.weight <= 0):
        return asked, None
    where = f"{source.name} ({source.path})"
    if source.weight <= 0:
        return n_rows, (f"{where}: {key}={asked} is more than its {n_rows} usable rows; clamped to {n_rows} "
                        "(an evaluation-only source, weight 0: every row held out)")
    clamped = n_rows // 3  # MAX_EVAL_SHARE of the rows, rounded down
    if clamped < 1:
        largest = max(n_rows - 1, 0)
        raise ConfigError(f"{key}={asked}: source {where} has only {n_rows} usable rows; the largest valid value is "
                          f"{largest} (at least one row must be left to train on); or set "
                          f"data.sources.{index}.weight=0 to only evaluate on it")
    more = "more than" if asked > n_rows else "all of"
    return clamped, (f"{where}: {key}={asked} is {more} its {n_rows} usable rows; clamped to {clamped} (a third), "
                     f"leaving {n_rows - clamped} rows for training; set {key}=N (at most {n_rows - 1}) to choose")


def check_batch_feed(examples: int, batch_size: int) -> None:
    """Check that the training examples fill one global batch: every process needs ``batch_size`` of them.

    Args:
        examples: training examples after the data build (packed sequences when packing is on).
        batch_size: ``train.batch_size``, per process.

    Raises:
        QwenftError: fewer examples than ``world_size x train.batch_size`` under a launch of several processes
            (accelerate would fill the batch by repeating examples, so some would weigh twice in every epoch).
    """
    need = world_size() * batch_size
    if world_size() > 1 and examples < need:
        raise QwenftError(f"{examples} training example(s) cannot feed {world_size()} processes x train.batch_size="
                          f"{batch_size} ({need} per step; the rest would be repeats): launch fewer "
                          "processes, lower train.batch_size or add training data")
