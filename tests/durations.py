"""Write tests/durations.json from a run's ``--durations=0`` listing: the seconds each xdist group took (setup, call
and teardown of its tests), which tests/conftest.py uses to queue the longest groups first.

    python -m pytest -q --durations=0 | tee run.log
    python -m tests.durations run.log
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)")


def group_seconds(lines) -> dict:
    """``{group: seconds}`` from the lines of a ``--durations=0`` listing; a test's group is the name after ``@`` in
    its node id (``--dist loadgroup``), else its file below tests/ (``data/test_data.py``)."""
    seconds = defaultdict(float)
    for line in lines:
        match = LINE.match(line)
        if not match:
            continue
        nodeid = match.group(3)
        path, _, rest = nodeid.partition("::")
        group = rest.rpartition("@")[2] if "@" in rest else path.removeprefix("tests/")
        seconds[group] += float(match.group(1))
    return dict(sorted(((g, round(s, 1)) for g, s in seconds.items()), key=lambda item: -item[1]))


def main(argv=None) -> None:
    (log,) = argv if argv is not None else sys.argv[1:]
    groups = group_seconds(Path(log).read_text(encoding="utf-8", errors="replace").splitlines())
    if not groups:
        raise SystemExit(f"{log}: no --durations=0 lines found")
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps({"source": "python -m tests.durations on a --durations=0 run (2 workers)",
                               "groups": groups}, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: {len(groups)} groups, {sum(groups.values()):.0f} s in all")


if __name__ == "__main__":
    main()
