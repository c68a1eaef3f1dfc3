"""benchmarks/gpu_check.py, its full-size configs (benchmarks/full_size.py), its dtype rules,
summary and Flower sections (benchmarks/gpu_check_*.py) and the carried wheels
(scripts/carry_wheels.py).

The dry run is the GPU check's own test on a CPU: every section small, all four families, and
run in a process where the packages a bare GPU host lacks even after the carry recipe of
docs/gpu-check.md (ray, mlxtend, dp-accounting, datasets, pytest, ...) cannot be imported, as
on that host.
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
import gpu_check_dtypes as gd  # noqa: E402
import gpu_check_node  # noqa: E402
import gpu_check_rows  # noqa: E402
import gpu_check_summary as gs  # noqa: E402

from feddifrc_app.config_loader import load_config  # noqa: E402

# What a bare GPU host lacks once the wheels of scripts/carry_wheels.py are installed (it has torch,
# torchvision, transformers, accelerate, scikit-learn; the wheels bring diffusers, flwr, matplotlib).
ABSENT = (
    "flwr_datasets",
    "ray",
    "mlxtend",
    "dp_accounting",
    "datasets",
    "pytest",  # tests/flower_procs.py, section G's launcher, runs without it
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


@pytest.mark.slow  # a real Flower deployment (G) and G's two processes: 3-5 minutes on 2 busy cores
def test_dry_run_covers_every_section_and_family_on_a_bare_host(tmp_path: Path, teacher_cache: Path) -> None:
    """``--dry-run --simulation`` in a process where what a bare host lacks after the carry recipe
    (ray, mlxtend, pytest, ...) is not importable, its Flower processes included: exit 0, every
    section has rows and no FAIL, all four families and five tiny teachers appear, F trains, G
    runs one FedDifRC round in a loopback deployment (a PASS, not a SKIP), I is a SKIP naming ray,
    ``--out`` holds the JSON and the full table, and the summary printed last fits."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(_SITECUSTOMIZE))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    # No internal deadline here: on a busy machine it would skip sections and fail the test by
    # timing (the deadline itself: test_deadline_skips_what_is_left_and_still_writes_the_file).
    argv = ["--dry-run", "--simulation", "--deadline", "1e6", "--threads", "1"]
    argv += ["--cache-dir", str(teacher_cache), "--out", str(out)]
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    doc = json.loads((out / gs.JSON_NAME).read_text())
    assert doc["complete"] and doc["dry_run"]
    rows = doc["rows"]
    by_section: dict[str, list[dict]] = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
    assert sorted(by_section) == list("ABCDEFGHI")
    assert not [r for r in rows if r["verdict"] == "FAIL"]
    for s in "ABCDEFGH":  # ran, not skipped
        assert [r for r in by_section[s] if r["verdict"] != "SKIP"], s
    items = {(r["section"], r["item"]): r for r in rows}
    # the blocker held in this process, and I says what it lacks
    packages = items[("A", "packages")]["value"]
    assert packages["ray"] == "absent" and "absent" not in (packages["diffusers"], packages["flwr"])
    (i,) = by_section["I"]
    assert i["verdict"] == "SKIP" and i["value"] == "needs ray, which is not installed here"
    assert items[("A", "no GPU: resolve_device('cuda')")]["verdict"] == "PASS"
    for model in gd.TINY_MODELS:
        assert items[("B", f"{model}: fast vs plain, fp32")]["verdict"] == "PASS"
        assert items[("B", f"{model}: all finite")]["value"] is True
    assert items[("B", "tiny-pixart float16: T5 wo")]["value"] == "torch.float32"
    # SDXL's VAE in fp16 with force_upcast is a WARN until it encodes in fp32
    sdxl16 = items[("B", "tiny-sdxl float16: dtypes")]
    assert sdxl16["value"]["force_upcast"] is True
    assert sdxl16["verdict"] == ("WARN" if sdxl16["value"]["components"]["vae"] == "fp16" else "-")
    for f in fs.FAMILIES.values():
        assert items[("C", f"{f.label}: parameters")]["verdict"] == "PASS"
        assert items[("C", f"{f.label}: dtype")]["value"] == "float32"  # "auto" on the CPU
        (best,) = [r for r in by_section["C"] if r["item"].startswith(f"{f.label}: images/s at best B=")]
        assert best["verdict"] == "n/a" and best["value"] > 0  # a GPU bound
        assert items[("D", f"{f.label}: memory per actor")]["verdict"] == "n/a"
        assert doc["data"]["C"][f.name]["per_b"]["2"]["ips"] > 0
    assert {k for k in doc["data"]["D"]["encoders"]} == set(fs.TEXT_ENCODERS)
    assert items[("F", "4 workers / 0 workers")]["value"] > 0
    # G: one round of the app in Flower's deployment engine, no Ray, both teachers on the CPU
    flower = items[("G", "one FedDifRC round, deployment engine (no Ray)")]
    assert flower["verdict"] == "PASS" and flower["value"] == "finished:completed"
    assert doc["data"]["G"]["teacher_devices"] == {"cpu float32": [0, 1]}
    assert {"superlink.log", "supernode-0.log", "supernode-1.log"} <= {
        f.name for f in (out / "flower-logs").iterdir()
    }
    assert items[("H", "two actors ran")]["value"] == [0, 0]
    # --out's table: one line per row, after its header; the summary printed last fits
    table = (out / gs.TABLE_NAME).read_text().splitlines()
    assert [c.strip() for c in table[0].split("|")] == ["section", "item", "value", "bound", "verdict"]
    assert [ln.split(" | ")[-1].strip() for ln in table[2:]] == [r["verdict"] for r in rows]
    last = p.stdout[p.stdout.rindex("== summary") :]
    assert len(last) <= gs.SUMMARY_CHARS and f"{len(rows)} rows: " in last
    assert "PASS G one FedDifRC round, deployment engine (no Ray): finished:completed" in last


def test_deadline_skips_what_is_left_and_still_writes_the_file(tmp_path: Path, capsys) -> None:
    """``--out`` is a folder (created): the JSON and the full table in it; the summary last."""
    out = tmp_path / "new" / "out"
    rc = gpu_check.main(["--dry-run", "--deadline", "0", "--out", str(out), "--cache-dir", str(tmp_path)])
    doc = json.loads((out / gs.JSON_NAME).read_text())
    assert rc == 0 and doc["complete"]
    assert [r["section"] for r in doc["rows"]] == list("ABCDEFGHI")
    assert all(r["verdict"] == "SKIP" and r["value"].startswith("deadline: 0 s left") for r in doc["rows"])
    table = (out / gs.TABLE_NAME).read_text().splitlines()
    assert table[0].split() == ["section", "|", "item", "|", "value", "|", "bound", "|", "verdict"]
    assert len(table) == 2 + len(doc["rows"])
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("SKIP I Flower simulation: deadline: 0 s left, this needs about 150 s")
    assert "9 rows: 9 SKIP" in printed[printed.rindex("== summary") :]


def test_summary_fits_what_comes_back_and_keeps_every_failure() -> None:
    """What is printed last fits in the 12,000 characters a lent GPU host sends back: 240 rows
    of long values are cut down, the FAIL, WARN and SKIP rows all stay, the rest is counted;
    2,400 rows are cut at the limit, saying so."""
    verdicts = ("PASS", "-", "n/a", "FAIL", "WARN", "SKIP")
    rows = [gpu_check_rows.Row("C", f"item {k}", 1.0, "x" * 300, "b", verdicts[k % 6]) for k in range(2400)]
    text = gs.summary(rows[:240], "== summary (1 s)")
    assert len(text) <= gs.SUMMARY_CHARS < 12_000
    kept = [ln for ln in text.splitlines() if ln[:4].strip() in verdicts]
    assert {ln[:4].strip() for ln in kept} == {"FAIL", "WARN", "SKIP"} and len(kept) == 120
    assert "(120 rows left out here: 40 PASS, 40 -, 40 n/a; all are in the table file)" in text
    few = gs.summary(rows[:6], "== summary (1 s)")  # short: every row, values up to 90 characters
    assert few.splitlines()[1] == "6 rows: 1 PASS, 1 FAIL, 1 WARN, 1 SKIP, 1 n/a, 1 -"
    assert len(few.splitlines()) == 3 + 6 and few.endswith("x" * 87 + "...")
    cut = gs.summary(rows, "== summary (1 s)")
    assert len(cut) <= gs.SUMMARY_CHARS and cut.endswith("(cut here to fit; every row is in the table file)")


def test_section_c_runs_each_family_in_the_dtypes_auto_picks(monkeypatch) -> None:
    """``diffusion.dtype = "auto"`` through the app's own rules: bfloat16 for SDXL and SD3 where
    the GPU computes it natively (Hopper), float16 otherwise, with SDXL's VAE in float32 under
    float16; float32 on the CPU."""
    import feddifrc_app.device as device

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    got = {fam: gd.app_dtypes(fam, cuda, f.vae) for fam, f in fs.FAMILIES.items()}  # no bf16 here
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    assert got == {"sd": (f16, f16), "sdxl": (f16, f32), "pixart": (f16, f16), "sd3": (f16, f16)}
    monkeypatch.setattr(device, "_cuda_bf16", lambda d: True)  # a Hopper GPU
    got = {fam: gd.app_dtypes(fam, cuda, f.vae) for fam, f in fs.FAMILIES.items()}
    assert got == {"sd": (f16, f16), "sdxl": (bf16, bf16), "pixart": (f16, f16), "sd3": (bf16, bf16)}
    assert {gd.app_dtypes(fam, cpu, f.vae) for fam, f in fs.FAMILIES.items()} == {(f32, f32)}
    t = fs.teacher("sdxl", cpu, f32, small=True, vae_dtype=torch.float64)
    assert (t.unet.dtype, t.vae.dtype) == (f32, torch.float64)
    t = fs.recast(t, bf16, f32)
    assert (t.dtype, t.unet.dtype, t.vae.dtype) == (bf16, bf16, f32)


def test_section_b_bounds_a_gpus_rounding_by_the_models_own(tmp_path: Path) -> None:
    """A GPU's bfloat16 error of 6e-2 on a model whose own bfloat16 error (on the CPU) is 3e-2 is
    rounding, not a fault: within 4x of it, it passes (the fixed 5e-2 bound failed it); 20x is
    still a FAIL. In a dry run (no CPU reference) the fixed bound is the one judged."""
    c = gpu_check.Check(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path)]))
    own = {"bfloat16": 3e-2}
    gd.judge_rounding(c, "tiny", torch.bfloat16, 6e-2, 5e-2, own)
    gd.judge_rounding(c, "tiny", torch.bfloat16, 0.6, 5e-2, own)
    gd.judge_rounding(c, "tiny", torch.float16, 3e-2, 2e-2, {})
    assert [(r.item, r.verdict, r.bound) for r in c.rows] == [
        ("tiny: bf16 vs fp32", "PASS", "<= 1.2e-01 (max(0.05, 4 x CPU bf16))"),
        ("tiny: bf16 vs fp32", "FAIL", "<= 1.2e-01 (max(0.05, 4 x CPU bf16))"),
        ("tiny: fp16 vs fp32", "FAIL", "<= 2.0e-02"),
    ]
    assert gd.rounding_bound(1e-4, 2e-3) == 8e-3 and gd.rounding_bound(1e-4, None) == 1e-4


def test_a_later_sections_share_is_held_back_on_a_gpu(tmp_path: Path) -> None:
    """G's own time: with 200 s left and 150 s held for it, a section needing 60 s is skipped."""
    c = gpu_check.Check(gpu_check.parse_args(["--out", str(tmp_path), "--deadline", "200"]))
    c.reserved = gpu_check.RESERVED["G"]
    assert not c.time_for(60, "C: a batch size")
    (row,) = c.rows
    assert row.verdict == "SKIP" and "150 s of them held for a later section" in row.text
    c.reserved = 0.0
    assert c.time_for(60, "G itself")


def test_the_flower_section_runs_the_app_on_the_device_from_the_checkout() -> None:
    """G's run config is a valid one of this app: FedDifRC on digits (scikit-learn's: no download),
    the packaged teacher by its folder (a FAB carries no weights), teacher and training on the
    device asked for; the launcher it reuses imports without pytest (checked in the dry run)."""
    import gpu_check_flower as gf

    from feddifrc_app.tools.run_config import load_app_config

    cfg = load_app_config(ROOT, [gf.deploy_run_config(Path("/tmp/o"), "cuda", dry=False)])
    assert (cfg.method, cfg.dataset.name, cfg.num_server_rounds, cfg.min_nodes) == (
        "feddifrc",
        "digits",
        1,
        2,
    )
    assert (cfg.train.device, cfg.diffusion.device) == ("cuda", "cuda")
    assert Path(cfg.diffusion.model) == gf.TEACHER and (gf.TEACHER / "feddifrc.json").is_file()
    assert gpu_check.SECTIONS[6][:2] == ("G", "one Flower round, deployment engine on loopback")
    assert str(Path(sys.executable).parent) == gf.script_path().split(os.pathsep)[0]


def test_the_carried_wheels_are_the_versions_this_app_runs() -> None:
    """scripts/carry_wheels.py pins flwr and diffusers as installed here (the versions the suite
    tests), diffusers at least pyproject's floor, and downloads without dependencies."""
    import importlib.metadata as md
    import tomllib

    sys.path.insert(0, str(ROOT / "scripts"))
    import carry_wheels as cw

    pins = dict(pin.split("==") for pin, _ in cw.CARRY)
    assert pins["flwr"] == md.version("flwr") and pins["diffusers"] == md.version("diffusers")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in deps if d.startswith("diffusers>=")).split(">=")[1]
    assert tuple(map(int, pins["diffusers"].split(".")[:2])) >= tuple(map(int, floor.split(".")))
    assert len(set(cw.names())) == len(cw.CARRY) and not {"uv", "importlib-metadata", "ray"} & set(pins)
    argv = cw.download_argv(Path("/w"), "3.11", "x86_64")
    assert {"--no-deps", "--only-binary=:all:", "manylinux_2_34_x86_64"} <= set(argv)


def test_a_failing_section_is_one_fail_row_and_a_missing_module_a_skip(tmp_path: Path) -> None:
    c = gpu_check.Check(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path / "c")]))

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
    saved = json.loads((tmp_path / "c" / gs.JSON_NAME).read_text())
    assert [r["verdict"] for r in saved["rows"]] == ["-", "FAIL", "SKIP"] and not saved["complete"]


def test_gpu_bounds_read_na_in_a_dry_run_and_judge_on_a_gpu(tmp_path: Path) -> None:
    dry = gpu_check.Check(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path)]))
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
    flat = gpu_check_node.paper_config()
    assert flat["dataset.name"] == "cifar10" and flat["method"] == "feddifrc"
    assert flat["train.device"] == "cuda" and flat["train.batch-size"] == 64
    cfg = load_config(flat)
    assert (cfg.model.width, cfg.diffusion.channels, cfg.train.local_epochs) == (64, (256, 128, 128), 10)
