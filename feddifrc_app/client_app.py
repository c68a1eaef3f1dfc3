"""ClientApp: thin handlers. config -> data -> method halves -> train -> reply.

Message types:
- ``query.setup``: who am I (partition id, size, label counts, platform) plus what the run's method adds
  (``methods.setup_reply``: e.g. the identity of what it runs and, when asked, statistics).
- ``train``: local training of the received global model, CE plus what the message asks of the
  node (``methods.node_halves``: the run's method's loss, terms and reply records).
- ``evaluate``: loss and accuracy of the received global model on my held-out examples
  (``evaluate-holdout`` of my data, never trained on; only sent when fraction-evaluate > 0).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from feddifrc_app import log, methods, privacy
from feddifrc_app.config import Config, NodeConfig, load_node_config
from feddifrc_app.config_loader import process_config
from feddifrc_app.data.loader import make_loader
from feddifrc_app.data.shares import client_holdout, client_split
from feddifrc_app.device import platform_info, resolve_device
from feddifrc_app.halves import Node
from feddifrc_app.metric_keys import METRICS, ORIGIN
from feddifrc_app.model import load_weights
from feddifrc_app.records import MODEL, record_to_state, state_to_record
from feddifrc_app.train import configure_torch, train_local
from feddifrc_app.train import evaluate as evaluate_model

app = ClientApp(mods=[privacy.client_mod])  # Flower's DP clipping, for a message that asks


def _arrived(msg: Message) -> float:
    """Log, at handler start, where the message's seconds went before it: this process's age (a
    deployment starts one per message: its start and imports) and the time since the server
    created the message (queues and polls; across machines, also their clocks' difference).
    Returns the handler's start (``time.perf_counter``), for the handler's own time."""
    try:  # Linux: field 22 of /proc/self/stat is the process's start, in clock ticks after boot
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(stat[19]) / os.sysconf("SC_CLK_TCK")
        age = f"{float(Path('/proc/uptime').read_text().split()[0]) - started:.2f} s"
    except (OSError, ValueError, IndexError):
        age = "unknown (no /proc)"
    waited = time.time() - msg.metadata.created_at
    log.info("%s message: process age %s, created %.2f s ago", msg.metadata.message_type, age, waited)
    return time.perf_counter()


def _context(context: Context) -> tuple[Config, NodeConfig]:
    cfg = process_config(context.run_config)
    configure_torch(cfg.train)  # every handler: its threads and kernels before any torch work
    return cfg, load_node_config(context.node_config)


def _seed(cfg: Config, rnd: int, node: NodeConfig) -> int:
    # One stream per (run seed, round, node data): augmentation, shuffling and negative sampling
    # repeat exactly when a run is resumed. Nodes with their own data-dir are told apart by it.
    who = node.partition_id if node.partition_id is not None else zlib.crc32(node.data_dir.encode())
    return (cfg.seed * 1_000_003 + rnd * 9_176 + who) % (2**31)


@app.query("setup")
def setup(msg: Message, context: Context) -> Message:
    _arrived(msg)
    cfg, node = _context(context)
    data, ids = client_split(cfg, node)
    counts = np.bincount(data.labels[ids], minlength=data.num_classes)
    info = ConfigRecord(
        {
            "partition-id": -1 if node.partition_id is None else node.partition_id,
            "num-partitions": 0 if node.num_partitions is None else node.num_partitions,
            "num-examples": int(len(ids)),
            "label-counts": [int(c) for c in counts],
            "class-names": list(data.class_names),
            # What the node's numbers are conditional on: results.json's "platforms".
            **{f"platform-{k}": v for k, v in platform_info().items()},
        }
    )
    # The node needs no training device to answer (setup trains nothing).
    member = Node(cfg, data, ids, None, cfg.seed, context.state, config=node)
    content = RecordDict({"info": info, **methods.setup_reply(msg, member, info)})
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    started = _arrived(msg)
    cfg, node = _context(context)
    data, ids = client_split(cfg, node)
    seed = _seed(cfg, int(msg.content["config"]["server-round"]), node)
    torch.manual_seed(seed)
    device = resolve_device(cfg.train.device, "train.device")
    model = methods.model_for(cfg, data.num_classes)
    load_weights(model, record_to_state(msg.content[MODEL]))

    momentum = _momentum(cfg, context)
    loader = make_loader(
        data,
        ids,
        train=True,
        batch_size=cfg.train.batch_size,
        seed=seed,
        num_workers=cfg.dataset.num_workers,
        augment=cfg.train.augment,
        pin_memory=device.type == "cuda",
    )
    # What the message asks of this node beyond plain training (the methods in methods/).
    halves = methods.node_halves(msg, Node(cfg, data, ids, device, seed, context.state, config=node))
    metrics, buffers = train_local(model, loader, cfg, device, momentum_state=momentum, halves=halves)
    metrics["num-examples"] = float(len(ids))
    if cfg.train.keep_momentum and buffers:
        context.state["momentum"] = ArrayRecord(buffers)
    extra = {k: v for h in halves for k, v in h.finish(model, metrics).items()}
    arrays = state_to_record(model.state_dict())
    log.info("train message: handled in %.2f s", time.perf_counter() - started)
    content = {MODEL: arrays, METRICS: MetricRecord(metrics), ORIGIN: origin(), **extra}
    return Message(RecordDict(content), reply_to=msg)


def origin() -> ConfigRecord:
    """Where this reply was computed: ``host`` (the machine's name) and, inside a Ray actor
    (simulation), ``ray-node``, the Ray node id, which tells apart the raylets of one host too.
    Outside Ray (a deployment's SuperNode) the key is absent: results.json writes null."""
    out = {"host": socket.gethostname()}
    # An actor has imported and initialised Ray; a deployment's ClientApp never imports it (a
    # second of its process start, for nothing).
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        out["ray-node"] = ray.get_runtime_context().get_node_id()
    return ConfigRecord(out)


def _momentum(cfg: Config, context: Context) -> dict[str, torch.Tensor] | None:
    """train.keep-momentum: the SGD momentum buffers this node kept from its last round."""
    keep = cfg.train.keep_momentum and "momentum" in context.state
    return record_to_state(context.state["momentum"]) if keep else None


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    started = _arrived(msg)
    cfg, node = _context(context)
    data, ids = client_holdout(cfg, node)
    if not len(ids):  # load_config refuses fraction-evaluate > 0 with none: a hand-made message
        raise ValueError("evaluate message, but evaluate-holdout = 0: this node holds out nothing")
    model = methods.model_for(cfg, data.num_classes)
    load_weights(model, record_to_state(msg.content[MODEL]))
    loader = make_loader(data, ids, train=False, batch_size=cfg.train.eval_batch_size, seed=cfg.seed)
    m = evaluate_model(model, loader, resolve_device(cfg.train.device, "train.device"))
    metrics = {"eval-loss": m["loss"], "eval-accuracy": m["accuracy"], "num-examples": float(len(ids))}
    log.info("evaluate message: handled in %.2f s", time.perf_counter() - started)
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
