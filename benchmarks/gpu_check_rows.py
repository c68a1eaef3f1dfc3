"""The GPU check's rows (``benchmarks/gpu_check.py``): ``Check`` holds the run's rows, the raw
numbers later sections read, the deadline, and writes ``--out``'s JSON and full table."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_check_summary import JSON_NAME, TABLE_NAME

from feddifrc_app.files import atomic_write


@dataclass
class Row:
    section: str
    item: str
    value: Any  # a number or text (JSON)
    text: str  # the value as the table shows it
    bound: str
    verdict: str  # PASS, FAIL, WARN, SKIP, n/a (a GPU bound in a dry run), - (reported only)


class Check:
    """The run's rows, raw numbers (``data``, read by later sections), deadline and JSON file."""

    def __init__(self, args: argparse.Namespace, t0: float | None = None) -> None:
        """``t0``: when the deadline started (the script passes its start, T0; default: now)."""
        self.args = args
        self.t0 = time.perf_counter() if t0 is None else t0
        self.dry = bool(args.dry_run)
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.float32 if self.dry else torch.float16  # D and E: SD-2.1's auto dtype
        self.cache_dir = Path(args.cache_dir).expanduser()
        self.out_dir = Path(args.out).expanduser()
        self.out = self.out_dir / JSON_NAME
        self.reserved = 0.0  # seconds held for later sections' own shares (RESERVED), on a GPU
        self.rows: list[Row] = []
        self.data: dict[str, dict[str, Any]] = {}
        self.section = ""
        self.started = datetime.now(UTC).isoformat(timespec="seconds")

    # ---- time

    def left(self) -> float:
        return self.args.deadline - (time.perf_counter() - self.t0)

    def time_for(self, gpu_s: float, what: str) -> bool:
        """False, with a SKIP row for ``what``, when fewer than ``gpu_s`` seconds are left beside
        the later sections' shares (any time does in a dry run, where sections take seconds)."""
        need, held = (0.0, 0.0) if self.dry else (gpu_s, self.reserved)
        if self.left() - held >= need:
            return True
        kept = f" ({held:.0f} s of them held for a later section)" if held else ""
        self.skip(what, f"deadline: {max(self.left(), 0):.0f} s left{kept}, this needs about {gpu_s:.0f} s")
        return False

    # ---- rows

    def add(
        self, item: str, value: Any, text: str | None = None, bound: str = "", verdict: str = "-"
    ) -> None:
        row = Row(self.section, item, _plain(value), _fmt(value) if text is None else text, bound, verdict)
        self.rows.append(row)
        print(f"  {verdict:4s}  {item}: {row.text}{f'   [{bound}]' if bound else ''}", flush=True)

    def judge(
        self,
        item: str,
        value: Any,
        ok: bool,
        bound: str,
        text: str | None = None,
        *,
        gpu: bool = False,
        warn: bool = False,
    ) -> None:
        """A row with a bound: PASS / FAIL (``warn``: WARN); ``gpu`` bounds read n/a in a dry run."""
        if gpu and self.dry:
            self.add(item, value, text, f"{bound} (GPU only)", "n/a")
        else:
            self.add(item, value, text, bound, "PASS" if ok else ("WARN" if warn else "FAIL"))

    def skip(self, item: str, reason: str) -> None:
        self.add(item, reason, reason, "", "SKIP")

    def fail(self, item: str, e: BaseException) -> None:
        traceback.print_exc()
        self.add(item, one_line(e), bound="no exception", verdict="FAIL")

    # ---- output

    def save(self, complete: bool = False) -> None:
        doc = {
            "format": "feddifrc-gpu-check",
            "version": 1,
            "started": self.started,
            "argv": sys.argv[1:],
            "dry_run": self.dry,
            "deadline_s": self.args.deadline,
            "elapsed_s": time.perf_counter() - self.t0,
            "complete": complete,
            "rows": [asdict(r) for r in self.rows],
            "data": self.data,
        }
        text = json.dumps(doc, indent=1, default=_plain)
        atomic_write(self.out, lambda f: f.write(text + "\n"), mode="w")
        table = self.table()
        atomic_write(self.out_dir / TABLE_NAME, lambda f: f.write(table + "\n"), mode="w")

    def table(self) -> str:
        head = ("section", "item", "value", "bound", "verdict")
        lines = [(r.section, r.item, clip(r.text, 96), r.bound, r.verdict) for r in self.rows]
        widths = [max(len(x[i]) for x in [head, *lines]) for i in range(5)]
        fmt = " | ".join(f"{{:{w}}}" for w in widths)
        rule = "-+-".join("-" * w for w in widths)
        return "\n".join([fmt.format(*head), rule, *(fmt.format(*x).rstrip() for x in lines)])


def _plain(v: Any) -> Any:
    """JSON-able: tensors and numpy numbers to Python numbers, dtypes and the rest to text."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    if isinstance(v, np.generic | torch.Tensor) and getattr(v, "ndim", 0) == 0:
        return v.item()
    return str(v)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def one_line(e: BaseException) -> str:
    return clip(f"{type(e).__name__}: {' '.join(str(e).split())}", 300)
