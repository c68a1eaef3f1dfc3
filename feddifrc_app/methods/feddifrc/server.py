"""FedDifRC's server half: after the setup replies, check the nodes' teachers, fit the federated
PCA basis from their statistics (and, for ``loss.tdcl-targets = "anchors"``, the class anchors
from their per-prompt sums) and record the teacher; then send them with every train message and
keep them in every checkpoint (a resumed run continues with the checkpoint's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord, RecordDict

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.halves import ServerHalf
from feddifrc_app.methods.feddifrc.projection import (
    ANCHORS,
    BASIS,
    STATS,
    Basis,
    class_anchors,
    fit_federated_basis,
    stats_from_arrays,
)
from feddifrc_app.records import arrays_to_record, record_to_arrays
from feddifrc_app.results import Results


def _by_partition(setup: Mapping[int, RecordDict], partition_of: Mapping[int, int]) -> list[int]:
    return sorted(setup, key=lambda n: (partition_of[n], n))


def check_teachers(setup: Mapping[int, RecordDict], partition_of: Mapping[int, int]) -> None:
    """Every node's teacher has the same weights: features of different weights live in different
    spaces, so neither one PCA basis nor the comparison of their targets would mean anything."""
    weights: dict[str, list[int]] = {}
    for n in _by_partition(setup, partition_of):
        if "teacher-weights" in setup[n]["info"]:
            weights.setdefault(str(setup[n]["info"]["teacher-weights"]), []).append(partition_of[n])
    if len(weights) > 1:
        raise ValueError(
            "the nodes run different diffusion teachers (weights sha256 -> partition ids: "
            + "; ".join(f"{h[:12]} -> {p}" for h, p in weights.items())
            + "): give every node the same diffusion.model files"
        )


def federated_basis(cfg: Config, setup: Mapping[int, RecordDict], results: Results) -> Basis:
    """Fit the shared PCA basis from the nodes' sufficient statistics (counts, sums, second moments)."""
    stats = [stats_from_arrays(record_to_arrays(c[STATS])) for c in setup.values() if STATS in c]
    d = cfg.diffusion
    basis, merged = fit_federated_basis(stats, d.channels, d.blocks, cfg.embedding_dim)
    results.extra["basis"] = {
        "mode": "federated-pca",
        "fingerprint": basis.fingerprint(),
        "rows": merged[d.blocks[0]].count,
        "nodes": len(stats),
        "widths": list(basis.widths),
    }
    asked = [c for c in setup.values() if STATS in c]  # diffusion.basis-nodes: the sample only
    results.extra["setup-cache-misses"] = sum(int(c["info"]["teacher-cache-misses"]) for c in asked)
    return basis


def anchors_record(basis: Basis, setup: Mapping[int, RecordDict], results: Results) -> ArrayRecord:
    """The class anchors (K, D) from the nodes' per-prompt sums under the fitted ``basis``."""
    anchors = class_anchors([record_to_arrays(c[STATS]) for c in setup.values() if STATS in c], basis)
    results.extra["basis"]["anchors"] = {"prompts": int(anchors.shape[0]), "width": int(anchors.shape[1])}
    return arrays_to_record({ANCHORS: anchors})


def record_teacher(
    setup: Mapping[int, RecordDict], partition_of: Mapping[int, int], results: Results
) -> None:
    """Which teacher the nodes run, and where (results.json's ``teacher``)."""
    teacher = [c["info"] for c in setup.values() if "teacher-model" in c["info"]]
    if not teacher:
        return
    devices: dict[str, list[int]] = {}
    for n in _by_partition(setup, partition_of):
        devices.setdefault(str(setup[n]["info"]["teacher-device"]), []).append(partition_of[n])
    results.extra["teacher"] = recorded = {
        "model": str(teacher[0]["teacher-model"]),
        "weights-sha256": str(teacher[0]["teacher-weights"]),  # check_teachers: the same on every node
        "random-weights": bool(teacher[0]["teacher-random-weights"]),
        "devices": devices,  # "cuda float16" -> partition ids
    }
    # Partition ids up to a few dozen nodes; counts beyond (thousands of ids are no log line).
    where = devices if len(setup) <= 40 else {k: f"{len(v)} nodes" for k, v in devices.items()}
    log.info("diffusion teacher %s on %s", recorded["model"], where)
    if recorded["random-weights"]:
        log.warning(
            "the diffusion teacher has RANDOM weights: this run shows that the pipeline works "
            "(or is a control), not that FedDifRC helps"
        )


class FedDifRCServer(ServerHalf):
    """The basis (federated-pca) and the anchors (``loss.tdcl-targets = "anchors"``): fitted once
    from the setup replies, sent with every train message."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.basis: ArrayRecord | None = None
        self.anchors: ArrayRecord | None = None

    def setup_work(self) -> bool:
        # Once: a resumed run continues with the checkpoint's basis (restore).
        return self.cfg.diffusion.projection == "federated-pca" and self.basis is None

    def setup_nodes(self) -> int:
        return self.cfg.diffusion.basis_nodes

    def after_setup(
        self, setup: Mapping[int, RecordDict], partition_of: Mapping[int, int], results: Results
    ) -> None:
        check_teachers(setup, partition_of)
        if self.setup_work():
            basis = federated_basis(self.cfg, setup, results)
            self.basis = arrays_to_record(basis.to_arrays())
            if self.cfg.loss.tdcl_targets == "anchors":
                self.anchors = anchors_record(basis, setup, results)
        record_teacher(setup, partition_of, results)

    def train_records(self) -> dict[str, Any]:
        sent = {BASIS: self.basis, ANCHORS: self.anchors}
        return {k: v for k, v in sent.items() if v is not None}

    def state(self) -> dict[str, Any]:
        out = {"basis": None if self.basis is None else self.basis.to_torch_state_dict()}
        if self.anchors is not None:  # (a checkpoint without anchors keeps its old layout)
            out["anchors"] = self.anchors.to_torch_state_dict()
        return out

    def restore(self, checkpoint: Mapping[str, Any]) -> None:
        if checkpoint.get("basis") is not None:
            self.basis = ArrayRecord(checkpoint["basis"])
        if checkpoint.get("anchors") is not None:
            self.anchors = ArrayRecord(checkpoint["anchors"])
