"""benchmarks/gpu_check.py and its full-size configs (benchmarks/full_size.py).

The dry run is the GPU check's own test on a CPU: every section small, all four families, and
run in a process where the packages a bare GPU host lacks (flwr, ray, ...) cannot be imported,
as on that host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import full_size as fs  # noqa: E402
import gpu_check  # noqa: E402

from feddifrc_app.config import load_config  # noqa: E402

# What a bare GPU host does not have (GPU-CHECK's host: torch, transformers, accelerate, diffusers).
ABSENT = (
    "flwr",
    "flwr_datasets",
    "ray",
    "mlxtend",
    "dp_accounting",
    "sklearn",
    "scipy",
    "datasets",
    "matplotlib",
)

# Every meta-path finder answers "not here" for ABSENT, as when the package is not installed (a
# finder that raised instead would break the libraries that probe for optional packages).
_SITECUSTOMIZE = f"""
import sys
ABSENT = {ABSENT!r}

class _Hidden:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        find = getattr(self.inner, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

sys.meta_path[:] = [_Hidden(f) for f in sys.meta_path]
"""


def test_full_size_parameter_counts_are_the_published_ones() -> None:
    """Counted on the meta device: SD-2.1 UNet 865.9 M, SDXL 2.567 B, PixArt-XL-2 0.611 B, SD3-medium
    2.028 B, OpenCLIP bigG 694.7 M, T5-XXL encoder 4.762 B."""
    published = {
        "sd": 0.8659,
        "sdxl": 2.5675,
        "pixart": 0.6109,
        "sd3": 2.0283,
        "clip-bigg": 0.6947,
        "t5-xxl": 4.7623,
    }
    for part, billions in published.items():
        n = fs.count_params(part)
        assert n == fs.PARAMS[part], part
        assert round(n / 1e9, 4) == billions, part


def test_stand_in_embeddings_have_the_real_shapes() -> None:
    """The full-size teachers (on meta) and their stand-in prompt embeddings for 11 prompts."""
    want = {
        "sd": {"tokens": (11, 77, 1024)},
        "sdxl": {"tokens": (11, 77, 2048), "text_embeds": (11, 1280), "time_ids": (11, 6)},
        "pixart": {"tokens": (11, 120, 4096), "encoder_attention_mask": (11, 120)},
        "sd3": {"tokens": (11, 333, 4096), "pooled_projections": (11, 2048)},
    }
    meta = torch.device("meta")
    for fam, shapes in want.items():
        t = fs.teacher(fam, meta, torch.float16)
        cond = fs.stand_in(t, 11)
        got = {"tokens": tuple(cond.tokens.shape)} | {k: tuple(v.shape) for k, v in cond.extras.items()}
        assert got == shapes, fam
        assert cond.tokens.dtype == torch.float16
        assert all(p.device == meta for m in (t.unet, t.vae) for p in [*m.parameters(), *m.buffers()]), fam
        assert t.vae_scale_factor == 8 and t.latent_channels == (16 if fam == "sd3" else 4)
    sdxl = fs.teacher("sdxl", torch.device("cpu"), torch.float32, small=True)
    assert fs.stand_in(sdxl, 3).extras["time_ids"].tolist() == [[224.0, 224.0, 0.0, 0.0, 224.0, 224.0]] * 3
    pixart = fs.teacher("pixart", torch.device("cpu"), torch.float32, small=True)
    assert fs.stand_in(pixart, 2).extras["encoder_attention_mask"].sum(dim=1).tolist() == [8, 8]
    small = fs.teacher(
        "sd3", torch.device("cpu"), torch.float32, small=True
    )  # the dry run's: still 16 channels
    assert (small.vae_scale_factor, small.latent_channels) == (8, 16)


@pytest.mark.slow  # about 35 CPU-seconds; 1.5-2 minutes on 2 cores shared with other work
def test_dry_run_covers_every_section_and_family_without_flower(tmp_path: Path, teacher_cache: Path) -> None:
    """``--dry-run`` (with H asked for) in a process where flwr, ray, ... are not importable: exit 0,
    every section has rows and no FAIL, all four families and five tiny teachers appear, F (the run
    config's rules import no Flower) trains, H is a SKIP naming flwr, and the JSON and the closing
    table hold the same rows."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(_SITECUSTOMIZE))
    out = tmp_path / "gpu-check.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    # No internal deadline here: on a busy machine it would skip sections and fail the test by
    # timing (the deadline itself: test_deadline_skips_what_is_left_and_still_writes_the_file).
    argv = [
        "--dry-run",
        "--simulation",
        "--deadline",
        "1e6",
        "--threads",
        "1",
        "--cache-dir",
        str(teacher_cache),
        "--out",
        str(out),
    ]
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["dry_run"]
    rows = doc["rows"]
    by_section: dict[str, list[dict]] = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
    assert sorted(by_section) == list("ABCDEFGH")
    assert not [r for r in rows if r["verdict"] == "FAIL"]
    for s in "ABCDEFG":  # ran, not skipped
        assert [r for r in by_section[s] if r["verdict"] != "SKIP"], s
    items = {(r["section"], r["item"]): r for r in rows}
    # the blocker held in this process, and H says what it lacks
    packages = items[("A", "packages")]["value"]
    assert packages["flwr"] == packages["ray"] == "absent" and packages["diffusers"] != "absent"
    (h,) = by_section["H"]
    assert h["verdict"] == "SKIP" and h["value"] == "needs flwr, which is not installed here"
    assert items[("A", "no GPU: resolve_device('cuda')")]["verdict"] == "PASS"
    for model in gpu_check.TINY_MODELS:
        assert items[("B", f"{model}: fast vs plain, fp32")]["verdict"] == "PASS"
        assert items[("B", f"{model}: all finite")]["value"] is True
    assert items[("B", "tiny-pixart float16: T5 wo")]["value"] == "torch.float32"
    # SDXL's VAE in fp16 with force_upcast is a WARN until it encodes in fp32
    sdxl16 = items[("B", "tiny-sdxl float16: dtypes")]
    assert sdxl16["value"]["force_upcast"] is True
    assert sdxl16["verdict"] == ("WARN" if sdxl16["value"]["components"]["vae"] == "fp16" else "-")
    for f in fs.FAMILIES.values():
        assert items[("C", f"{f.label}: parameters")]["verdict"] == "PASS"
        (best,) = [r for r in by_section["C"] if r["item"].startswith(f"{f.label}: images/s at best B=")]
        assert best["verdict"] == "n/a" and best["value"] > 0  # a GPU bound
        assert items[("D", f"{f.label}: memory per actor")]["verdict"] == "n/a"
        assert doc["data"]["C"][f.name]["per_b"]["2"]["ips"] > 0
    assert {k for k in doc["data"]["D"]["encoders"]} == set(fs.TEXT_ENCODERS)
    assert items[("F", "4 workers / 0 workers")]["value"] > 0
    assert items[("G", "two actors ran")]["value"] == [0, 0]
    # the closing table: one line per row, after its header
    table = p.stdout.split("== summary")[1]
    header = next(ln for ln in table.splitlines() if ln.startswith("section"))
    assert [c.strip() for c in header.split("|")] == ["section", "item", "value", "bound", "verdict"]
    lines = [ln for ln in table.splitlines() if " | " in ln][1:]
    assert len(lines) == len(rows)
    assert [ln.split(" | ")[-1].strip() for ln in lines] == [r["verdict"] for r in rows]


def test_deadline_skips_what_is_left_and_still_writes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    rc = gpu_check.main(["--dry-run", "--deadline", "0", "--out", str(out), "--cache-dir", str(tmp_path)])
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["complete"]
    assert [r["section"] for r in doc["rows"]] == list("ABCDEFGH")
    assert all(r["verdict"] == "SKIP" and r["value"].startswith("deadline: 0 s left") for r in doc["rows"])


def test_a_failing_section_is_one_fail_row_and_a_missing_module_a_skip(tmp_path: Path) -> None:
    c = gpu_check.Check(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path / "c.json")]))

    def boom(c: gpu_check.Check) -> None:
        c.add("first", 1.5)
        raise ValueError("a broken\nsection")

    def needs(c: gpu_check.Check) -> None:
        import feddifrc_no_such_module  # noqa: F401

    gpu_check.run_section(c, "X", "boom", boom, 0)
    gpu_check.run_section(c, "Y", "needs", needs, 0)
    got = [(r.section, r.item, r.text, r.verdict) for r in c.rows]
    assert got == [
        ("X", "first", "1.5", "-"),
        ("X", "boom", "ValueError: a broken section", "FAIL"),
        ("Y", "needs", "needs feddifrc_no_such_module, which is not installed here", "SKIP"),
    ]
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [r["verdict"] for r in saved["rows"]] == ["-", "FAIL", "SKIP"] and not saved["complete"]


def test_gpu_bounds_read_na_in_a_dry_run_and_judge_on_a_gpu(tmp_path: Path) -> None:
    dry = gpu_check.Check(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path / "a.json")]))
    dry.judge("speed", 3.0, False, ">= 60", gpu=True)
    dry.judge("agreement", 0.1, False, "<= 1e-2")
    dry.judge("busy", 0.5, False, ">= 0.9", warn=True)
    assert [(r.verdict, r.bound) for r in dry.rows] == [
        ("n/a", ">= 60 (GPU only)"),
        ("FAIL", "<= 1e-2"),
        ("WARN", ">= 0.9"),
    ]


def test_paper_config_reads_without_flower() -> None:
    """F's run config: pyproject's defaults under the paper conf, flattened with tomllib only."""
    flat = gpu_check.paper_config()
    assert flat["dataset.name"] == "cifar10" and flat["method"] == "feddifrc"
    assert flat["train.device"] == "cuda" and flat["train.batch-size"] == 64
    cfg = load_config(flat)
    assert (cfg.model.width, cfg.diffusion.channels, cfg.train.local_epochs) == (64, (256, 128, 128), 10)
