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

This module is the CLI and the run; the sections are ``gpu_check_host`` (A), ``gpu_check_dtypes``
(B), ``gpu_check_full_size`` (C, D), ``gpu_check_node`` (E, F), ``gpu_check_flower`` (G, I) and
``gpu_check_actors`` (H), on ``gpu_check_rows`` (the rows and files) and ``gpu_check_measure``.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # the deadline counts from here: imports are part of the nine minutes

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a bare GPU host runs the checkout without installing it
    sys.path.insert(1, str(ROOT))

# The sections, one module per concept (the sibling benchmarks: benchmarks/ is sys.path[0]); none
# imports flwr, ray or diffusers at the top: a section that needs one is a SKIP naming it.
import gpu_check_flower as gf  # noqa: E402
import torch  # noqa: E402
from gpu_check_actors import section_h  # noqa: E402
from gpu_check_dtypes import section_b  # noqa: E402
from gpu_check_full_size import section_c, section_d  # noqa: E402
from gpu_check_host import section_a  # noqa: E402
from gpu_check_measure import free_memory  # noqa: E402
from gpu_check_node import section_e, section_f  # noqa: E402
from gpu_check_rows import Check  # noqa: E402
from gpu_check_summary import JSON_NAME, TABLE_NAME, summary  # noqa: E402

from feddifrc_app.config import DEFAULT_CACHE_DIR  # noqa: E402
from feddifrc_app.tools.cmd_common import CLIError, one_line_errors  # noqa: E402

DEADLINE_S = 530.0

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
