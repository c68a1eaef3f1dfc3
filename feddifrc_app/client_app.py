"""ClientApp: thin handlers. config -> data -> teacher targets -> train -> reply.

Message types:
- ``query.setup``: who am I (partition id, size, label counts, teacher identity) and, once,
  the sufficient statistics of my pooled teacher features for the federated PCA basis.
- ``train``: CE (+ TDCL + NDCR) local training of the received global model.
- ``evaluate``: accuracy of the received model on my partition (only if fraction-evaluate > 0).
"""

from __future__ import annotations

import logging
import time
import zlib

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from feddifrc_app.config import Config, NodeConfig, load_config, load_node_config
from feddifrc_app.dataset import client_split, make_loader
from feddifrc_app.diffusion.projection import Basis, client_stats, stats_to_arrays
from feddifrc_app.model import build_model, load_weights
from feddifrc_app.diffusion.cache import CacheStats, teacher_prompts
from feddifrc_app.diffusion.pipeline import teacher_identity
from feddifrc_app.targets import build_targets, client_basis, conditioned_targets, pooled_features
from feddifrc_app.train import evaluate as evaluate_model
from feddifrc_app.train import resolve_device, train_local

log = logging.getLogger("flwr.feddifrc")  # shows up in `flwr run --stream`
app = ClientApp()


def _context(context: Context) -> tuple[Config, NodeConfig]:
    return load_config(context.run_config), load_node_config(context.node_config)


def _seed(cfg: Config, rnd: int, node: NodeConfig) -> int:
    # One stream per (run seed, round, node data): augmentation, shuffling and negative sampling
    # repeat exactly when a run is resumed. Nodes with their own data-dir are told apart by it.
    who = node.partition_id if node.partition_id is not None else zlib.crc32(node.data_dir.encode())
    return (cfg.seed * 1_000_003 + rnd * 9_176 + who) % (2**31)


def _pooled(cfg: Config, node: NodeConfig, data, ids) -> tuple[dict[int, np.ndarray], tuple[str, ...], CacheStats]:
    prompts = teacher_prompts(cfg, data.class_names)
    pooled, stats = pooled_features(cfg, node.resolve_cache_dir(cfg), data, ids, prompts)
    return pooled, prompts, stats


@app.query("setup")
def setup(msg: Message, context: Context) -> Message:
    cfg, node = _context(context)
    data, ids = client_split(cfg, node)
    counts = np.bincount(data.labels[ids], minlength=data.num_classes)
    info = ConfigRecord({
        "partition-id": -1 if node.partition_id is None else node.partition_id,
        "num-partitions": 0 if node.num_partitions is None else node.num_partitions,
        "num-examples": int(len(ids)),
        "label-counts": [int(c) for c in counts],
    })
    content = RecordDict({"info": info})
    if cfg.uses_diffusion:
        t = teacher_identity(cfg.diffusion.model, node.resolve_cache_dir(cfg))  # no SD load
        info["teacher-model"] = t.model_id
        info["teacher-random-weights"] = bool(t.random_weights)
    if bool(msg.content["config"]["want-stats"]):
        pooled, _, stats = _pooled(cfg, node, data, ids)
        arrays = stats_to_arrays(client_stats(pooled))
        content["pca-stats"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        info["teacher-seconds"] = float(stats.seconds)
        info["teacher-cache-misses"] = int(stats.misses)
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, node = _context(context)
    rnd = int(msg.content["config"]["server-round"])
    data, ids = client_split(cfg, node)
    if cfg.uses_diffusion and cfg.diffusion.projection == "federated-pca" and "basis" not in msg.content:
        # Fail before touching the teacher: extracting features for nothing would waste minutes.
        raise ValueError("diffusion.projection = 'federated-pca' but the server sent no basis")
    seed = _seed(cfg, rnd, node)
    torch.manual_seed(seed)
    device = resolve_device(cfg.train.device)

    model = build_model(cfg.model_name, data.num_classes, cfg.model_width)
    load_weights(model, msg.content["arrays"].to_torch_state_dict())

    metrics: dict[str, float] = {}
    targets = None
    if cfg.uses_diffusion:
        t0 = time.perf_counter()
        pooled, prompts, stats = _pooled(cfg, node, data, ids)
        server_basis = (Basis.from_arrays({k: v.numpy() for k, v in msg.content["basis"].items()})
                        if "basis" in msg.content else None)
        basis = client_basis(cfg, pooled, server_basis)
        k = data.num_classes if cfg.method == "feddifrc" else len(prompts) - 1
        targets = build_targets(cfg, pooled, ids, basis, k)
        if cfg.diffusion.condition == "global-model":
            targets, cost = conditioned_targets(cfg, node.resolve_cache_dir(cfg), model, data, ids, prompts,
                                                basis, targets, device)
            metrics["condition-seconds"] = cost
        metrics["teacher-seconds"] = time.perf_counter() - t0
        metrics["teacher-cache-misses"] = float(stats.misses)

    momentum = None
    if cfg.train.keep_momentum and "momentum" in context.state:
        momentum = context.state["momentum"].to_torch_state_dict()
    loader = make_loader(data, ids, train=True, batch_size=cfg.train.batch_size, seed=seed,
                         num_workers=cfg.dataset.num_workers, augment=cfg.train.augment)
    mu = float(msg.content["config"].get("proximal-mu", 0.0))
    train_metrics, buffers = train_local(model, loader, cfg, device, targets=targets, proximal_mu=mu,
                                         momentum_state=momentum, seed=seed)
    metrics.update(train_metrics)
    if cfg.train.keep_momentum and buffers:
        context.state["momentum"] = ArrayRecord(buffers)

    state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    metrics["num-examples"] = float(len(ids))
    content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg, node = _context(context)
    data, ids = client_split(cfg, node)
    model = build_model(cfg.model_name, data.num_classes, cfg.model_width)
    load_weights(model, msg.content["arrays"].to_torch_state_dict())
    loader = make_loader(data, ids, train=False, batch_size=cfg.train.eval_batch_size, seed=cfg.seed)
    m = evaluate_model(model, loader, resolve_device(cfg.train.device))
    content = RecordDict({"metrics": MetricRecord({"eval-loss": m["loss"], "eval-accuracy": m["accuracy"],
                                                    "num-examples": float(len(ids))})})
    return Message(content, reply_to=msg)
