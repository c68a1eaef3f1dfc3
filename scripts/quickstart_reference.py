"""The README's quickstart output, from a fresh run of the default config: `flwr run .` with Flower's
default local simulation (2 nodes of 2 CPUs; Ray gives each actor OMP_NUM_THREADS=2, as on a
user's machine), a cold feature cache, the defaults of pyproject.toml.

    python scripts/quickstart_reference.py --check   # exit 1 unless the run prints this platform's line
    python scripts/quickstart_reference.py --write   # rewrite this platform's line of the reference

README.md's quickstart block quotes the reference's line: run --check after a change that may move
the numbers (any change to training, the teacher or the defaults), and --write (then copy the line
into README.md) when it is meant to. About 1.5 min on an idle 2-core machine (10 rounds, a cold
cache). The numbers hold on the CPU kernels and torch that wrote them (docs/results.md,
"Reproducibility"): the file keeps one line per platform, and --check compares with this one's
(exit 2, before any run, where it has none).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "reference" / "quickstart.json"
sys.path.insert(0, str(ROOT / "tests"))

import platform_refs  # noqa: E402


def fresh_run(work: Path) -> dict:
    """results.json of the default config, on a cold cache, in this checkout's harness."""
    from flower_procs import FlowerProcs

    out, cache = work / "runs", work / "cache"
    run_config = f"outputs-dir='{out}' run-name='quickstart' diffusion.cache-dir='{cache}'"
    with FlowerProcs(work / "flower", {"OMP_NUM_THREADS": "2"}) as procs:  # what Ray sets: 2 CPUs
        run_id = procs.submit_run(ROOT, "local", run_config=run_config, federation_config="")
        info = procs.wait_for_run(run_id, "local", timeout=3600)
        if info["status"] != "finished:completed":
            raise SystemExit(f"the run ended {info['status']}:\n{procs.run_log(run_id, 'local')[-4000:]}")
    return json.loads((out / "quickstart" / "results.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 unless the run prints this CPU's line")
    mode.add_argument("--write", action="store_true", help="rewrite this CPU's line from the run")
    args = ap.parse_args(argv)

    from feddifrc_app.device import platform_info
    from feddifrc_app.results import summary_text
    from feddifrc_app.tools.cmd_common import exit_on_termination

    here = platform_info()
    ref = None if args.write else platform_refs.entry(REFERENCE, here)
    if not args.write and ref is None:  # before the run: nothing to compare it with
        has = platform_refs.platforms(REFERENCE)
        print(f"no line for {here} in {REFERENCE.name} (it has {has}): --write adds one")
        return 2
    # The harness's close() (leaving the `with` in fresh_run) stops the SuperLink, its simulation
    # and whatever they left behind, before the folder goes: on SIGTERM / SIGHUP too.
    with exit_on_termination(), tempfile.TemporaryDirectory(prefix="quickstart-") as work:
        r = fresh_run(Path(work))
    got = {"line": summary_text(r["summary"]), "summary": r["summary"]}
    got["test-accuracy"] = [x["test-accuracy"] for x in r["rounds"]]
    if args.write:
        platform_refs.store(REFERENCE, here, got)
        print(f"written: {REFERENCE.relative_to(ROOT)} for {here}\n{got['line']}")
        return 0
    print(f"this run: {got['line']}\nreference: {ref['line']}")
    return 0 if got["line"] == ref["line"] else 1


if __name__ == "__main__":
    sys.exit(main())
