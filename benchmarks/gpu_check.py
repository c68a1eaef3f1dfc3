"""GPU check: run once on a CUDA machine; ``--dry-run`` runs every step small on any CPU.

    python benchmarks/gpu_check.py                 # on a GPU host (about 5-10 minutes)
    python benchmarks/gpu_check.py --dry-run       # anywhere: tiny teacher, CPU, float32

1. **Featurizer paths agree**: the fast path (shared-prompt attention, prefix reuse) against
   the stock diffusers modules and the public code's naive loop, with the SD-2.1 architecture
   (random weights: no download) at 224 px, in float16 and in bfloat16
   (``benchmarks/featurizer.py``).
2. **Throughput against batch size**: images/s of the SD-2.1 architecture at 224 px for each
   ``diffusion.batch-size``, its TFLOP/s (FLOPs counted by ``torch.utils.flop_counter``) and
   the fraction of the GPU's dense fp16 peak; prints the batch size to set.
3. **A 2-round simulation on the GPU**: FedDifRC on mnist-5k with the packaged teacher,
   ``train.device = diffusion.device = "cuda"`` and ``client-resources-num-gpus=0.5`` (two
   ClientApps share the GPU), through ``feddifrc sweep`` (its own local SuperLink).

Exit status 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import featurizer as fb  # the sibling benchmark: benchmarks/ is sys.path[0] when run as a script
import torch

from feddifrc_app.diffusion.featurizer import Featurizer

ROOT = Path(__file__).resolve().parents[1]

# Dense (no sparsity) fp16/bf16 tensor-core peaks, TFLOP/s, from the vendors' data sheets.
PEAK_TFLOPS = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "L4": 121, "A10": 125, "RTX 4090": 165}


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def featurizer_paths(dry: bool) -> bool:
    """Step 1: benchmarks/featurizer.py per dtype; its exit status says whether the paths agree."""
    if dry:
        runs = [["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--images", "8"]]
    else:
        base = ["--model", "sd21-random", "--resolution", "224", "--device", "cuda", "--images", "64"]
        base += ["--naive-images", "8", "--warm-cache"]
        runs = [[*base, "--dtype", dt] for dt in ("float16", "bfloat16")]
    ok = True
    for argv in runs:
        print(f"\n== featurizer {' '.join(argv)}", flush=True)
        ok &= fb.main(argv) == 0
    return ok


def throughput(dry: bool, sizes: list[int]) -> bool:
    """Step 2: images/s, TFLOP/s and the fraction of peak per diffusion batch size."""
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.float16
    cache = Path(tempfile.mkdtemp(prefix="feddifrc-gpu-check-"))
    teacher = (
        fb.load_teacher("tiny", cache, device, dtype) if dry else fb.sd21_random_teacher(cache, device, dtype)
    )
    res = 16 if dry else 224
    feat = Featurizer(teacher, resolution=res, timestep=300, blocks=(1, 2, 3), ensemble=1, seed=0)
    prompts = tuple(f"a photo of a {d}" for d in fb.DIGITS) + ("",)
    images = fb.digits_images(max(sizes))
    ids = torch.arange(len(images))
    name = "CPU" if dry else torch.cuda.get_device_name(device)
    peak = None if dry else peak_tflops(name)
    print(f"\n== throughput: {teacher.model_id} at {res} px, {len(prompts)} prompts, {dtype}, {name}")
    best = (0.0, sizes[0])
    for bs in sizes:
        x, i = images[:bs], ids[:bs]
        feat(x, i, prompts)  # warm-up: kernels, allocator
        with FlopCounterMode(display=False) as fc:
            feat(x, i, prompts)
        flops = fc.get_total_flops()
        reps = 1 if dry else 5
        fb.sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            feat(x, i, prompts)
        fb.sync(device)
        secs = (time.perf_counter() - t0) / reps
        tflops = flops / secs / 1e12
        frac = f", {100 * tflops / peak:.1f}% of the {peak} TFLOP/s peak" if peak else ""
        mem = f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if not dry else ""
        print(f"  batch {bs:4d}: {bs / secs:8.2f} images/s, {tflops:7.2f} TFLOP/s{frac}{mem}", flush=True)
        best = max(best, (bs / secs, bs))
    print(f"  fastest: diffusion.batch-size = {best[1]} ({best[0]:.1f} images/s)")
    return best[0] > 0


def simulation(dry: bool) -> bool:
    """Step 3: a 2-round FedDifRC simulation, the ClientApps on the GPU (half a GPU each)."""
    from feddifrc_app import cli

    out = Path(tempfile.mkdtemp(prefix="feddifrc-gpu-check-sim-"))
    conf = out / "gpu-check.toml"
    device = "cpu" if dry else "cuda"
    conf.write_text(
        'method = "feddifrc"\ndataset.name = "mnist-5k"\n'
        f'train.device = "{device}"\ndiffusion.device = "{device}"\n'
    )
    rounds = 1 if dry else 2
    gpus = "0" if dry else "0.5"
    argv = [
        "sweep", str(conf), "--seeds", "1", "--app", str(ROOT), "--out", str(out / "sweep"),
        "--set", f"num-server-rounds={rounds} dataset.train-limit={60 if dry else 1000}",
        "--federation-config", f"num-supernodes=2 client-resources-num-gpus={gpus}",
    ]  # fmt: skip
    print(f"\n== simulation: feddifrc sweep {' '.join(argv[1:])}", flush=True)
    return cli.main(argv) == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every step small, on the CPU, float32")
    ap.add_argument("--batch-sizes", default=None, help="comma list (default 8,16,32,64,128; dry run 1,2)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        from feddifrc_app.device import no_cuda_reason

        print(f"no CUDA device: {no_cuda_reason()}; use --dry-run to check the script on a CPU")
        return 2
    sizes = [int(s) for s in (args.batch_sizes or ("1,2" if args.dry_run else "8,16,32,64,128")).split(",")]
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); dry run: {args.dry_run}")
    results = {
        "featurizer paths agree": featurizer_paths(args.dry_run),
        "throughput measured": throughput(args.dry_run, sizes),
        "simulation completed": simulation(args.dry_run),
    }
    print("\n== summary")
    for step, ok in results.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {step}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
