"""A node's share of the training data, and its federated-evaluation hold-out.

``client_split`` is what a ClientApp trains on, ``client_holdout`` what it evaluates the global
model on; together they are ``node_data``: a partition of the benchmark training split
(``partition.partition_by_config``) or the node's own image folder.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from feddifrc_app.config import Config, DatasetConfig, NodeConfig, PartitionConfig
from feddifrc_app.data.holdouts import stratified_subset
from feddifrc_app.data.images import ImageData
from feddifrc_app.data.partition import partition_by_config
from feddifrc_app.data.registry import load_dataset


def client_split(cfg: Config, node: NodeConfig) -> tuple[ImageData, np.ndarray]:
    """(training data, this node's TRAINING indices into it): what a ClientApp trains on.

    The node's data (``node_data``) less its federated-evaluation hold-out
    (``evaluation_holdout`` under ``evaluate-holdout``; nothing is held out at 0, the default).
    """
    data, ids = node_data(cfg, node)
    return data, evaluation_holdout(ids, data.labels, cfg.evaluate_holdout, cfg.seed)[0]


def client_holdout(cfg: Config, node: NodeConfig) -> tuple[ImageData, np.ndarray]:
    """(training data, this node's HELD-OUT indices into it): what a ClientApp evaluates the
    global model on (federated evaluation); disjoint from ``client_split``'s, together all of
    ``node_data``'s. Empty when ``evaluate-holdout`` = 0."""
    data, ids = node_data(cfg, node)
    return data, evaluation_holdout(ids, data.labels, cfg.evaluate_holdout, cfg.seed)[1]


def evaluation_holdout(
    ids: np.ndarray, labels: np.ndarray, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, held-out ids): a node's dataset ids ``ids`` (n,) split for federated evaluation.

    ``round(fraction * n)`` of them are held out (at least 1 and at most n - 1 when
    ``fraction > 0``), stratified by ``labels[ids]`` (``stratified_subset``, ``RandomState(seed)``):
    the same ids, labels and seed give the same split in every process. Both parts keep the
    order of ``ids``. ``fraction = 0``: (``ids``, empty). ``ValueError`` (naming the key and the
    node's count) when fewer than 2 examples would be left to train on (BatchNorm's minimum).
    """
    ids = np.asarray(ids, dtype=np.int64)
    if fraction == 0:
        return ids, ids[:0]
    n = len(ids)
    k = min(max(int(round(fraction * n)), 1), max(n - 1, 1))  # at least one each way, if it can
    if n - k < 2:
        raise ValueError(
            f"evaluate-holdout = {fraction:g} holds out {k} of this node's {n} example(s), leaving "
            f"{n - k} to train on where BatchNorm needs at least 2; lower evaluate-holdout"
        )
    held = np.zeros(n, dtype=bool)
    held[stratified_subset(np.asarray(labels)[ids], k, seed)] = True
    return ids[~held], ids[held]


def node_data(cfg: Config, node: NodeConfig) -> tuple[ImageData, np.ndarray]:
    """(training data, ALL of this node's indices into it), before any evaluation hold-out.

    - ``node.data_dir`` set: the node's OWN class-per-folder images (dataset
      ``image-folder`` at that root), all of its train split (``train/``, or the
      fixed 80% when there are no split folders). Labels follow that
      folder's sorted class folders: every node must hold the same class folders
      (an empty one is an error) or labels disagree across the federation.
    - otherwise: partition ``node.partition_id`` of ``node.num_partitions`` of the
      benchmark training split, by ``partition.partition_by_config`` (cfg.partition, cfg.seed).

    Memoised per process (the ImageData is shared: read-only), so a long-lived
    simulation actor loads and partitions once.
    """
    if node.data_dir:
        own = dataclasses.replace(cfg.dataset, name="image-folder", data_dir=node.data_dir)
        data = _load_train_cached(own, cfg.seed)
        return data, np.arange(len(data), dtype=np.int64)
    if node.partition_id is None or node.num_partitions is None:
        raise ValueError("node config has neither data-dir nor partition-id/num-partitions")
    data = _load_train_cached(cfg.dataset, cfg.seed)
    parts = _partitions_cached(cfg.dataset, cfg.partition, cfg.seed, node.num_partitions)
    return data, parts[node.partition_id].copy()


@functools.lru_cache(maxsize=2)
def _load_train_cached(cfg: DatasetConfig, seed: int) -> ImageData:
    return load_dataset(cfg, "train", seed=seed)


@functools.lru_cache(maxsize=4)
def _partitions_cached(
    dcfg: DatasetConfig, pcfg: PartitionConfig, seed: int, num_partitions: int
) -> tuple[np.ndarray, ...]:
    return tuple(partition_by_config(_load_train_cached(dcfg, seed).labels, num_partitions, pcfg, seed))
