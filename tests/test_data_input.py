"""Issue 28, bad input: each file a user can plausibly hand ``qwenft data`` gets an error naming the file, the
line or row and the field, counts that add up, and a cache left clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwenft.config import DataSource
from qwenft.data import DataError, read_source
from tests.test_data import qa_rows


def csv_lines(n: int, start: int = 0):
    return [f"question {i}?,answer {i}." for i in range(start, start + n)]


def read_skipping(path: Path, **source):
    skipped: list = []
    rows = read_source(DataSource(name="x", path=str(path), **source), on_bad_row="skip", skipped=skipped)
    return rows, skipped


def test_an_unclosed_csv_quote_is_refused_even_with_skip_naming_its_line(tmp_path):
    """The rows after an unclosed quote are one field to the csv module: skipping "1 row" would lose 4 silently."""
    path = tmp_path / "a.csv"
    path.write_text("\n".join(["instruction,output", *csv_lines(3), '"abc,def', *csv_lines(4, 3)]) + "\n")
    for on_bad_row in ("error", "skip"):
        with pytest.raises(DataError) as info:
            read_source(DataSource(name="x", path=str(path)), on_bad_row=on_bad_row)
        message = str(info.value)
        assert message.startswith(f"{path}: line 5: a quoted field") and "never closed" in message
        assert "lines 5-9" in message
    # a quote misplaced inside one line spoils that row only: skipped and counted, the rows after it read
    path.write_text("\n".join(["instruction,output", *csv_lines(2), '"q"x,a', *csv_lines(2, 2)]) + "\n")
    rows, skipped = read_skipping(path)
    assert [r["row"] for r in rows] == [2, 3, 5, 6]
    assert len(skipped) == 1 and f"{path}: line 4: malformed CSV" in skipped[0]
