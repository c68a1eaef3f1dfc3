"""ServerApp: config -> setup exchange (node map + federated PCA) -> rounds -> results.

The round loop drives the configured Flower strategy through its own
``configure_train`` / ``aggregate_train`` API rather than ``Strategy.start`` for
three reasons Flower's loop cannot serve: (1) node sampling is seeded per round on
partition ids (Flower samples with the unseeded global ``random``), so a resumed run
repeats the uninterrupted one exactly; (2) ``resume-from`` continues the round
counter from a checkpoint; (3) failures and timeouts are recorded per round.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from feddifrc_app import report
from feddifrc_app.config import Config, load_config
from feddifrc_app.dataset import load_dataset, make_loader
from feddifrc_app.diffusion.projection import Basis, fit_basis, fused_widths, merge_client_stats, stats_from_arrays
from feddifrc_app.model import build_model, load_weights
from feddifrc_app.outputs import RunDir, write_json
from feddifrc_app.strategy import build_strategy, load_strategy_state, nodes_per_round, strategy_state
from feddifrc_app.train import embed, evaluate, linear_probe, resolve_device

# A child of Flower's logger: our lines show up in `flwr run --stream` and `flwr log`.
log = logging.getLogger("flwr.feddifrc")
app = ServerApp()

SETUP = f"{MessageType.QUERY}.setup"


# ------------------------------------------------------------------------------- records


def state_to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    # BN's num_batches_tracked is unused (momentum is set) and breaks FedOpt's float maths.
    return ArrayRecord({k: v.detach().cpu() for k, v in state.items() if not k.endswith("num_batches_tracked")})


def record_to_state(rec: ArrayRecord) -> dict[str, torch.Tensor]:
    return rec.to_torch_state_dict()


def basis_to_record(basis: Basis) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in basis.to_arrays().items()})


class _Nodes:
    """A view of the Grid that shows the strategy only the nodes our seeded sampler chose."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid, self._ids = grid, node_ids

    def get_node_ids(self) -> list[int]:
        return list(self._ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


# ------------------------------------------------------------------------------- setup


def _setup_query(grid: Grid, cfg: Config, node_ids: list[int], want_stats: bool) -> dict[int, RecordDict]:
    """Ask nodes who they are (partition id, size) and, once, for PCA sufficient statistics."""
    msgs = [
        Message(
            content=RecordDict({"config": ConfigRecord({"want-stats": want_stats})}),
            message_type=SETUP,
            dst_node_id=nid,
        )
        for nid in node_ids
    ]
    replies = grid.send_and_receive(msgs, timeout=cfg.strategy.round_timeout)
    sender = _senders(msgs)
    out: dict[int, RecordDict] = {}
    for r in replies:
        if r.has_error():
            log.warning("setup: node %s failed: %s", sender(r), r.error.reason)
        else:
            out[sender(r)] = r.content
    return out


def _senders(msgs: list[Message]):
    """reply -> the node it answers for. When a node is lost, the SuperLink itself answers with an
    error whose src_node_id is the SuperLink's, so map replies through the message they reply to."""
    dst = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}
    return lambda r: dst.get(r.metadata.reply_to_message_id, r.metadata.src_node_id)


def _wait_for_nodes(grid: Grid, cfg: Config) -> list[int]:
    deadline = time.monotonic() + cfg.strategy.round_timeout
    while True:
        ids = sorted(grid.get_node_ids())
        if len(ids) >= cfg.min_nodes or time.monotonic() > deadline:
            break
        log.info("waiting for nodes: %d connected, min-nodes = %d", len(ids), cfg.min_nodes)
        time.sleep(1.0)
    if not ids:
        raise RuntimeError(f"no SuperNode connected within strategy.round-timeout = {cfg.strategy.round_timeout}s")
    return ids


# ------------------------------------------------------------------------------- main


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = load_config(context.run_config)  # fails before any work on a bad value
    run = RunDir.for_config(cfg, context.run_id)
    device = resolve_device(cfg.train.device)
    log.info("run directory: %s", run.path)

    test = load_dataset(cfg.dataset, "test", seed=cfg.seed)
    # The training split is needed centrally only for the self-supervised linear probe.
    train_data = load_dataset(cfg.dataset, "train", seed=cfg.seed) if cfg.method == "feddifrc-ssl" else None
    test_loader = make_loader(test, np.arange(len(test)), train=False, batch_size=cfg.train.eval_batch_size, seed=cfg.seed)

    resumed = run.load_last_checkpoint() if cfg.resume_from else None
    if cfg.resume_from and resumed is None:
        raise FileNotFoundError(f"resume-from = {cfg.resume_from!r}: no readable checkpoint in {run.ckpt_dir}")
    results = (run.load_results() if resumed else None) or {
        "method": cfg.method, "strategy": cfg.strategy.name, "dataset": cfg.dataset.name,
        "partition": cfg.partition.name, "rounds": [], "resumed": [],
    }
    write_json(run.path / "config.json", cfg.to_flat())

    # ---- setup exchange: node -> partition map, and the shared basis (federated PCA) once.
    node_ids = _wait_for_nodes(grid, cfg)
    want_stats = cfg.uses_diffusion and cfg.diffusion.projection == "federated-pca" and resumed is None
    t0 = time.perf_counter()
    setup = _setup_query(grid, cfg, node_ids, want_stats)
    if not setup:
        raise RuntimeError("setup: no node answered; see the ClientApp logs")
    partition_of = {nid: int(c["info"]["partition-id"]) for nid, c in setup.items()}
    basis_rec: ArrayRecord | None = None
    if resumed is not None and resumed[1].get("basis") is not None:
        basis_rec = ArrayRecord({k: Array(v) for k, v in resumed[1]["basis"].items()})
    elif want_stats:
        # Only sufficient statistics (counts, sums, second moments) ever left the clients.
        stats = [stats_from_arrays({k: v.numpy() for k, v in c["pca-stats"].items()})
                 for c in setup.values() if "pca-stats" in c]
        merged = merge_client_stats(stats)
        blocks = cfg.diffusion.blocks
        widths = fused_widths(cfg.diffusion.channels, [merged[b].channels for b in blocks], cfg.embedding_dim)
        basis = fit_basis(merged, widths, blocks, mode="federated-pca")
        basis_rec = basis_to_record(basis)
        results["basis"] = {"mode": "federated-pca", "fingerprint": basis.fingerprint(),
                            "rows": merged[blocks[0]].count, "nodes": len(stats), "widths": list(widths)}
    results["setup-seconds"] = time.perf_counter() - t0
    if want_stats:
        results["setup-cache-misses"] = sum(int(c["info"]["teacher-cache-misses"]) for c in setup.values())
    teacher_info = [c["info"] for c in setup.values() if "teacher-model" in c["info"]]
    if teacher_info:
        results["teacher"] = {"model": str(teacher_info[0]["teacher-model"]),
                              "random-weights": bool(teacher_info[0]["teacher-random-weights"])}
        if results["teacher"]["random-weights"]:
            log.warning("the diffusion teacher has RANDOM weights: this run shows that the pipeline works "
                        "(or is a control), not that FedDifRC helps")

    # Each node reports its own label counts, so the plot also covers nodes with their own data-dir.
    order = sorted(setup, key=lambda n: (partition_of[n], n))
    counts = np.array([list(setup[n]["info"]["label-counts"]) for n in order], dtype=np.int64)
    results["label-counts"] = {str(partition_of[n]): row.tolist() for n, row in zip(order, counts)}
    report.plot_label_distribution(
        counts, test.class_names, run.path / "label_distribution.png",
        f"{cfg.dataset.name}: {cfg.partition.name} (alpha={cfg.partition.alpha}), {len(order)} clients",
    )

    # ---- model and strategy (fresh or from the checkpoint)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model_name, test.num_classes, cfg.model_width)
    strategy = build_strategy(cfg)
    start = 1
    if resumed is not None:
        last, payload = resumed
        load_weights(model, payload["model"])
        load_strategy_state(strategy, payload["strategy"])
        start = last + 1
        results["rounds"] = [r for r in results["rounds"] if r["round"] <= last]
        results["resumed"].append({"after-round": last, "run-id": context.run_id})
        log.info("resumed from %s at round %d", run.path, last)
    arrays = state_to_record(model.state_dict())

    def central_eval(rnd: int) -> dict[str, float]:
        load_weights(model, record_to_state(arrays))
        if cfg.method == "feddifrc-ssl":
            tr = make_loader(train_data, np.arange(len(train_data)), train=False,
                             batch_size=cfg.train.eval_batch_size, seed=cfg.seed)
            ftr, ytr, _ = embed(model, tr, device)
            fte, yte, _ = embed(model, test_loader, device)
            acc = linear_probe(ftr, ytr, fte, yte, epochs=cfg.ssl.probe_epochs, seed=cfg.seed)
            return {"test-accuracy": acc, "test-loss": None}
        m = evaluate(model, test_loader, device)
        return {"test-accuracy": m["accuracy"], "test-loss": m["loss"]}

    if start == 1:
        results["rounds"] = [{"round": 0, **central_eval(0)}]
        run.save_results(results)

    train_cfg = ConfigRecord({})
    for rnd in range(start, cfg.num_server_rounds + 1):
        t_round = time.perf_counter()
        # Nodes may have joined (or rejoined with a new id) since setup: learn who they are.
        current = sorted(grid.get_node_ids())
        new = [n for n in current if n not in partition_of]
        if new:
            for nid, c in _setup_query(grid, cfg, new, want_stats=False).items():
                partition_of[nid] = int(c["info"]["partition-id"])
        current = sorted((n for n in current if n in partition_of), key=lambda n: (partition_of[n], n))
        k = nodes_per_round(cfg, len(current))
        chosen = sorted(random.Random(cfg.seed * 1_000_003 + rnd).sample(current, min(k, len(current))),
                        key=lambda n: (partition_of[n], n))
        msgs = list(strategy.configure_train(rnd, arrays, train_cfg, _Nodes(grid, chosen)))
        for m in msgs:
            if basis_rec is not None:
                m.content["basis"] = basis_rec
        replies = list(grid.send_and_receive(msgs, timeout=cfg.strategy.round_timeout))
        sender = _senders(msgs)
        # Aggregate in partition order so float sums are identical across runs.
        replies.sort(key=lambda r: (partition_of.get(sender(r), 1 << 30), sender(r)))
        got = {sender(r) for r in replies}
        failures = [{"node": sender(r), "partition-id": partition_of.get(sender(r)),
                     "reason": r.error.reason} for r in replies if r.has_error()]
        failures += [{"node": n, "partition-id": partition_of[n], "reason": "no reply before round-timeout"}
                     for n in chosen if n not in got]
        ok = [r for r in replies if not r.has_error()]
        agg_arrays, agg_metrics = strategy.aggregate_train(rnd, ok) if ok else (None, None)
        if agg_arrays is not None:
            arrays = agg_arrays
        row: dict[str, Any] = {
            "round": rnd,
            "nodes": [partition_of[n] for n in chosen],
            "failures": failures,
            "train-metrics": dict(agg_metrics) if agg_metrics is not None else {},
        }
        if failures:
            log.warning("round %d: %d of %d nodes failed: %s", rnd, len(failures), len(chosen), failures)
        row.update(central_eval(rnd))
        row["seconds"] = time.perf_counter() - t_round
        results["rounds"].append(row)
        run.save_checkpoint(
            rnd,
            {"round": rnd, "model": record_to_state(arrays), "strategy": strategy_state(strategy),
             "basis": None if basis_rec is None else {k: v.numpy() for k, v in basis_rec.items()}},
            keep=cfg.keep_checkpoints,
        )
        run.save_results(results)
        report.plot_accuracy(results, run.path / "accuracy.png")
        log.info("round %d: test accuracy %.4f (%.1fs)", rnd, row["test-accuracy"], row["seconds"])
        if not ok:
            log.warning("round %d: no node returned an update; the global model is unchanged", rnd)

    s = results.get("summary", {})
    log.info("finished: final %.4f, best %.4f, mean of last 5 %.4f -> %s",
             s.get("final-accuracy") or 0, s.get("best-accuracy") or 0, s.get("mean-last-5-accuracy") or 0, run.path)
    report.plot_accuracy(results, run.path / "accuracy.png")
