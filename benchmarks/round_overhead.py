"""What a FedDifRC round costs on a client, against a FedAvg round of the same config.

Run by hand (not a test), e.g.

    python benchmarks/round_overhead.py                                   # digits, 10 partitions
    python benchmarks/round_overhead.py --partitions 2 --rounds 7 --local-epochs 10
    python benchmarks/round_overhead.py --dataset cifar10 --image-size 32 --train-limit 5000 --profile

Acceptance criterion: with a WARM feature cache, a FedDifRC round costs at most 1.3x a
FedAvg round of the same config.

``--scale paper`` measures the CIFAR-10 paper cell's client instead, on this CPU: one
4,500-image client (10 IID partitions of a random-pixel CIFAR-10 in the real
``cifar-10-batches-py`` format, after the default ``dataset.val-fraction = 0.1`` is held
out) at 32 px, ResNet-10 at the paper width, and a feature cache
with SD-2.1's block widths (1280/640/320) and 11 prompts for all 50,000 training images
(2.5 GB), filled through the real FeatureStore with random pooled features; no teacher runs.
Bound: 1.1x, and FedDifRC's peak RSS at most FedAvg's + 1 GB (sampled every 20 ms during
each method's rounds; the setup exchange is reported on its own). It also times what a
deployment pays on every round instead (a new ClientApp process per message): a NEW process
preparing the trained client's targets through the train handler's own code, after this
process has prepared them once (``fresh-process targets: X s``; bound 0.5 s: it should load
the prepared file from ``<cache>/targets/``, not re-read and re-fuse the 2.5 GB of shards).

In one process, through the real ClientApp (``feddifrc_app.client_app.app``) with real
Flower ``Message``/``Context`` objects, exactly as a SuperNode calls it:

1. warm-up: a ``query.setup`` with ``want-stats`` on every partition (fills the on-disk
   feature cache, as ``feddifrc extract`` would) and the federated-PCA basis from their
   statistics, as the ServerApp does;
2. K rounds of ``train`` messages for each method, INTERLEAVED round by round (order
   alternating), same seed, partitions, initial weights and config; ``method`` is the
   only difference. One round = the train handler of every chosen partition, one after
   the other (what one machine does in simulation);
3. prints the per-round medians, the ratio, and the split the handler reports
   (``teacher-seconds``: cache read + basis + fusion; ``train-seconds``: the local
   epochs with their losses). ``--profile`` adds a cProfile of one FedDifRC round.

Every FedDifRC round must read all its features from the cache (``teacher-cache-misses``
is 0), i.e. no Stable Diffusion work is timed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from bench_env import work_folder  # the sibling benchmarks: benchmarks/ is on sys.path
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from round_overhead_paper import fill_paper_cache, fresh_process_targets, fresh_targets_child, paper_scale

from feddifrc_app.config import load_node_config
from feddifrc_app.config_loader import load_config
from feddifrc_app.data.shares import client_split
from feddifrc_app.halves import SETUP_WORK
from feddifrc_app.methods.feddifrc.projection import fit_federated_basis, stats_from_arrays
from feddifrc_app.model import build_model
from feddifrc_app.tools.cmd_common import one_line_errors
from feddifrc_app.tools.run_config import app_defaults

ROOT = Path(__file__).resolve().parents[1]

METHODS = ("fedavg", "feddifrc")


def run_config(**overrides: Any) -> dict[str, Any]:
    """pyproject.toml's [tool.flwr.app.config] with dotted-key overrides."""
    rc = app_defaults(ROOT)
    for k, v in overrides.items():
        if k not in rc:
            raise KeyError(f"unknown run-config key {k!r}")
        rc[k] = v
    return rc


def blas_threads() -> str:
    """numpy's BLAS library and thread count: its idle worker threads spin after each call and
    compete with torch's on a small machine (see the report of this benchmark)."""
    try:
        from threadpoolctl import threadpool_info

        libs = [
            f"{i.get('internal_api')} x{i.get('num_threads')}"
            for i in threadpool_info()
            if i.get("user_api") == "blas"
            and "numpy" in str(i.get("filepath", "")) + str(i.get("prefix", ""))
        ]
        return ", ".join(libs) or "unknown"
    except Exception:  # threadpoolctl missing or confused: informational only
        return "unknown"


class PeakRSS:
    """Peak resident memory of this process per phase, sampled from /proc every 20 ms."""

    def __init__(self) -> None:
        self.phase, self.peaks = "start", {}
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while True:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.now())
            time.sleep(0.02)


def handle(msg: Message, ctx: Context) -> Message:
    from feddifrc_app.client_app import app

    reply = app(msg, ctx)
    if reply.has_error():
        raise RuntimeError(f"{msg.metadata.message_type} failed: {reply.error.reason}")
    return reply


def setup(ctxs: list[Context], cfg) -> ArrayRecord:
    """The ServerApp's setup exchange: per-node PCA statistics (cache filled) -> shared basis."""
    from feddifrc_app.records import arrays_to_record

    stats = []
    for pid, ctx in enumerate(ctxs):
        m = Message(
            RecordDict({"config": ConfigRecord({SETUP_WORK: True})}),
            message_type="query.setup",
            dst_node_id=pid + 1,
        )
        r = handle(m, ctx)
        info = r.content["info"]
        print(
            f"  setup partition {pid}: {info['num-examples']} images, teacher "
            f"{info.get('teacher-seconds', 0.0):.1f}s, {info.get('teacher-cache-misses', 0)} cache misses"
        )
        stats.append(stats_from_arrays({k: v.numpy() for k, v in r.content["pca-stats"].items()}))
    d = cfg.diffusion
    basis, _ = fit_federated_basis(stats, d.channels, d.blocks, cfg.embedding_dim)
    return arrays_to_record(basis.to_arrays())


def train_round(
    ctxs: list[Context], pids: list[int], arrays: ArrayRecord, rnd: int, basis: ArrayRecord | None
) -> tuple[float, dict[str, float]]:
    """One round: the train handler of every chosen partition in turn. (seconds, summed metrics)."""
    total, sums = 0.0, {}
    for pid in pids:
        content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": rnd})})
        if basis is not None:
            content["basis"] = basis
        msg = Message(content, message_type="train", dst_node_id=pid + 1)
        t0 = time.perf_counter()
        reply = handle(msg, ctxs[pid])
        total += time.perf_counter() - t0
        for k, v in reply.content["metrics"].items():
            if k in ("teacher-seconds", "train-seconds", "teacher-cache-misses", "num-examples"):
                sums[k] = sums.get(k, 0.0) + float(v)
    return total, sums


def profile_round(ctxs, pids, arrays, rnd, basis, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    train_round(ctxs, pids, arrays, rnd, basis)
    prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out).sort_stats("cumulative")
    st.print_stats(r"feddifrc_app|torch/optim|torch/nn/modules/module|torch/utils/data|flwr", top)
    print("cProfile of one FedDifRC round (cumulative time; app, optimiser, data and Flower frames):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=None, help="dataset.name (default: the app default, digits)")
    ap.add_argument("--image-size", type=int, default=None, help="dataset.image-size")
    ap.add_argument("--train-limit", type=int, default=None, help="dataset.train-limit (0 = all)")
    ap.add_argument("--partitions", type=int, default=10, help="num-partitions (clients)")
    ap.add_argument(
        "--clients",
        type=int,
        default=None,
        help="partitions trained per round (default: all); the first N partition ids",
    )
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per method")
    ap.add_argument(
        "--local-epochs", type=int, default=None, help="train.local-epochs (default: app default)"
    )
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cache-dir", default=None, help="feature cache (default: a fresh temporary folder)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other run-config override, e.g. --set loss.num-negatives=4 (repeatable)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile one more FedDifRC round")
    ap.add_argument(
        "--max-ratio", type=float, default=None, help="the bound to report against (1.3; paper 1.1)"
    )
    ap.add_argument("--scale", choices=("digits", "paper"), default="digits", help="see the module docstring")
    ap.add_argument("--fresh-targets", type=Path, default=None, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    if args.max_ratio is None:
        args.max_ratio = 1.1 if args.scale == "paper" else 1.3
    if args.scale == "paper" and args.clients is None:
        args.clients = 1  # one paper-cell client: 4,500 images
    return args


def overrides(args: argparse.Namespace, cache_dir: Path) -> dict[str, Any]:
    """The run-config keys the flags set (``--scale paper``: its data written into ``cache_dir``)."""
    over: dict[str, Any] = {"diffusion.cache-dir": str(cache_dir)}
    if args.scale == "paper":
        over.update(paper_scale(cache_dir))
    if args.dataset is not None:
        over["dataset.name"] = args.dataset
    if args.image_size is not None:
        over["dataset.image-size"] = args.image_size
    if args.train_limit is not None:
        over["dataset.train-limit"] = args.train_limit
    if args.local_epochs is not None:
        over["train.local-epochs"] = args.local_epochs
    if args.seed is not None:
        over["seed"] = args.seed
    for kv in args.set:
        k, _, v = kv.partition("=")
        over[k.strip()] = v.strip()  # load_config casts and validates
    return over


def contexts(rc: dict[str, Any], n: int) -> list[Context]:
    """One SuperNode's Context per partition, as Flower builds them for the ClientApp."""
    return [
        Context(
            run_id=1,
            node_id=p + 1,
            node_config={"partition-id": p, "num-partitions": n},
            state=RecordDict(),
            run_config=rc,
        )
        for p in range(n)
    ]


def describe(cfg, n: int, pids: list[int], cache_dir: Path) -> None:
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; numpy BLAS {blas_threads()}; "
        f"machine load (1/5/15 min) {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs"
    )
    print(
        f"config: dataset {cfg.dataset.name} {cfg.dataset.image_size}px "
        f"(train-limit {cfg.dataset.train_limit}), "
        f"{n} partitions ({cfg.partition.name}), {len(pids)} trained per round, local-epochs "
        f"{cfg.train.local_epochs}, batch {cfg.train.batch_size}, model {cfg.model.name}, seed {cfg.seed}; "
        f"teacher {cfg.diffusion.model} {cfg.diffusion.resolution}px, projection {cfg.diffusion.projection}, "
        f"TDCL {cfg.loss.tdcl_weight} NDCR {cfg.loss.ndcr_weight}; cache {cache_dir}"
    )


def warm_up(
    args: argparse.Namespace, cfg, ctxs: list[Context], pids: list[int], cache_dir: Path, rss: PeakRSS
) -> Any:
    """The feature cache filled and the federated basis (None without federated-pca)."""
    t0 = time.perf_counter()
    if args.scale == "paper":
        fill_paper_cache(cfg, cache_dir)
    rss.phase = "setup"
    print("warm-up: setup query with want-stats on every partition (fills the feature cache)")
    # Paper scale: the basis from the trained client's statistics only (setup of all 10 clients
    # would read the whole 2.5 GB cache once more and time nothing).
    who = [ctxs[p] for p in pids] if args.scale == "paper" else ctxs
    basis = setup(who, cfg) if cfg.diffusion.projection == "federated-pca" else None
    print(f"  warm-up took {time.perf_counter() - t0:.1f}s")
    return basis


def initial_arrays(cfg, ctx: Context) -> ArrayRecord:
    """The same seeded initial model for both methods."""
    from feddifrc_app.records import state_to_record

    torch.manual_seed(cfg.seed)
    data, _ = client_split(cfg, load_node_config(ctx.node_config))  # memoised: the handlers' data
    return state_to_record(build_model(cfg.model.name, data.num_classes, cfg.model.width).state_dict())


def first_rounds(ctxs: dict, pids: list[int], arrays: ArrayRecord, bases: dict, rss: PeakRSS) -> bool:
    """One untimed round each: dataset/partition caches, allocator, first-call costs, and
    FedDifRC's once-per-process preparation of the client's targets (cache read + fusion).
    False when the cache was not warm."""
    for m in METHODS:
        rss.phase = m
        first, met = train_round(ctxs[m], pids, arrays, 1, bases[m])
        print(
            f"  first {m} round (untimed): {first:.2f}s, teacher targets {met.get('teacher-seconds', 0):.2f}s"
        )
        if m == "feddifrc" and met.get("teacher-cache-misses", 0):
            print("the cache was not warm after setup: teacher work would be timed")
            return False
    return True


def timed_rounds(ctxs: dict, pids: list[int], arrays: ArrayRecord, bases: dict, rounds: int, rss: PeakRSS):
    """``rounds`` rounds of each method, interleaved, order alternating: (seconds, metrics) per method."""
    secs: dict[str, list[float]] = {m: [] for m in METHODS}
    mets: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for r in range(rounds):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        for m in order:
            rss.phase = m
            s, met = train_round(ctxs[m], pids, arrays, r + 2, bases[m])
            secs[m].append(s)
            mets[m].append(met)
    return secs, mets


def report(args: argparse.Namespace, cfg, secs: dict, mets: dict) -> float:
    """The per-round medians, their split and the ratio against the bound; returns the ratio."""
    med = {m: statistics.median(v) for m, v in secs.items()}
    ratio = med["feddifrc"] / med["fedavg"]
    per_round = [b / a for a, b in zip(secs["fedavg"], secs["feddifrc"], strict=True)]
    imgs = mets["fedavg"][0].get("num-examples", 0.0)
    for m in METHODS:
        tr = statistics.median(x.get("train-seconds", 0.0) for x in mets[m])
        te = statistics.median(x.get("teacher-seconds", 0.0) for x in mets[m])
        print(
            f"{m:9s} round: median {med[m]:.3f}s over {args.rounds} rounds "
            f"(min {min(secs[m]):.3f}, max {max(secs[m]):.3f}); of which local training {tr:.3f}s, "
            f"teacher targets {te:.3f}s, other handler work {med[m] - tr - te:.3f}s"
        )
    print(f"{imgs:.0f} training images per round x {cfg.train.local_epochs} epoch(s)")
    print(
        f"ratio FedDifRC / FedAvg round (warm cache): {ratio:.2f}x  (per round: min {min(per_round):.2f}, "
        f"median {statistics.median(per_round):.2f}, max {max(per_round):.2f}); "
        f"bound {args.max_ratio:.2f}x: {'met' if ratio <= args.max_ratio else 'NOT met'}"
    )
    return ratio


def report_memory_and_spread(rss: PeakRSS, secs: dict, mets: dict) -> None:
    """Peak RSS per phase against its bound, and notes on what the numbers' spread suggests."""
    rss.phase = "end"
    gb = {k: v / 2**30 for k, v in rss.peaks.items()}
    extra = gb["feddifrc"] - gb["fedavg"]
    print(
        f"peak RSS: setup {gb.get('setup', 0):.2f} GB; during FedAvg rounds {gb['fedavg']:.2f} GB, during "
        f"FedDifRC rounds {gb['feddifrc']:.2f} GB (+{extra:.2f} GB; bound +1 GB: "
        f"{'met' if extra <= 1 else 'NOT met'})"
    )
    if any(max(v) > 1.5 * min(v) for v in secs.values()):
        print(
            "note: round times spread widely: other processes loaded this machine during the run (2 torch "
            "threads on a shared 2-core machine stall on each other); rerun, or use --threads 1"
        )
    tr = {m: statistics.median(x.get("train-seconds", 0.0) for x in mets[m]) for m in METHODS}
    if tr["fedavg"] > 0 and tr["feddifrc"] / tr["fedavg"] > 1.10:
        print(
            f"note: FedDifRC's local epochs take {tr['feddifrc'] / tr['fedavg']:.2f}x FedAvg's, "
            "though the TDCL and "
            "NDCR terms add only a few % to a step when timed alone: numpy's BLAS threads, woken by the "
            "targets' numpy matmul, keep spinning and compete with torch's (compare OPENBLAS_NUM_THREADS=1)"
        )


def fresh_process(rc: dict[str, Any], ctx: Context, basis: Any, cache_dir: Path) -> bool:
    """The paper scale's fresh-process targets against their bound; False on a cold cache."""
    fresh = fresh_process_targets(rc, dict(ctx.node_config), basis, cache_dir)
    if fresh["teacher-cache-misses"]:
        print(
            f"the fresh process missed {fresh['teacher-cache-misses']:.0f} cached features: not a warm cache"
        )
        return False
    print(
        f"fresh-process targets: {fresh['teacher-seconds']:.2f} s (bound 0.5 s: "
        f"{'met' if fresh['teacher-seconds'] <= 0.5 else 'NOT met'}); that new process took "
        f"{fresh['process-seconds']:.1f} s in all (start, imports, dataset load: paid per message too)"
    )
    return True


def measure(args: argparse.Namespace, cache_dir: Path, rss: PeakRSS) -> int:
    rcs = {m: run_config(**overrides(args, cache_dir), method=m) for m in METHODS}
    cfg = {m: load_config(rc) for m, rc in rcs.items()}["feddifrc"]
    n = args.partitions
    pids = list(range(min(args.clients or n, n)))
    ctxs = {m: contexts(rcs[m], n) for m in METHODS}
    describe(cfg, n, pids, cache_dir)
    basis = warm_up(args, cfg, ctxs["feddifrc"], pids, cache_dir, rss)
    arrays = initial_arrays(cfg, ctxs["feddifrc"][0])
    bases = {"fedavg": None, "feddifrc": basis}
    if not first_rounds(ctxs, pids, arrays, bases, rss):
        return 1
    secs, mets = timed_rounds(ctxs, pids, arrays, bases, args.rounds, rss)
    misses = sum(x.get("teacher-cache-misses", 0) for x in mets["feddifrc"])
    if misses:
        print(f"{misses:.0f} cache misses during timed FedDifRC rounds: not a warm-cache measurement")
        return 1
    ratio = report(args, cfg, secs, mets)
    report_memory_and_spread(rss, secs, mets)
    if args.scale == "paper" and not fresh_process(
        rcs["feddifrc"], ctxs["feddifrc"][pids[0]], basis, cache_dir
    ):
        return 1
    if args.profile or ratio > args.max_ratio:
        profile_round(ctxs["feddifrc"], pids, arrays, args.rounds + 2, basis, top=40)
    return 0


@one_line_errors("benchmarks/round_overhead.py")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rss = PeakRSS()
    if args.threads:
        torch.set_num_threads(args.threads)
    TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = 1
    if args.fresh_targets is not None:
        return fresh_targets_child(args.fresh_targets)
    cache = None if args.cache_dir is None else Path(args.cache_dir).expanduser()
    with work_folder(cache, "feddifrc-round-overhead-") as cache_dir:
        return measure(args, cache_dir, rss)


if __name__ == "__main__":
    raise SystemExit(main())
