"""tests/platform_refs.py: one reference entry per platform, rewritten in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from platform_refs import entries, entry, platforms, store

AVX2 = {"torch": "2.14.1", "cpu-kernels": "AVX2", "machine": "x86_64"}
AVX512 = {"torch": "2.14.1", "cpu-kernels": "AVX512", "machine": "x86_64"}


def test_store_adds_a_platform_last_and_rewrites_one_in_place(tmp_path: Path) -> None:
    path = tmp_path / "ref" / "r.json"
    store(path, AVX2, {"line": "a"})
    store(path, AVX512, {"line": "b"})
    store(path, AVX2, {"line": "c"})  # AVX2's entry is rewritten where it stands: still first
    assert platforms(path) == [AVX2, AVX512]
    assert entry(path, AVX2) == {"line": "c"} and entry(path, AVX512) == {"line": "b"}
    assert entry(path, {**AVX2, "torch": "2.15.0"}) is None  # another torch: no entry


def test_an_old_single_entry_file_or_two_entries_for_one_platform_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"platform": AVX2, "line": "a"}))
    with pytest.raises(ValueError, match="expected a JSON list of entries"):
        entries(path)
    path.write_text(json.dumps([{"platform": AVX2, "line": "a"}, {"platform": AVX2, "line": "b"}]))
    with pytest.raises(ValueError, match="2 entries for"):
        entry(path, AVX2)
