"""A client's prepared (fused) teacher targets: what they are (``TeacherTargets``) and where they
are kept, so that no process re-fuses what a key can reuse.

``read_through`` is the one call a node makes. Targets are kept twice: in this process
(``PREPARED``, least recently used first out) and on disk beside the feature cache, so that a new
process (a deployment starts one per message) loads one small verified file instead of
re-reading and re-fusing every shard::

    <cache_dir>/targets/<key>.npz     key = sha256 of everything the targets depend on

A verified archive (``files.write_verified`` / ``files.read_verified``, the mechanism the
feature shards use too): ``header`` (format, version, key, n,
``members`` {name: [dtype, shape]}, sha256), ``ids`` (int64, the client's dataset ids in
order), ``prompt_reps`` float32 (n, K, D) and/or ``ndcr`` float32 (n, D), and the basis they
were fused with (``basis.*``, ``Basis.to_arrays``). ``sha256`` covers every member but the
header, in name order. A file that fails any check is logged, never used, and rewritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

import numpy as np
import torch

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.diffusion.cache import CacheStats
from feddifrc_app.files import (
    ArchiveKind,
    CorruptFile,
    array_digest,
    dead_temp_files,
    read_verified,
    write_verified,
)
from feddifrc_app.methods.feddifrc.projection import Basis, fuse_per_batch


@dataclass
class TeacherTargets:
    """Frozen diffusion targets for one client's training images.

    ``rows[i]`` is the row of dataset index ``i`` (-1 = not in this client's set).
    Supervised: ``prompt_reps`` (n, K, D) = the image under each class prompt, ``ndcr`` (n, D).
    Self-supervised: ``prompt_reps`` (n, 1 + K_neg, D) = positive prompt first, then negatives.
    ``per_batch`` is the public code's behaviour: pooled per-block features are kept and the
    PCA is refit on every batch by ``fuse_batch`` (comparison only).
    """

    rows: torch.Tensor  # int64 (max_index + 1,)
    prompt_reps: torch.Tensor | None  # float32 (n, K, D)
    ndcr: torch.Tensor | None  # float32 (n, D)
    # per-batch mode: ({block: pooled (n, P, C_b)}, widths, K) -> PCA refit on each batch
    per_batch: tuple[dict[int, np.ndarray], tuple[int, ...], int] | None = None

    @property
    def nbytes(self) -> int:
        parts = [self.rows, self.prompt_reps, self.ndcr]
        size = sum(t.numel() * t.element_size() for t in parts if t is not None)
        return size + (sum(a.nbytes for a in self.per_batch[0].values()) if self.per_batch else 0)

    def on(self, device: torch.device, ids: np.ndarray) -> TeacherTargets:
        """These targets on ``device`` for training on dataset indices ``ids`` (moved once per round,
        gathered there every step). Every id must have a row (KeyError otherwise): checked here, once,
        so that ``take`` on a GPU gathers with device-resident indices and no host sync per step."""
        self._require(torch.as_tensor(np.asarray(ids, dtype=np.int64)))
        if self.per_batch is not None:  # fused on the CPU every batch: rows stay there
            return self

        def move(t):
            return None if t is None else t.to(device)

        return TeacherTargets(move(self.rows), move(self.prompt_reps), move(self.ndcr), self.per_batch)

    def _require(self, idx: torch.Tensor) -> None:
        rows = self.rows.cpu()
        if bool((idx >= len(rows)).any()) or bool((rows[idx.clamp(max=len(rows) - 1)] < 0).any()):
            raise KeyError("a training image has no teacher target (targets built for other indices)")

    def take(self, idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(TDCL representations (B, K, D), NDCR targets (B, D)) of dataset indices ``idx`` (B,),
        on the targets' device. On the CPU ``idx`` is checked here (free); on a GPU it must be among
        the ids given to ``on``, which checked them."""
        if self.rows.device.type == "cpu":
            self._require(idx.cpu())
        r = self.rows[idx.to(self.rows.device, non_blocking=True)]
        if self.per_batch is not None:
            pooled, widths, k = self.per_batch
            fused = torch.from_numpy(fuse_per_batch({b: x[r.numpy()] for b, x in pooled.items()}, widths))
            return fused[:, :k], fused[:, -1]
        reps = None if self.prompt_reps is None else self.prompt_reps[r]
        ndcr = None if self.ndcr is None else self.ndcr[r]
        return reps, ndcr


def target_rows(ids: np.ndarray) -> torch.Tensor:
    """``TeacherTargets.rows``: dataset index -> row in the client's arrays (-1: not this client's)."""
    rows = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
    rows[torch.as_tensor(ids)] = torch.arange(len(ids))
    return rows


class _Prepared:
    """A client's static targets, kept per process and keyed by everything they are computed from.

    A simulation actor serves the same partitions round after round; without this it re-read
    the client's cached features (at CIFAR-10 scale ~2.5 GB of shards) and fused them every
    round. Least recently used entries go first once ``budget`` bytes are held. A new process
    finds them on disk instead (``read_through``).
    """

    def __init__(self, budget: int) -> None:
        self.budget, self.items = budget, OrderedDict[str, tuple[TeacherTargets, Basis | None]]()

    def get(self, key: str) -> tuple[TeacherTargets, Basis | None] | None:
        if key in self.items:
            self.items.move_to_end(key)
        return self.items.get(key)

    def put(self, key: str, value: tuple[TeacherTargets, Basis | None]) -> None:
        self.items[key] = value
        while len(self.items) > 1 and sum(t.nbytes for t, _ in self.items.values()) > self.budget:
            self.items.popitem(last=False)


PREPARED = _Prepared(budget=2 << 30)

TARGETS_FORMAT = "feddifrc-targets"
TARGETS_VERSION = 1  # bump when fusion or this layout changes: old files then stop matching any key
# Bytes of prepared-target files kept per cache folder (a paper-scale CIFAR-10 client: ~110 MB);
# the least recently used go first, the one just written always stays.
TARGETS_DISK_BUDGET = 4 << 30


def _members(targets: TeacherTargets, ids: np.ndarray, basis: Basis) -> dict[str, np.ndarray]:
    out = {"ids": ids, **basis.to_arrays()}
    if targets.prompt_reps is not None:
        out["prompt_reps"] = targets.prompt_reps.numpy()
    if targets.ndcr is not None:
        out["ndcr"] = targets.ndcr.numpy()
    return out


def _digest(members: Mapping[str, np.ndarray]) -> str:
    return array_digest((f"|{k}|", members[k]) for k in sorted(members))


# the header lists every member as {name: [dtype str, shape]}
TARGETS = ArchiveKind(TARGETS_FORMAT, TARGETS_VERSION, members=itemgetter("members"), digest=_digest)


def save_prepared(path: Path, key: str, ids: np.ndarray, targets: TeacherTargets, basis: Basis) -> None:
    """Write a client's prepared targets to ``path`` atomically (readers see the old file or this one)."""
    members = _members(targets, ids, basis)
    listed = {k: [a.dtype.str, list(a.shape)] for k, a in sorted(members.items())}
    write_verified(path, TARGETS, key, members, {"n": int(len(ids)), "members": listed})


def load_prepared(path: Path, key: str, ids: np.ndarray) -> tuple[TeacherTargets, Basis]:
    """The targets ``save_prepared`` wrote for ``key`` and ``ids``; ``CorruptFile`` (the reason)
    unless every check holds, ``FileNotFoundError`` if there is none."""
    header, members = read_verified(path, TARGETS, key)
    n = len(ids)
    if header.get("n") != n or not np.array_equal(members.get("ids"), ids):
        raise CorruptFile(f"prepared for other images (n = {header.get('n')}, this client has {n})")
    reps, ndcr = members.get("prompt_reps"), members.get("ndcr")
    if (reps is None and ndcr is None) or any(a is not None and a.shape[0] != n for a in (reps, ndcr)):
        raise CorruptFile("no targets, or not one row per image")
    try:
        basis = Basis.from_arrays(members)
    except ValueError as e:
        raise CorruptFile(f"basis: {e}") from None
    reps, ndcr = (None if a is None else torch.from_numpy(a) for a in (reps, ndcr))
    return TeacherTargets(rows=target_rows(ids), prompt_reps=reps, ndcr=ndcr), basis


def evict(folder: Path, keep: Path, budget: int) -> None:
    """Remove the least recently used target files beyond ``budget`` bytes (never ``keep``), and the
    temp files of writers killed mid-write."""
    for p in dead_temp_files(folder):
        p.unlink(missing_ok=True)
    files = []
    for p in folder.glob("*.npz"):
        try:
            st = p.stat()
        except FileNotFoundError:  # another process evicted it
            continue
        files.append((p != keep, -st.st_mtime_ns, st.st_size, p))
    total = 0
    for others, _, size, p in sorted(files):  # `keep` first, then newest first
        total += size
        if others and total > budget:
            p.unlink(missing_ok=True)
            log.info("prepared targets: removed %s (least recently used; %d bytes kept at most)", p, budget)


def load_stored(path: Path, key: str, ids: np.ndarray) -> tuple[TeacherTargets, Basis] | None:
    """This client's targets from disk, or None when there are none or they do not check (logged)."""
    try:
        t0 = time.perf_counter()
        out = load_prepared(path, key, ids)
    except FileNotFoundError:
        return None
    except CorruptFile as e:
        log.warning(
            "prepared targets: %s is invalid (%s); preparing them again from the feature cache", path, e
        )
        return None
    with contextlib.suppress(OSError):  # a read-only cache: eviction may then pick it sooner, no more
        os.utime(path)  # recently used: eviction keeps it
    log.info(
        "prepared targets: loaded %s (%d images) in %.2fs", path.name, len(ids), time.perf_counter() - t0
    )
    return out


def targets_key(
    cfg: Config, feature_key: str, ids: np.ndarray, server_basis: Basis | None, num_prompts_tdcl: int
) -> str:
    """sha256 of everything a client's prepared targets depend on: the feature key (teacher weights,
    dtype, prompts, dataset, ...), the basis (the server's by fingerprint, else how it is derived),
    the client's ids in order, the terms that are kept, the fused widths and the stored format."""
    d, loss = cfg.diffusion, cfg.loss
    h = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes())
    basis_id = server_basis.fingerprint() if server_basis is not None else f"{d.projection}|{cfg.seed}"
    h.update(
        f"|{feature_key}|{basis_id}|{num_prompts_tdcl}|{loss.tdcl_weight > 0}|{loss.ndcr_weight > 0}".encode()
    )
    h.update(f"|{d.channels}|{cfg.embedding_dim}|{TARGETS_FORMAT}-v{TARGETS_VERSION}|float32".encode())
    return h.hexdigest()


Prepared = tuple[TeacherTargets, Basis | None, CacheStats]


def read_through(key: str, path: Path | None, ids: np.ndarray, prepare: Callable[[], Prepared]) -> Prepared:
    """A client's targets and the basis they were fused with, from this process's memory, else from
    ``path`` (None: none is kept on disk, the per-batch mode), else ``prepare()``d and kept in
    both; with the feature-cache cost (every image a hit unless prepared here)."""
    hits = CacheStats(hits=int(np.unique(ids).size))
    if (hit := PREPARED.get(key)) is not None:
        return *hit, hits
    if path is not None and (stored := load_stored(path, key, ids)) is not None:
        PREPARED.put(key, stored)
        return *stored, hits
    targets, basis, stats = prepare()
    PREPARED.put(key, (targets, basis))
    if path is not None and basis is not None:
        try:
            save_prepared(path, key, ids, targets, basis)
            evict(path.parent, path, TARGETS_DISK_BUDGET)
        except OSError as e:  # the run does not need the file: the next process prepares them again
            log.warning(
                "prepared targets: could not write %s (%s); a new process will prepare them again", path, e
            )
    return targets, basis, stats
