"""What a benchmark runs in: its work folder and the machine's load (the sibling benchmarks import
it: benchmarks/ is on sys.path)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def load() -> str:
    """The load averages and the CPU count: a timing is read against what else ran."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" (1/5/15 min) on {os.cpu_count()} CPUs"


@contextlib.contextmanager
def work_folder(out: Path | None, prefix: str) -> Iterator[Path]:
    """``out`` (``--out``) resolved and created, or a temporary folder named ``prefix...`` that is
    removed afterwards."""
    with contextlib.ExitStack() as stack:
        if out is None:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
        work = out.resolve()
        work.mkdir(parents=True, exist_ok=True)
        yield work
