"""What ``benchmarks/gpu_check.py`` prints last: a compact summary that fits in what comes back
from a lent GPU host (the last 12,000 characters of the output). The full table is the text
file in ``--out`` (``TABLE_NAME``), the numbers the JSON beside it (``JSON_NAME``).

One line per row, ``verdict section item: value``, in the run's order. When that is too long,
values are cut shorter, then the reported-only rows (``-``), the GPU-only bounds of a dry run
(``n/a``) and the PASS rows are left out, in that order, with a line saying how many; FAIL,
WARN and SKIP rows stay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

JSON_NAME = "gpu-check.json"
TABLE_NAME = "gpu-check-table.txt"
SUMMARY_CHARS = 10_000  # under the 12,000 characters that come back, with room for a line after it
VERDICTS = ("PASS", "FAIL", "WARN", "SKIP", "n/a", "-")
# (value width, verdicts left out): tried in order until the summary fits
STEPS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (90, ()),
    (60, ()),
    (60, ("-",)),
    (48, ("-", "n/a")),
    (48, ("-", "n/a", "PASS")),
)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def summary(rows: Sequence[Any], head: str, limit: int = SUMMARY_CHARS) -> str:
    """``head`` (one line: time, where the files are), the verdict counts, then the rows
    (objects with ``section``, ``item``, ``text``, ``verdict``), shortened to ``limit`` characters."""
    counts = Counter(r.verdict for r in rows)
    tally = ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts[v])
    top = [head, f"{len(rows)} rows: {tally}", "verdict | section | item: value"]
    text = ""
    for width, drop in STEPS:
        kept = [r for r in rows if r.verdict not in drop]
        lines = [f"{r.verdict:4} {r.section} {r.item}: {_clip(r.text, width)}" for r in kept]
        if drop:
            left = Counter(r.verdict for r in rows if r.verdict in drop)
            what = ", ".join(f"{n} {v}" for v, n in left.items())
            lines.append(f"({len(rows) - len(kept)} rows left out here: {what}; all are in the table file)")
        text = "\n".join([*top, *lines])
        if len(text) <= limit:
            return text
    cut = "\n... (cut here to fit; every row is in the table file)"
    return text[: limit - len(cut)] + cut
