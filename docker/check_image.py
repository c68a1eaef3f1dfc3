#!/usr/bin/env python3
"""Build-time check of the SuperExec image (docker/superexec.Dockerfile runs it after its last
pip install, so it sees the torch that stays in the image):

    python check_image.py --flwr 1.42.0 --require-cuda 1 --require-cpu 0

flwr must be the pinned version (the base image's; the app's install must not have replaced it).
--require-cuda 1: torch must be a CUDA build (the ClientApp image). --require-cpu 1: torch must be
a CPU build (a build from PyTorch's CPU index: the ServerApp image), so an index that silently
serves the CUDA wheel, several GB larger, fails the build instead of shipping it. Stdlib + torch.
"""

from __future__ import annotations

import argparse
import sys


def problems(
    flwr_version: str, want: str, torch_version: str, torch_cuda: str | None, want_flwr: str
) -> list[str]:
    """What is wrong with the installed builds (empty: nothing)."""
    out = []
    if flwr_version != want_flwr:
        out.append(f"flwr changed: {flwr_version} installed, {want_flwr} pinned")
    if want == "cuda" and not torch_cuda:
        out.append(f"a CUDA build of torch was required (REQUIRE_CUDA_TORCH=1), got {torch_version} (CPU)")
    if want == "cpu" and torch_cuda:
        out.append(
            f"a CPU build of torch was required (REQUIRE_CPU_TORCH=1), got {torch_version} "
            f"(CUDA {torch_cuda}): TORCH_INDEX_URL served a CUDA wheel"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flwr", required=True, help="the pinned flwr version")
    p.add_argument("--require-cuda", choices=("0", "1"), default="0")
    p.add_argument("--require-cpu", choices=("0", "1"), default="0")
    a = p.parse_args(argv)
    if a.require_cuda == a.require_cpu == "1":
        p.error("REQUIRE_CUDA_TORCH=1 and REQUIRE_CPU_TORCH=1 contradict each other")
    want = "cuda" if a.require_cuda == "1" else "cpu" if a.require_cpu == "1" else "any"

    import flwr
    import torch

    print("flwr", flwr.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)
    errors = problems(flwr.__version__, want, torch.__version__, torch.version.cuda, a.flwr)
    for e in errors:
        print(f"check_image.py: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
