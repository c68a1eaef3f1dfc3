"""Keyed, atomic, verified on-disk store of pooled per-block teacher features (the shards).

Entries are per IMAGE (dataset index), so partitions and client counts share them, and a
killed extraction resumes where it stopped. Layout under ``<cache_dir>/features``::

    <key>/key.json              the key's fields, for people
    <key>/shard-000012.npz      cached dataset ids 12*256 .. 13*256-1
    <key>/shard-000012.lock     flock serialising the writers of that shard
    <key>/claim-<digest>        flock held while a process extracts an id set: a second
                                extraction of the same set waits, then reads instead of computing

A shard is a verified archive (``files.write_verified`` / ``files.read_verified``, the app's
one such mechanism): ``header`` (utf-8 JSON: format, version, key, shard, shard_size, blocks,
shapes, dtype, n, sha256), ``ids`` (int64, strictly increasing, inside the shard's range) and
``block_<b>`` (float16 ``(n, P, C_b)``, up-block b pooled BEFORE any projection, P = prompts in
key order). ``sha256`` covers the ids and every block (little-endian, block order). A shard
that fails any check is logged and treated as absent (recomputed and rewritten). Writers merge
into the shard under its lock and replace it atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feddifrc_app import log
from feddifrc_app.data.partition import as_indices
from feddifrc_app.files import (
    ArchiveKind,
    CorruptFile,
    array_digest,
    atomic_write,
    read_verified,
    write_verified,
)

try:  # POSIX; elsewhere writers are not serialised (a lost merge only costs recomputation)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

FORMAT = "feddifrc-features"
FORMAT_VERSION = 1
SHARD_SIZE = 256
STORE_DTYPE = np.float16


# --------------------------------------------------------------------------- keys


def key_fields(
    *,
    weights_hash: str,
    resolution: int,
    timestep: int,
    blocks: Sequence[int],
    prompts: Sequence[str],
    seed: int,
    ensemble: int,
    dataset_fingerprint: str,
    conditioning: str = "none",
    dtype: str = "",
    vae_dtype: str = "",
    family: str = "sd",
    pool_grid: int = 0,
    dit_features: str = "raw",
    batch_size: int = 16,
) -> dict[str, Any]:
    """The canonical fields of a feature key (everything that changes the numbers, nothing else).

    The teacher is named by the sha256 of its weight files only (moved, copied or mirrored weights
    serve the same cache). ``dtype`` is the teacher's compute dtype (fp16 on CUDA and fp32 on CPU
    give slightly different features): pass ``str(teacher.dtype)``. Dataset indices are not part
    of the key: entries are stored per image id. Fields that older keys predate are present only
    where not at their default, so those keys stay as they were: ``family`` (``family.ADAPTERS``;
    not for SD 1.x/2.x), ``vae_dtype`` (where the VAE encodes in another dtype than ``dtype``:
    SDXL's float32 VAE under float16), ``pool_grid`` (not 0, the mean), ``dit_features`` (not
    ``raw``) and ``batch_size`` (not 16: a call's shape picks the kernels, so the features' last
    bits; ``cache.LazyExtractor`` pads every call to it). The mid-block is one of ``blocks``."""
    fields = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "weights_hash": str(weights_hash),
        "resolution": int(resolution),
        "timestep": int(timestep),
        "blocks": [int(b) for b in blocks],
        "prompts": [str(p) for p in prompts],
        "seed": int(seed),
        "ensemble": int(ensemble),
        "dataset_fingerprint": str(dataset_fingerprint),
        "conditioning": str(conditioning),
        "dtype": str(dtype).removeprefix("torch."),
    }
    vae = str(vae_dtype).removeprefix("torch.")
    if vae and vae != fields["dtype"]:
        fields["vae_dtype"] = vae
    optional = {"family": (str(family), "sd"), "dit_features": (str(dit_features), "raw")}
    optional |= {"pool_grid": (int(pool_grid), 0), "batch_size": (int(batch_size), 16)}
    return fields | {k: v for k, (v, default) in optional.items() if v != default}


def key_from_fields(fields: Mapping[str, Any]) -> str:
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("ascii")).hexdigest()


# --------------------------------------------------------------------------- store


@dataclass
class _Shard:
    ids: np.ndarray  # int64 (n,), strictly increasing
    blocks: dict[int, np.ndarray]  # float16 (n, P, C_b)


def _checksum(ids: np.ndarray, blocks: Mapping[int, np.ndarray]) -> str:
    parts = [("", np.asarray(ids, dtype="<i8"))]
    parts += [(f"|{b}|", np.asarray(blocks[b], dtype="<f2")) for b in sorted(blocks)]
    return array_digest(parts)


def _blocks_of(members: Mapping[str, np.ndarray]) -> dict[int, np.ndarray]:
    return {int(k.removeprefix("block_")): a for k, a in members.items() if k.startswith("block_")}


def _promised(header: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The members a shard header promises: ids (n,) and block_<b> (n, P, C_b) float16."""
    n, shapes = int(header["n"]), header["shapes"]
    out = {"ids": ("<i8", (n,))}
    for b in header["blocks"]:
        shape = tuple(int(d) for d in shapes[str(int(b))])
        if len(shape) != 3 or shape[0] != n:
            raise ValueError(f"block {b} shape {list(shape)} for n = {n}")
        out[f"block_{int(b)}"] = ("<f2", shape)
    return out


SHARDS = ArchiveKind(
    format=FORMAT,
    version=FORMAT_VERSION,
    members=_promised,
    digest=lambda m: _checksum(m["ids"], _blocks_of(m)),  # _checksum looked up per call (tests count it)
)


def _as_stored(feats: Mapping[int, Any], n: int) -> dict[int, np.ndarray]:
    """``{block: (n, P, C_b)}`` as float16, refusing values that float16 cannot hold."""
    if not feats:
        raise ValueError("save: no blocks")
    out: dict[int, np.ndarray] = {}
    for b, a in feats.items():
        a = np.asarray(a)
        if a.ndim != 3 or a.shape[0] != n:
            raise ValueError(f"save: block {b} has shape {a.shape}, expected ({n}, P, C_b)")
        with np.errstate(over="ignore", invalid="ignore"):
            a16 = a.astype(STORE_DTYPE)
        if not np.all(np.isfinite(a16)):
            raise ValueError(
                f"save: block {b} has NaN/inf values after conversion to float16 "
                f"(max |x| = {np.nanmax(np.abs(a.astype(np.float64))):.4g}; float16 holds up to 65504)"
            )
        out[int(b)] = a16
    return out


@contextlib.contextmanager
def _flock(lock: Path) -> Iterator[None]:
    """An exclusive flock on ``lock`` (created) for the block's duration."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+b") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class FeatureStore:
    """Per-image feature shards under ``root`` (normally ``<cache_dir>/features``)."""

    def __init__(self, root: str | os.PathLike[str], shard_size: int = SHARD_SIZE) -> None:
        self.root = Path(root)
        if shard_size < 1:
            raise ValueError("shard_size must be >= 1")
        self.shard_size = int(shard_size)
        self.corrupt_seen = 0  # invalid shard files met so far (each is logged)

    def key_dir(self, key: str) -> Path:
        if not key or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"feature key must be lowercase hex, got {key!r}")
        return self.root / key

    def shard_path(self, key: str, shard: int) -> Path:
        return self.key_dir(key) / f"shard-{int(shard):06d}.npz"

    def describe(self, key: str, fields: Mapping[str, Any]) -> None:
        """Write ``<key>/key.json`` (the key's fields) once; they must hash to ``key``."""
        if key_from_fields(fields) != key:
            raise ValueError("describe: the fields do not hash to this key")
        path = self.key_dir(key) / "key.json"
        if not path.exists():
            text = json.dumps(dict(fields), indent=1, sort_keys=True) + "\n"
            atomic_write(path, lambda f: f.write(text), mode="w")

    # ---- reading

    def _verify(self, path: Path, key: str, shard: int) -> _Shard:
        """The shard at ``path`` if it is a verified archive of ``key`` (``files.read_verified``)
        holding ``shard`` of this store's size; else ``CorruptFile``."""
        header, members = read_verified(path, SHARDS, key)
        if header.get("shard") != shard or header.get("shard_size") != self.shard_size:
            raise CorruptFile(
                f"header says shard {header.get('shard')} of size {header.get('shard_size')}, "
                f"expected {shard} of size {self.shard_size}"
            )
        if header.get("dtype") != "float16":
            raise CorruptFile(f"dtype {header.get('dtype')!r}")
        ids, blocks = members["ids"], _blocks_of(members)
        lo = shard * self.shard_size
        if not ids.size or not blocks:
            raise CorruptFile("no ids or no blocks")
        if np.any(np.diff(ids) <= 0) or ids[0] < lo or ids[-1] >= lo + self.shard_size:
            raise CorruptFile("ids not strictly increasing inside the shard's range")
        return _Shard(ids=ids, blocks=blocks)

    def _read(self, key: str, shard: int) -> _Shard | None:
        path = self.shard_path(key, shard)
        if not path.exists():
            return None
        try:
            return self._verify(path, key, shard)
        except FileNotFoundError:  # removed since the exists() above: absent, not corrupt
            return None
        except CorruptFile as e:
            self.corrupt_seen += 1
            log.warning("feature cache: %s is invalid (%s); its entries will be recomputed", path, e)
            return None

    def load(
        self, key: str, ids: Any, *, rows: bool = True
    ) -> tuple[dict[int, np.ndarray] | None, np.ndarray]:
        """Cached features of ``ids``: ``(feats, missing)``.

        ``feats`` = ``{block: float16 (m, P, C_b)}`` for the ids that were found,
        in the order they appear in ``ids`` (i.e. ``ids[~np.isin(ids,
        missing)]``), or None when none was found (always None for ``rows=False``: only
        ``missing`` is wanted). ``missing`` = the sorted unique ids without a valid entry.
        Invalid shards are logged and count as missing; load never modifies the store.
        """
        ids = as_indices(ids, "ids")
        uniq = np.unique(ids)
        found_rows: dict[int, list[np.ndarray]] = {}
        found_ids: list[np.ndarray] = []
        ref: dict[int, tuple[int, ...]] | None = None
        shard_of = uniq // self.shard_size
        for sh in np.unique(shard_of):
            want, s = uniq[shard_of == sh], self._read(key, int(sh))
            if s is None:
                continue
            shapes = {b: a.shape[1:] for b, a in s.blocks.items()}
            ref = shapes if ref is None else ref
            if shapes != ref:
                if rows:  # ``missing`` passes over such a shard without a word
                    self.corrupt_seen += 1
                    log.warning(
                        "feature cache: %s holds blocks/shapes %s unlike the other shards %s; ignored",
                        self.shard_path(key, int(sh)),
                        shapes,
                        ref,
                    )
                continue
            pos_c = np.minimum(np.searchsorted(s.ids, want), len(s.ids) - 1)
            hit = s.ids[pos_c] == want
            found_ids.append(want[hit])
            for b, a in s.blocks.items() if rows else ():
                found_rows.setdefault(b, []).append(a[pos_c[hit]])
        fid = np.concatenate(found_ids) if found_ids else uniq[:0]  # sorted: shards, then ids ascending
        missing = np.setdiff1d(uniq, fid, assume_unique=True)
        if not rows or not fid.size:
            return None, missing
        order = np.searchsorted(fid, ids[np.isin(ids, fid)])
        return {b: np.concatenate(r)[order] for b, r in sorted(found_rows.items())}, missing

    def missing(self, key: str, ids: Any) -> np.ndarray:
        """Sorted unique ``ids`` without a valid entry (verifies the shards, keeps no features)."""
        return self.load(key, ids, rows=False)[1]

    # ---- writing

    def _locked(self, key: str, shard: int) -> contextlib.AbstractContextManager[None]:
        return _flock(self.key_dir(key) / f"shard-{int(shard):06d}.lock")

    def claimed(self, key: str, ids: np.ndarray) -> contextlib.AbstractContextManager[None]:
        """Hold the extraction claim of this exact id set (``claim-<sha256 of the ids>``): a second
        extraction of the same ids (the same partition twice, `feddifrc extract` beside a run)
        waits, then reads what the first stored. Other id sets, such as the other nodes'
        interleaved partitions, never wait on it."""
        digest = hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()[:16]
        return _flock(self.key_dir(key) / f"claim-{digest}")

    def save(self, key: str, ids: Any, feats: Mapping[int, Any]) -> None:
        """Store ``feats`` ``{block: (n, P, C_b)}`` for ``ids`` (n unique ids), as float16.

        Each touched shard is re-read under its lock, merged (new rows win) and
        rewritten atomically. A shard on disk that is invalid, or whose blocks
        or shapes differ from ``feats``, is replaced by the new rows alone.
        """
        ids = as_indices(ids, "ids")
        if ids.size == 0:
            return
        if np.unique(ids).size != ids.size:
            raise ValueError("save: ids must be unique")
        new = _as_stored(feats, ids.size)
        self.key_dir(key).mkdir(parents=True, exist_ok=True)
        shard_of = ids // self.shard_size
        for sh in np.unique(shard_of):
            sel = np.flatnonzero(shard_of == sh)
            with self._locked(key, int(sh)):
                self._merge(key, int(sh), ids[sel], {b: a[sel] for b, a in new.items()})

    def _merge(self, key: str, shard: int, ids: np.ndarray, rows: dict[int, np.ndarray]) -> None:
        """Rewrite ``shard`` as its valid rows on disk plus ``rows`` of ``ids`` (caller holds the lock)."""
        path = self.shard_path(key, shard)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by killed writers
            with contextlib.suppress(OSError):
                stale.unlink()
        old = self._read(key, shard)
        shapes = {b: a.shape[1:] for b, a in rows.items()}
        if old is not None and {b: a.shape[1:] for b, a in old.blocks.items()} != shapes:
            log.warning("feature cache: %s has other blocks/shapes; replacing it", path)
            old = None
        if old is not None:
            keep = ~np.isin(old.ids, ids)
            ids = np.concatenate([old.ids[keep], ids])
            rows = {b: np.concatenate([old.blocks[b][keep], rows[b]]) for b in rows}
        order = np.argsort(ids, kind="stable")
        ids = np.ascontiguousarray(ids[order])
        rows = {b: np.ascontiguousarray(rows[b][order]) for b in sorted(rows)}
        fields = {
            "shard": shard,
            "shard_size": self.shard_size,
            "blocks": sorted(rows),
            "shapes": {str(b): list(a.shape) for b, a in rows.items()},
            "dtype": "float16",
            "n": int(ids.size),
        }
        write_verified(path, SHARDS, key, {"ids": ids, **{f"block_{b}": a for b, a in rows.items()}}, fields)
