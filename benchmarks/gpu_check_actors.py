"""The GPU check's section H (``benchmarks/gpu_check.py``): two spawned processes extracting
SD-2.1 features on the same GPU, as two actors with ``client-resources-num-gpus = 0.5`` do."""

from __future__ import annotations

import subprocess
import time

import full_size as fs  # the sibling benchmarks: benchmarks/ is on sys.path
import torch
from gpu_check_measure import GB, PROMPTS, images, stand_in_featurizer
from gpu_check_rows import Check, one_line


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
        queue.put({"k": k, "error": one_line(e)})


def section_h(c: Check) -> None:
    """Two spawned processes extracting on the same GPU (``client-resources-num-gpus = 0.5``)."""
    b, seconds = (2, 2.0) if c.dry else (32, 20.0)
    got, codes, smi = _run_actors(c, b, seconds)
    errors = [r["error"] for r in got if "error" in r]
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


def _run_actors(c: Check, b: int, seconds: float) -> tuple[list[dict], list[int | None], list[str]]:
    """(each actor's result, their exit codes, nvidia-smi's memory in use mid-run): both start
    extracting together, and each is joined, or terminated, whatever happens."""
    import multiprocessing as mp
    import queue as queue_mod
    import threading

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
    return got, [p.exitcode for p in procs], smi


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
