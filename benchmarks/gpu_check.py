"""One-shot GPU check: what a bare GPU host can tell about this app in about nine minutes.

    python benchmarks/gpu_check.py --out DIR       # on a CUDA host (docs/gpu-check.md)
    python benchmarks/gpu_check.py --dry-run       # anywhere: every section small, on the CPU

A. environment, matmul and copy ceilings, device resolution in a process given no GPU;
B. the tiny teachers of every family through ``load_teacher`` in float32/16/bfloat16: agreement
   (bounded by the same model's error on the CPU), the fast path against the plain one, a dtype
   audit of every component;
C. the four full-size denoisers (SD-2.1, SDXL, PixArt-XL-2-512, SD3-medium; random weights built
   on the device in the dtypes ``diffusion.dtype = "auto"`` picks, stand-in prompt embeddings of
   the real shapes) through the real Featurizer: images/s, TFLOP/s, peak memory, GPU-busy
   fraction and attention kernels per batch size;
D. the text encoders' memory (CLIP-H, CLIP-L, bigG, T5-XXL) and GPU memory per actor;
E. the feature cache's write stall; F. the training step with 0 and 4 loader workers;
G. one FedDifRC round in Flower's deployment engine on loopback, no Ray (its own time share);
H. two co-resident processes sharing the GPU; I. (``--simulation``) a Flower simulation.

Each section runs in its own try/except (an exception is that section's FAIL, the run goes on);
a section whose module is not installed (diffusers, torchvision, flwr, ...) is a SKIP row naming
it, and so is a section the internal deadline leaves no time for. ``--out`` is a folder: the
JSON (``gpu-check.json``) and the full table (``gpu-check-table.txt``), rewritten atomically
after every section, and G's Flower logs; what is printed last is a compact summary that fits in
10,000 characters. In a dry run a bound that only a GPU can meet reads ``n/a``. Exit status 1 if
a row FAILed, 2 without CUDA (and without ``--dry-run``) or for a bad argument, else 0.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # the deadline counts from here: imports are part of the nine minutes

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import tomllib  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a bare GPU host runs the checkout without installing it
    sys.path.insert(1, str(ROOT))

import featurizer as fb  # noqa: E402  (the sibling benchmarks: benchmarks/ is sys.path[0])
import full_size as fs  # noqa: E402
import gpu_check_dtypes as gd  # noqa: E402
import gpu_check_flower as gf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gpu_check_dtypes import rel_l2  # noqa: E402
from gpu_check_summary import JSON_NAME, TABLE_NAME, summary  # noqa: E402

from feddifrc_app.config import DEFAULT_CACHE_DIR  # noqa: E402
from feddifrc_app.files import atomic_write  # noqa: E402
from feddifrc_app.tools.cmd_common import CLIError, one_line_errors  # noqa: E402

DEADLINE_S = 530.0
PROMPTS = tuple(f"a photo of a {d}" for d in fb.DIGITS) + ("",)  # 10 class prompts + the NDCR one
TINY_MODELS = ("tiny", "tiny-mnist", "tiny-sdxl", "tiny-pixart", "tiny-sd3")
H200_MATMUL_TFLOPS = (
    790.0  # bf16 8192^3, the figure the images/s bounds are drawn from (section A measures it)
)
GB = 1e9  # card sizes are quoted in GB
CONTEXT_BYTES = 0.6 * GB  # a CUDA context and the allocator's slack, per process
ATTENTION_FAST = ("flash", "fmha", "cudnn", "efficient")


# --------------------------------------------------------------------------- rows and the run


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
        self.add(item, _one_line(e), bound="no exception", verdict="FAIL")

    # ---- output

    def save(self, complete: bool = False) -> None:
        doc = {
            "format": "feddifrc-gpu-check",
            "version": 1,
            "started": self.started,
            "argv": sys.argv[1:],
            "dry_run": self.dry,
            "deadline_s": self.args.deadline,
            "elapsed_s": time.perf_counter() - T0,
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
        lines = [(r.section, r.item, _clip(r.text, 96), r.bound, r.verdict) for r in self.rows]
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


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _one_line(e: BaseException) -> str:
    return _clip(f"{type(e).__name__}: {' '.join(str(e).split())}", 300)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls after ``warmup`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def images(n: int, seed: int, size: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def finite(*outs: dict[int, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for out in outs for v in out.values())


def make_featurizer(teacher, resolution: int, fast: bool = True):
    """The app's Featurizer over the family's default layers (t = 300, one draw, seed 0)."""
    from feddifrc_app.diffusion.featurizer import Featurizer

    n = len(getattr(teacher.unet, teacher.adapter.LAYER_ATTR))
    blocks = teacher.adapter.default_layers(n)
    return Featurizer(
        teacher, resolution=resolution, timestep=300, blocks=blocks, ensemble=1, seed=0, fast=fast
    )


def stand_in_featurizer(teacher, resolution: int, fast: bool = True, seed: int = 0):
    """A Featurizer whose prompt memo already holds stand-in embeddings for ``PROMPTS``: the call
    then runs the real path (encode, noise, denoiser, pooling, D2H) without a text encoder."""
    feat = make_featurizer(teacher, resolution, fast)
    feat._prompts[PROMPTS] = fs.stand_in(teacher, len(PROMPTS), seed=seed)
    return feat


def profiled(fn, device: torch.device):
    """(profile, wall seconds) of one ``fn()`` call."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    return prof, wall


def kernel_seconds(prof) -> dict[str, float]:
    """Device seconds per CUDA kernel name ({} without CUDA activity)."""
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    events = prof.key_averages()
    for e in events:
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0:
            out[e.key] = out.get(e.key, 0.0) + e.self_device_time_total / 1e6
    if not out:  # a layout without kernel rows: the self device time of the ops that launched them
        out = {e.key: e.self_device_time_total / 1e6 for e in events if e.self_device_time_total > 0}
    return out


def attention_ops(prof) -> list[str]:
    """The scaled-dot-product-attention implementations the profile ran (aten op names)."""
    return sorted({e.key for e in prof.key_averages() if "_scaled_dot_product" in e.key})


# --------------------------------------------------------------------------- A


def section_a(c: Check) -> None:
    """Versions, device, the bf16 matmul and copy ceilings, device resolution without a GPU."""
    c.add("torch", torch.__version__, f"{torch.__version__} (CUDA {torch.version.cuda})")
    names = ("diffusers", "transformers", "accelerate", "torchvision", "requests", "flwr", "ray")
    pkgs = {p: _version(p) for p in names}
    c.add("packages", pkgs, ", ".join(f"{k} {v}" for k, v in pkgs.items()))
    c.data["A"] = {"packages": pkgs}
    if c.cuda:
        p = torch.cuda.get_device_properties(c.device)
        cap = torch.cuda.get_device_capability(c.device)
        c.add("device", p.name, f"{p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
        c.judge("capability", list(cap), cap == (9, 0), "(9, 0): H100 / H200", str(cap), warn=True)
        n, dtype, copy_bytes = 8192, torch.bfloat16, 4 * 2**30
    else:
        c.add(
            "device", "cpu", f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads (dry run)"
        )
        n, dtype, copy_bytes = 512, torch.float32, 64 * 2**20
    c.data["A"]["matmul_tflops"] = tflops = _matmul_tflops(n, dtype, c.device)
    what = f"matmul {n}^3 {str(dtype).removeprefix('torch.')}"
    c.judge(what, tflops, tflops >= 600, ">= 600 TFLOP/s", f"{tflops:.1f} TFLOP/s (median of 10)", gpu=True)
    gbps = _copy_gbps(copy_bytes, c.device)
    c.add(f"copy {copy_bytes / 2**30:g} GiB on the device", gbps, f"{gbps:.0f} GB/s read + write")
    _device_resolution(c)


def _matmul_tflops(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / statistics.median(timed(lambda: a @ b, device, warmup=3, reps=10)) / 1e12


def _copy_gbps(nbytes: int, device: torch.device) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / statistics.median(timed(lambda: y.copy_(x), device, warmup=2, reps=5)) / 1e9


def _version(name: str) -> str:
    """The installed version of an importable package, else "absent"."""
    try:
        if importlib.util.find_spec(name) is None:
            return "absent"
    except ImportError:
        return "absent"
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "present"


_RESOLVE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from feddifrc_app.device import DeviceError, resolve_device
out = {"auto": str(resolve_device("auto"))}
try:
    out["cuda"] = "no error: " + str(resolve_device("cuda"))
except DeviceError as e:
    out["cuda"] = "DeviceError: " + str(e)
print(json.dumps(out))
"""


def _device_resolution(c: Check) -> None:
    """In a process given no GPU (CUDA_VISIBLE_DEVICES=""): auto -> cpu with the reason logged,
    cuda -> DeviceError naming Ray (how a ClientApp gets a GPU), or the CPU-only torch build."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    p = subprocess.run([sys.executable, "-c", _RESOLVE], env=env, capture_output=True, text=True, timeout=300)
    try:
        got = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"the device-resolution process failed: {_clip(p.stderr.strip(), 300)}") from None
    logged = next((ln for ln in p.stderr.splitlines() if "runs on the CPU" in ln), "")
    c.judge(
        "no GPU: resolve_device('auto')",
        got["auto"],
        got["auto"] == "cpu" and "CUDA_VISIBLE_DEVICES" in logged,
        "cpu, the reason logged",
        f"{got['auto']}; logged: {_clip(logged, 70) or 'nothing'}",
    )
    want = "Ray" if torch.version.cuda else "CPU-only build"
    ok = got["cuda"].startswith("DeviceError") and want in got["cuda"]
    c.judge(
        "no GPU: resolve_device('cuda')",
        got["cuda"],
        ok,
        f"DeviceError naming {want}",
        _clip(got["cuda"], 90),
    )


# --------------------------------------------------------------------------- B


def section_b(c: Check) -> None:
    """The tiny teachers through the real ``load_teacher`` in float32 / float16 / bfloat16."""
    from feddifrc_app.diffusion.pipeline import load_teacher, teacher_resolution
    from feddifrc_app.diffusion.tiny import TINY_RESOLUTION

    n = 4 if c.dry else 16
    x, ids = images(n, seed=1), torch.arange(n)
    c.data["B"] = {}
    for model in TINY_MODELS:
        if not c.time_for(25, model):
            continue
        res = teacher_resolution(model, c.cache_dir) or TINY_RESOLUTION

        def feats(device: torch.device, dtype: torch.dtype, fast=True, k=n, model=model, res=res):
            t = load_teacher(model, c.cache_dir, device, dtype)
            return t, make_featurizer(t, res, fast)(x[:k], ids[:k], PROMPTS)

        _, ref = feats(c.device, torch.float32)
        _, plain = feats(c.device, torch.float32, fast=False)
        out: dict[torch.dtype, dict] = {}
        for dtype in (torch.float16, torch.bfloat16):
            t, out[dtype] = feats(c.device, dtype)
            gd.audit(c, model, t)
        ok = finite(ref, plain, *out.values())
        c.judge(f"{model}: all finite", ok, ok, "fp32, fp16, bf16, plain")
        own = gd.cpu_errors(c, model, feats, ref)
        row: dict[str, Any] = {"cpu": own}
        for dtype, floor in ((torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
            row[gd.name(dtype)] = gd.judge_rounding(c, model, dtype, rel_l2(out[dtype], ref), floor, own)
        row["fast_vs_plain"] = rfp = rel_l2(ref, plain)
        bound = gd.rounding_bound(1e-4, own.get("cuda_vs_cpu"))
        c.judge(f"{model}: fast vs plain, fp32", rfp, rfp <= bound, f"<= {bound:.1e}", f"{rfp:.2e}")
        c.data["B"][model] = row


# --------------------------------------------------------------------------- C


def _ips_bound(f: fs.Family) -> float:
    """images/s at 25% of the H200's bf16 matmul ceiling, from the estimated GFLOP per image."""
    return 0.25 * H200_MATMUL_TFLOPS * 1e3 / f.gflop


def section_c(c: Check) -> None:
    """The full-size denoisers: speed, memory, busy fraction and kernels at several batch sizes."""
    c.data["C"] = {}
    for fam, f in fs.FAMILIES.items():
        if not c.time_for(35, f"{f.label}: full-size denoiser"):
            continue
        try:
            _family_speed(c, fam, f)
        except ModuleNotFoundError:
            raise
        except Exception as e:  # one family's failure (an OOM) leaves the others to run
            c.fail(f"{f.label}: full-size denoiser", e)
        finally:
            free_memory()


def _family_speed(c: Check, fam: str, f: fs.Family) -> None:
    res = 64 if c.dry else 224
    sizes = (1, 2) if c.dry else ((8, 32, 64, 128) if fam == "sd" else (8, 32, 64))
    extra_b = 2 if c.dry else 32
    reps = 1 if c.dry else 3
    d: dict[str, Any] = {"per_b": {}}
    c.data["C"][fam] = d
    teacher = _build(c, fam, f, d)
    feat = stand_in_featurizer(teacher, res)
    x, ids = images(max(sizes), seed=2), torch.arange(max(sizes))
    from torch.utils.flop_counter import FlopCounterMode

    b0 = sizes[0]
    with FlopCounterMode(display=False) as fc:
        feat(x[:b0], ids[:b0], PROMPTS)
    d["gflop_per_image"] = gflop = fc.get_total_flops() / b0 / 1e9
    est = "" if c.dry else f"estimate {f.gflop:,.0f}"
    c.add(f"{f.label}: GFLOP per image", gflop, f"{gflop:,.1f} at {res} px, {len(PROMPTS)} prompts", est)
    outs = {}
    for b in sizes:
        if not c.time_for(10, f"{f.label}: B={b}"):
            break
        try:
            outs[b], d["per_b"][b] = _speed_at(c, feat, x[:b], ids[:b], reps, gflop)
        except torch.OutOfMemoryError:
            c.add(f"{f.label}: B={b}", "out of memory", verdict="WARN")
            break
        r, ceiling = d["per_b"][b], c.data.get("A", {}).get("matmul_tflops")
        share = f" ({100 * r['tflops'] / ceiling:.0f}% of the matmul ceiling)" if ceiling else ""
        mem = f", peak {r['peak_bytes'] / GB:.1f} GB" if c.cuda else ""
        c.add(f"{f.label}: B={b}", r["ips"], f"{r['ips']:.1f} img/s, {r['tflops']:.2f} TFLOP/s{share}{mem}")
    if not d["per_b"]:
        return
    best = max(d["per_b"], key=lambda b: d["per_b"][b]["ips"])
    d["best_b"], ips = best, d["per_b"][best]["ips"]
    bound = _ips_bound(f)
    c.judge(
        f"{f.label}: images/s at best B={best}", ips, ips >= bound, f">= {bound:.0f}", f"{ips:.1f}", gpu=True
    )
    ok = finite(*outs.values())
    c.judge(f"{f.label}: outputs finite", ok, ok, "finite (random weights: WARN only)", warn=True)
    _profile(c, f, feat, x[:best], ids[:best], d)
    if fam in ("sd", "sdxl") and c.time_for(15, f"{f.label}: fast vs plain"):
        _fast_vs_plain(c, f, teacher, feat, x[:extra_b], ids[:extra_b], reps, d)
    if fam in ("sd", "sd3") and c.time_for(20, f"{f.label}: another dtype"):
        teacher = _other_dtype(c, fam, f, teacher, feat, x, ids, res, reps, d)
        feat = stand_in_featurizer(teacher, res)
    if fam == "sd" and c.time_for(30, "SD-2.1: cudnn.benchmark and channels_last"):
        _layout_ab(c, teacher, feat, x[:extra_b], ids[:extra_b], reps, d)


def _build(c: Check, fam: str, f: fs.Family, d: dict) -> Any:
    """The random full-size teacher on the device in the dtypes ``diffusion.dtype = "auto"``
    picks there (``gd.app_dtypes``: bfloat16 for SDXL and SD3 on Hopper, SDXL's VAE in float32
    under float16); its parameters against the published count (on the meta device in a dry run,
    where the model is shrunk)."""
    dtype, vae = gd.app_dtypes(fam, c.device, f.vae)
    d["dtype"], d["vae_dtype"] = gd.name(dtype), gd.name(vae)
    c.add(f"{f.label}: dtype", d["dtype"], f"{d['dtype']}, VAE {d['vae_dtype']} (diffusion.dtype = auto)")
    t0 = time.perf_counter()
    teacher = fs.teacher(fam, c.device, dtype, small=c.dry, vae_dtype=vae)
    d["build_s"] = time.perf_counter() - t0
    params = fs.count_params(fam) if c.dry else sum(p.numel() for p in teacher.unet.parameters())
    c.judge(
        f"{f.label}: parameters", params, params == fs.PARAMS[fam], f"= {fs.PARAMS[fam]:,}", f"{params:,}"
    )
    d["weights_bytes"] = sum(
        p.numel() * p.element_size() for m in (teacher.unet, teacher.vae) for p in m.parameters()
    )
    return teacher


def _fast_vs_plain(c: Check, f: fs.Family, teacher, feat, xb, ib, reps: int, d: dict) -> None:
    plain = stand_in_featurizer(teacher, feat.resolution, fast=False)
    rel = rel_l2(feat(xb, ib, PROMPTS), plain(xb, ib, PROMPTS))
    fast_s, plain_s = (
        statistics.median(timed(lambda m=m: m(xb, ib, PROMPTS), c.device, 0, reps)) for m in (feat, plain)
    )
    d["fast_vs_plain"] = {"rel_l2": rel, "speedup": plain_s / fast_s}
    text = f"{rel:.2e}; the fast path {plain_s / fast_s:.2f}x the plain one's speed at B={len(xb)}"
    c.judge(f"{f.label}: fast vs plain", rel, rel <= 3e-2, "<= 3e-2", text)


def _speed_at(c: Check, feat, x, ids, reps: int, gflop: float) -> tuple[dict, dict[str, Any]]:
    """(features, {ips, tflops, peak_bytes}) of ``reps`` calls on the batch ``x`` after a warm-up."""
    if c.cuda:
        torch.cuda.reset_peak_memory_stats(c.device)
    feat(x, ids, PROMPTS)  # warm-up: kernels, the allocator
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = feat(x, ids, PROMPTS)  # ends with the copy to the host: synchronous
        walls.append(time.perf_counter() - t0)
    ips = len(x) / statistics.median(walls)
    peak = torch.cuda.max_memory_allocated(c.device) if c.cuda else None
    return out, {"ips": ips, "tflops": ips * gflop / 1e3, "peak_bytes": peak}


def _profile(c: Check, f: fs.Family, feat, x, ids, d: dict) -> None:
    """One profiled call: GPU-busy fraction (kernel time / wall), top kernels, attention kernels."""
    prof, wall = profiled(lambda: feat(x, ids, PROMPTS), c.device)
    kernels = kernel_seconds(prof)
    ops = attention_ops(prof)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    d["profile"] = {"wall_s": wall, "top_kernels": top, "attention_ops": ops}
    attn_kernels = sorted(k for k in kernels if any(w in k.lower() for w in (*ATTENTION_FAST, "attention")))
    d["profile"]["attention_kernels"] = attn_kernels
    if c.cuda:
        busy = sum(kernels.values()) / wall
        d["profile"]["busy"] = busy
        c.judge(
            f"{f.label}: GPU busy at B={len(x)}",
            busy,
            busy >= 0.9,
            ">= 0.9 (below: launch-bound)",
            f"{busy:.2f}",
            warn=True,
        )
        c.add(
            f"{f.label}: top kernels", top, "; ".join(f"{_clip(k, 40)} {1e3 * s:.1f} ms" for k, s in top[:3])
        )
    names = " ".join([*ops, *attn_kernels]).lower()
    fast = any(w in names for w in ATTENTION_FAST)
    math = "attention_math" in names
    c.judge(
        f"{f.label}: attention",
        {"ops": ops, "kernels": attn_kernels},
        fast and not math,
        "flash / fmha / cudnn / efficient, no math path",
        ", ".join(ops + attn_kernels[:2]) or "no SDPA op seen",
        gpu=True,
    )


def _other_dtype(c: Check, fam: str, f: fs.Family, teacher, feat, x, ids, res: int, reps: int, d: dict):
    """SD against float32 at B=8 (float16's error); SD3 in the other half-precision dtype than
    the app's (float16 where it picks bfloat16: its speed and distance); a dry run compares
    float32 with bfloat16. Returns the teacher back in its own dtypes."""
    own, own_vae = teacher.dtype, teacher.vae.dtype
    half = torch.float16 if own == torch.bfloat16 else torch.bfloat16
    other = torch.bfloat16 if c.dry else (torch.float32 if fam == "sd" else half)
    b = 1 if c.dry else (8 if fam == "sd" else 32)
    xb, ib = x[:b], ids[:b]
    base = feat(xb, ib, PROMPTS)
    base_s = statistics.median(timed(lambda: feat(xb, ib, PROMPTS), c.device, 0, reps))
    t2 = fs.recast(teacher, other, gd.vae_dtype_for(fam, other, f.vae))
    f2 = stand_in_featurizer(t2, res)
    got = f2(xb, ib, PROMPTS)
    other_s = statistics.median(timed(lambda: f2(xb, ib, PROMPTS), c.device, 1, reps))
    rel = rel_l2(base, got) if gd.reference_first(other, own) else rel_l2(got, base)  # vs the more precise
    a, o = gd.name(own), gd.name(other)
    d["other_dtype"] = {"dtype": o, "rel_l2": rel, "speed_ratio": base_s / other_s, "finite": finite(got)}
    text = f"{rel:.2e}; {o} runs at {base_s / other_s:.2f}x the speed of {a} (B={b}); finite: {finite(got)}"
    item = f"{f.label}: {a} vs {o}"
    if fam == "sd" and other == torch.float32:
        c.judge(item, rel, rel <= 2e-2, "<= 2e-2", text)
    else:
        c.add(item, rel, text, "report")
    return fs.recast(t2, own, own_vae)


def _layout_ab(c: Check, teacher, feat, x, ids, reps: int, d: dict) -> None:
    """Speed with cudnn.benchmark, and with channels_last UNet and VAE, each against the default."""

    def speed() -> float:
        return len(x) / statistics.median(timed(lambda: feat(x, ids, PROMPTS), c.device, 1, reps))

    base = speed()
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        bench = speed()
    finally:
        torch.backends.cudnn.benchmark = was
    for m in (teacher.unet, teacher.vae):
        m.to(memory_format=torch.channels_last)
    try:
        cl = speed()
    finally:
        for m in (teacher.unet, teacher.vae):
            m.to(memory_format=torch.contiguous_format)
    d["layout"] = {"base_ips": base, "cudnn_benchmark": bench / base, "channels_last": cl / base}
    c.add(
        "SD-2.1: cudnn.benchmark",
        bench / base,
        f"{bench / base:.2f}x ({bench:.1f} img/s at B={len(x)})",
        "report",
    )
    c.add("SD-2.1: channels_last", cl / base, f"{cl / base:.2f}x ({cl:.1f} img/s at B={len(x)})", "report")


# --------------------------------------------------------------------------- D


def section_d(c: Check) -> None:
    """Each text encoder's memory and one 11-prompt encode; then GPU memory per actor and family."""
    weights: dict[str, float] = {}
    d: dict[str, Any] = {"encoders": {}, "actors": {}}
    c.data["D"] = d
    for name in fs.TEXT_ENCODERS:
        if not c.time_for(20, name):
            continue
        weights[name], ms = _encoder_cost(c, name)
        d["encoders"][name] = {"bytes": weights[name], "encode_ms": ms}
        how = "allocated" if c.cuda else "parameter bytes of the shrunk model"
        enc = ", ".join(f"{v:.1f} ms at {k} tokens" for k, v in ms.items())
        c.add(name, weights[name], f"{weights[name] / GB:.3f} GB {how}; 11 prompts: {enc}")
        free_memory()
    for fam, f in fs.FAMILIES.items():
        _actor_memory(c, fam, f, weights, d)


def _encoder_cost(c: Check, name: str) -> tuple[float, dict[int, float]]:
    """(bytes the encoder holds, ms of one encode of ``PROMPTS`` per token length)."""
    before = torch.cuda.memory_allocated(c.device) if c.cuda else 0
    m = fs.text_encoder(name, c.device, c.dtype, small=c.dry)
    if c.cuda:
        held = torch.cuda.memory_allocated(c.device) - before
    else:
        held = sum(p.numel() * p.element_size() for p in m.parameters())
    ms = {}
    for n_tok in (120, 256) if name.startswith("t5") else (77,):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, int(m.config.vocab_size), (len(PROMPTS), n_tok), generator=g).to(c.device)
        with torch.inference_mode():
            ms[n_tok] = 1e3 * statistics.median(timed(lambda ids=ids: m(input_ids=ids), c.device, 1, 3))
    return held, ms


def _actor_memory(c: Check, fam: str, f: fs.Family, weights: dict[str, float], d: dict) -> None:
    """Denoiser + VAE + activations (section C's peak at its best B) + the family's text encoders
    + a CUDA context; how many such actors fit a 141, 80 and 24 GB card."""
    cd = c.data.get("C", {}).get(fam, {})
    missing = [t for t in f.texts if t not in weights]
    if "best_b" not in cd or missing:
        c.add(f"{f.label}: memory per actor", "n/a", f"not measured (C: {'best_b' in cd}; missing {missing})")
        return
    b = cd["best_b"]
    peak = cd["per_b"][b]["peak_bytes"] if c.cuda else cd["weights_bytes"]  # no activation peak on a CPU
    texts = sum(weights[t] for t in f.texts)
    actor = peak + texts + CONTEXT_BYTES
    no_t5 = actor - weights["t5-xxl"] if "t5-xxl" in f.texts else None
    fits = {gb: int(gb * GB // actor) for gb in (141, 80, 24)}
    d["actors"][fam] = {"b": b, "bytes": actor, "without_t5_bytes": no_t5, "fit": fits}
    text = f"{actor / GB:.1f} GB at B={b}"
    text += f" ({no_t5 / GB:.1f} GB without T5 resident)" if no_t5 is not None else ""
    text += "; actors per 141/80/24 GB: " + "/".join(str(v) for v in fits.values())
    c.judge(f"{f.label}: memory per actor", actor, actor <= 70 * GB, "<= 70 GB (2 per H200)", text, gpu=True)


# --------------------------------------------------------------------------- E


def section_e(c: Check) -> None:
    """SD-2.1 through ``cached_pooled_features``: how long extraction waits for the cache writer."""
    from feddifrc_app.diffusion.cache import LazyExtractor, cached_pooled_features
    from feddifrc_app.diffusion.shards import FeatureStore, key_fields, key_from_fields

    b, n, chunk, res = (2, 32, 8, 64) if c.dry else (32, 1024, 256, 224)
    teacher = fs.teacher("sd", c.device, c.dtype, small=c.dry)
    feat = stand_in_featurizer(teacher, res)
    base = images(64, seed=3)
    fields = key_fields(
        weights_hash=teacher.model_id,
        resolution=res,
        timestep=feat.timestep,
        blocks=feat.blocks,
        prompts=PROMPTS,
        seed=feat.seed,
        ensemble=1,
        dataset_fingerprint="gpu-check",
        dtype=str(c.dtype),
    )
    key = key_from_fields(fields)
    feat(base[:b], torch.arange(b), PROMPTS)  # warm-up
    c.data["E"] = {}
    with tempfile.TemporaryDirectory(prefix="feddifrc-gpu-check-") as tmp:
        store = FeatureStore(Path(tmp) / "features")
        for name, ids in (
            ("scattered ids (every 10th)", np.arange(n) * 10),
            ("contiguous ids", np.arange(n) + 10 * n),
        ):
            ex = LazyExtractor(lambda: feat, lambda sub: base[torch.as_tensor(sub) % len(base)], PROMPTS, b)
            _, s = cached_pooled_features(store, key, ids, ex, chunk=chunk)
            frac = s.stall_seconds / s.seconds
            c.data["E"][name] = {
                "seconds": s.seconds,
                "extract_seconds": s.extract_seconds,
                "write_seconds": s.write_seconds,
                "stall_seconds": s.stall_seconds,
            }
            text = (
                f"{100 * frac:.1f}% stalled ({s.stall_seconds:.2f} of {s.seconds:.1f} s; extract "
                f"{s.extract_seconds:.1f} s, writes {s.write_seconds:.2f} s; {n} images at B={b})"
            )
            c.judge(f"cache stall, {name}", frac, frac <= 0.05, "<= 5% of the wall time", text, gpu=True)


# --------------------------------------------------------------------------- F


def paper_config(conf: str = "conf/cifar10-nid1-a0.5-feddifrc.toml") -> dict[str, Any]:
    """The paper cell's flat run config: pyproject's defaults updated with the conf file, read
    with tomllib (flwr's ``app_defaults`` is not on a bare host)."""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return flat(defaults) | flat(tomllib.loads((ROOT / conf).read_text()))


def section_f(c: Check) -> None:
    """``train_local`` of the paper cell on synthetic CIFAR-sized data with random teacher targets."""
    import torchvision  # noqa: F401  the loader's transforms: a SKIP naming it when absent

    from feddifrc_app.config import load_config
    from feddifrc_app.data.images import ImageData
    from feddifrc_app.data.loader import make_loader
    from feddifrc_app.data.sources.hub import CIFAR10_STATS
    from feddifrc_app.methods import Node
    from feddifrc_app.methods.feddifrc.local import FedDifRC
    from feddifrc_app.methods.feddifrc.targets import TeacherTargets
    from feddifrc_app.model import build_model
    from feddifrc_app.train import train_local

    n = 64 if c.dry else 5000
    flat = paper_config() | {"train.device": c.device.type, "train.local-epochs": 1}
    if c.dry:
        flat |= {"model.width": 8, "diffusion.channels": "32,16,16", "train.batch-size": 16}
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g).numpy().astype(np.int64)
    data = ImageData(
        name="cifar10",
        split="train",
        images=images(n, seed=4),
        labels=labels,
        class_names=[f"class {i}" for i in range(10)],
        fingerprint="gpu-check-synthetic",
        mean=CIFAR10_STATS[0],
        std=CIFAR10_STATS[1],
    )
    cfg = load_config(flat)
    dim = cfg.embedding_dim
    targets = TeacherTargets(
        rows=torch.arange(n),
        prompt_reps=torch.randn(n, 10, dim, generator=g),
        ndcr=torch.randn(n, dim, generator=g),
    )
    model = build_model(cfg.model.name, 10, cfg.model.width)
    d: dict[str, Any] = {}
    c.data["F"] = d
    for workers in (0, 4):
        if not c.time_for(25, f"training, {workers} loader workers"):
            continue
        cfg = load_config(flat | {"dataset.num-workers": workers})
        loader = make_loader(
            data,
            np.arange(n),
            train=True,
            batch_size=cfg.train.batch_size,
            seed=0,
            num_workers=workers,
            augment=cfg.train.augment,
            pin_memory=c.cuda,  # as the ClientApp's training loader (client_app.py): on a CUDA device
        )

        def epoch(seed: int, cfg=cfg, loader=loader) -> dict[str, float]:
            half = FedDifRC(Node(cfg, data, np.arange(n), c.device, seed), targets=targets)
            return train_local(model, loader, cfg, c.device, halves=[half])[0]

        epoch(0)  # warm-up: kernels, the allocator, the optimiser's first step
        if c.cuda:
            torch.cuda.reset_peak_memory_stats(c.device)
        sync(c.device)
        t0 = time.perf_counter()
        steps = epoch(1)["local-steps"]
        sync(c.device)
        sps = steps / (time.perf_counter() - t0)
        prof, wall = profiled(lambda: epoch(2), c.device)
        busy = sum(kernel_seconds(prof).values()) / wall if c.cuda else None
        peak = torch.cuda.max_memory_allocated(c.device) if c.cuda else None
        d[workers] = {"steps": steps, "steps_per_s": sps, "busy": busy, "peak_bytes": peak}
        more = f", GPU busy {busy:.2f}, peak {peak / GB:.2f} GB" if c.cuda else ""
        text = f"{sps:.1f} steps/s ({int(steps)} steps of {cfg.train.batch_size}){more}"
        if workers == 0:
            c.judge(
                "steps/s, 0 loader workers", sps, sps >= 60, ">= 60 (a client-round <= 13 s)", text, gpu=True
            )
        else:
            c.add(f"steps/s, {workers} loader workers", sps, text)
    if 0 in d and 4 in d:
        ratio = d[4]["steps_per_s"] / d[0]["steps_per_s"]
        c.add("4 workers / 0 workers", ratio, f"{ratio:.2f}x", "report: decides num-workers and pin_memory")


# --------------------------------------------------------------------------- H


def _actor(k: int, dry: bool, b: int, seconds: float, barrier, queue) -> None:
    """One co-resident 'actor' (a spawned process): build SD-2.1, extract at batch ``b`` for
    ``seconds`` once both are ready; puts {images, seconds, peak_bytes} or {error}."""
    try:
        if dry:
            torch.set_num_threads(1)
        device = torch.device("cpu" if dry else "cuda")
        teacher = fs.teacher("sd", device, torch.float32 if dry else torch.float16, small=dry, seed=k)
        feat = stand_in_featurizer(teacher, 64 if dry else 224)
        x, ids = images(b, seed=10 + k), torch.arange(b)
        feat(x, ids, PROMPTS)  # warm-up
        if not dry:
            torch.cuda.reset_peak_memory_stats(device)
        barrier.wait(timeout=600)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            feat(x, ids, PROMPTS)
            n += b
        peak = None if dry else torch.cuda.max_memory_allocated(device)
        queue.put({"k": k, "images": n, "seconds": time.perf_counter() - t0, "peak_bytes": peak})
    except BaseException as e:  # noqa: BLE001 - reported by the parent, never lost
        barrier.abort()
        queue.put({"k": k, "error": _one_line(e)})


def section_h(c: Check) -> None:
    """Two spawned processes extracting on the same GPU (``client-resources-num-gpus = 0.5``)."""
    import multiprocessing as mp
    import queue as queue_mod
    import threading

    b, seconds = (2, 2.0) if c.dry else (32, 20.0)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_actor, args=(k, c.dry, b, seconds, barrier, results)) for k in range(2)]
    for p in procs:
        p.start()
    smi: list[str] = []
    timer = threading.Timer(seconds / 2, lambda: smi.append(_nvidia_smi()))  # memory in use mid-run
    try:
        try:
            barrier.wait(timeout=300)
            if c.cuda:
                timer.start()
        except threading.BrokenBarrierError:
            pass  # an actor failed: its error is in the queue
        got = []
        for _ in procs:
            try:
                got.append(results.get(timeout=seconds + 300))
            except queue_mod.Empty:
                got.append({"error": "no result (the process died)"})
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join()
        if timer.is_alive():
            timer.join(timeout=30)
    errors = [r["error"] for r in got if "error" in r]
    codes = [p.exitcode for p in procs]
    c.data["H"] = {"actors": got, "exitcodes": codes, "nvidia_smi_used_mib": smi}
    c.judge(
        "two actors ran",
        codes,
        not errors and codes == [0, 0],
        "both exit 0, no OOM",
        "; ".join(errors) or f"exit {codes}",
    )
    if errors:
        return
    total = sum(r["images"] / r["seconds"] for r in got)
    single = c.data.get("C", {}).get("sd", {}).get("per_b", {}).get(b, {}).get("ips")
    text = f"{total:.1f} img/s together" + (
        f" vs {single:.1f} alone (C, B={b})" if single else "; C has no single-process number"
    )
    c.judge(
        "two actors: summed images/s",
        total,
        bool(single) and total >= 0.9 * single,
        ">= 0.9 x one process",
        text,
        gpu=True,
    )
    if c.cuda:
        peaks = [r["peak_bytes"] / GB for r in got]
        used = f"; nvidia-smi {smi[0]} MiB used" if smi else ""
        c.add("two actors: peak memory each", peaks, " / ".join(f"{p:.1f} GB" for p in peaks) + used)


def _nvidia_smi() -> str:
    try:
        p = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return (
            p.stdout.strip().splitlines()[0]
            if p.returncode == 0
            else f"nvidia-smi failed: {p.stderr.strip()}"
        )
    except (OSError, subprocess.TimeoutExpired, IndexError) as e:
        return f"nvidia-smi unavailable ({type(e).__name__})"


# --------------------------------------------------------------------------- main

# (key, title, function, seconds it needs on a GPU: skipped with fewer left)
SECTIONS = (
    ("A", "environment and ceilings", section_a, 20),
    ("B", "tiny teachers: numerics and dtypes", section_b, 60),
    ("C", "full-size denoisers", section_c, 40),
    ("D", "text encoders and memory per actor", section_d, 40),
    ("E", "cache-write stall", section_e, 40),
    ("F", "training step", section_f, 50),
    ("G", "one Flower round, deployment engine on loopback", gf.section_deploy, 60),
    ("H", "two co-resident actors", section_h, 90),
    ("I", "Flower simulation", gf.section_simulation, 150),
)
# A section's own time share on a GPU: held back from the sections before it, so that C's batch
# sizes cannot use up the Flower round's time (G runs before the optional H and I).
RESERVED = {"G": gf.DEPLOY_SHARE_S}


def run_section(c: Check, key: str, title: str, fn, need_s: float) -> None:
    c.section = key
    print(f"\n== {key}. {title} ({max(c.left(), 0):.0f} s left)", flush=True)
    t0 = time.perf_counter()
    try:
        if c.time_for(need_s, title):
            fn(c)
    except ModuleNotFoundError as e:
        c.skip(title, f"needs {e.name}, which is not installed here")
    except Exception as e:
        c.fail(title, e)
    finally:
        free_memory()
        c.data.setdefault(key, {})["seconds"] = time.perf_counter() - t0
        c.save()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every section small, on the CPU")
    ap.add_argument(
        "--deadline", type=float, default=DEADLINE_S, help="seconds; sections that cannot finish are skipped"
    )
    ap.add_argument(
        "--out",
        default="gpu-check",
        help=f"a folder: {JSON_NAME} and {TABLE_NAME} (rewritten after every section), flower-logs/",
    )
    ap.add_argument(
        "--cache-dir", default=DEFAULT_CACHE_DIR, help="where the tiny teachers are built / found"
    )
    ap.add_argument("--sections", default="ABCDEFGHI", help="which sections to run (letters)")
    ap.add_argument(
        "--simulation", action="store_true", help="I: a 2-round Flower simulation (needs flwr and ray)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    return ap.parse_args(argv)


@one_line_errors("benchmarks/gpu_check.py")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():  # found before any section, not at the first save
        raise CLIError(f"--out {args.out} is a file; --out names a folder (for {JSON_NAME}, {TABLE_NAME})")
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.dry_run and not torch.cuda.is_available():
        from feddifrc_app.device import no_cuda_reason

        print(f"no CUDA device: {no_cuda_reason()}; --dry-run checks the script on a CPU")
        return 2
    c = Check(args, t0=T0)
    print(f"GPU check{' (dry run, CPU)' if c.dry else ''}: deadline {args.deadline:.0f} s, into {c.out_dir}")
    chosen = [s for s in SECTIONS if s[0] in args.sections.upper()]
    for i, (key, title, fn, need) in enumerate(chosen):
        c.reserved = sum(RESERVED.get(later[0], 0.0) for later in chosen[i + 1 :])
        run_section(c, key, title, fn, need)
    c.section = "-"
    c.save(complete=True)
    head = f"== summary ({time.perf_counter() - T0:.0f} s; all rows: {c.out_dir / TABLE_NAME}; JSON: {c.out})"
    print("\n" + summary(c.rows, head), flush=True)
    return 1 if any(r.verdict == "FAIL" for r in c.rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
