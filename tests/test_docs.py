"""README.md and docs/: a short product page that starts with its two set-up commands, links
every docs page, states the quickstart the defaults really run, and holds no dated measurement
(those live in docs/evidence.md and docs/performance.md); every relative link resolves."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 160
# The two set-up commands, first in the README (.ci/run runs the second).
SETUP = (
    "pip install -e . && FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run . --stream",
    'pip install -e ".[test]" && python -m pytest -q',
)
# What the quickstart paragraph must state as `key = value`, each equal to pyproject's default.
QUICKSTART_KEYS = {
    "method",
    "strategy.name",
    "dataset.name",
    "partition.name",
    "num-server-rounds",
    "diffusion.model",
}
# Words of a dated measurement: a date, or a machine's state at the time.
DATED = re.compile(r"\b20\d\d-[01]\d\b|measured (?:on|here)|load average|this (?:VM|machine)\b", re.I)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def doc_pages() -> list[Path]:
    """docs/*.md (docs/method_effect/ holds a benchmark's outputs, not pages)."""
    return sorted(DOCS.glob("*.md"))


def relative_links(path: Path) -> list[str]:
    """The targets of the Markdown links and images outside code blocks that name a file here."""
    text = FENCE.sub("", path.read_text())
    targets = [m.group(1).split("#")[0] for m in LINK.finditer(text)]
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section."""
    body = text.split(f"\n## {title}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def app_defaults() -> dict[str, object]:
    """pyproject's [tool.flwr.app.config], flat dotted keys."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

    def flat(t: dict, prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in t.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
        return out

    return flat(table)


def test_readme_is_short_and_starts_with_the_two_setup_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    assert lines[0].startswith("# ")
    first = [x for x in lines[1:] if x.strip()][:4]
    assert first == ["```bash", *SETUP, "```"], first


def test_readme_links_every_docs_page():
    linked = {(README.parent / t).resolve() for t in relative_links(README)}
    pages = doc_pages()
    assert len(pages) >= 10
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"README.md links no {missing}"


@pytest.mark.parametrize(
    "path", [README, ROOT / "CHANGELOG.md", *doc_pages()], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_relative_link_resolves(path: Path):
    broken = [t for t in relative_links(path) if not (path.parent / t).exists()]
    assert not broken, f"{path.relative_to(ROOT)}: no {broken}"


def test_readme_quickstart_claims_are_the_defaults():
    from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

    text = section(README.read_text(), "Quickstart")
    pairs = re.findall(r"`([a-z][\w.-]*) = (\"[^\"]*\"|[\d.]+)`", text)
    claims = {k: tomllib.loads(f"v = {v}")["v"] for k, v in pairs}
    assert set(claims) >= QUICKSTART_KEYS, f"the quickstart states no {QUICKSTART_KEYS - set(claims)}"
    defaults = app_defaults()
    assert claims == {k: defaults.get(k) for k in claims}
    (nodes,) = re.findall(r"(\d+)\s+simulated\s+nodes", text)
    assert int(nodes) == DEFAULT_SIMULATION_CONFIG.num_supernodes
    (width,) = re.findall(r"width-(\d+)\s+ResNet-10", text)
    assert int(width) == defaults["model.width"]


def test_readme_quickstart_output_is_the_reference_runs_line():
    """The quickstart's log line is tests/reference/quickstart.json's, which
    scripts/quickstart_reference.py writes from a fresh default run (and --check compares with one):
    the first platform's in the log block, every other platform's named beside it."""
    import platform_refs

    refs = platform_refs.entries(ROOT / "tests" / "reference" / "quickstart.json")
    text = section(README.read_text(), "Quickstart")
    assert f"finished: {refs[0]['line']} -> " in text, refs[0]["line"]
    flat = " ".join(text.split())
    for ref in refs:
        where = ref["platform"]
        named = f"{where['cpu-kernels'].replace('AVX512', 'AVX-512')} kernels"
        assert " ".join(ref["line"].split()) in flat and named in flat, where
        assert f"torch {where['torch'].split('+')[0]}" in flat, where


def test_readme_holds_no_dated_measurement():
    found = [m.group(0) for m in DATED.finditer(README.read_text())]
    assert not found, f"dated measurements belong in docs/evidence.md or docs/performance.md: {found}"
