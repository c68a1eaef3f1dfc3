"""The app's package metadata as Flower 1.42 builds it: FAB format 1 (a LICENSE file, a target
Flower version inside the flwr requirement)."""

from __future__ import annotations

import io
import zipfile

import pytest
from conftest import ROOT
from flwr.cli.build import build_fab_from_files
from flwr.supercore.fab_format_version import FabFormatMetadata


def _files(pyproject: str) -> dict:
    files = {"pyproject.toml": pyproject.encode(), "LICENSE": ROOT / "LICENSE"}
    return files | {str(p.relative_to(ROOT)): p for p in (ROOT / "feddifrc_app").rglob("*.py")}


def test_flower_builds_the_app_as_fab_format_1_with_its_license():
    text = (ROOT / "pyproject.toml").read_text()
    fab, meta = build_fab_from_files(_files(text))
    assert meta == FabFormatMetadata(
        fab_format_version=1, flwr_version_min="1.42", flwr_version_target="1.42.0"
    )
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        assert z.read("LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert (ROOT / "LICENSE").read_text().split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    # What format 1 refuses, and so this test would catch: an SPDX string instead of the file.
    spdx = text.replace('license = { file = "LICENSE" }', 'license = "Apache-2.0"')
    with pytest.raises(ValueError, match=r'requires \[project\].license to be \{ file = "LICENSE" \}'):
        build_fab_from_files(_files(spdx))
