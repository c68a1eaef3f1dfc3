"""Keyed, atomic, verified on-disk store of pooled per-block teacher features.

Torch-free: features come from an ``extract(ids)`` callable that is called only for ids
missing from the cache, so a warm cache never loads the teacher (``LazyExtractor``).
Entries are per IMAGE (dataset index), so partitions and client counts share them, and a
killed extraction resumes where it stopped. Layout under ``<cache_dir>/features``::

    <key>/key.json              the key's fields, for people
    <key>/shard-000012.npz      cached dataset ids 12*256 .. 13*256-1
    <key>/shard-000012.lock     flock serialising the writers of that shard
    <key>/claim-<digest>        flock held while a process extracts an id set: a second
                                extraction of the same set waits, then reads instead of computing

A shard is an uncompressed ``np.savez`` archive, read with ``allow_pickle=False``:
``header`` (uint8 utf-8 JSON: format, version, key, shard, shard_size, blocks, shapes,
dtype, n, sha256), ``ids`` (int64, strictly increasing, inside the shard's range) and
``block_<b>`` (float16 ``(n, P, C_b)``, up-block b pooled BEFORE any projection, P =
prompts in key order). ``sha256`` covers the ids and every block (little-endian, block
order). A shard that fails any check is logged and treated as absent (recomputed and
rewritten). Writers merge into the shard under its lock and replace it atomically
(``files.write_archive`` / ``files.read_archive``: the app's one verified-array format).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feddifrc_app import log
from feddifrc_app.data.partition import as_indices
from feddifrc_app.files import CorruptFile, array_digest, atomic_write, read_archive, write_archive

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
) -> dict[str, Any]:
    """The canonical fields of a feature key (everything that changes the numbers, nothing else).

    The teacher is named by the sha256 of its weight files only, never by its hub id or
    folder: the same weights moved, copied or mirrored serve the same cache. ``dtype`` is the
    teacher's compute dtype (fp16 on CUDA and fp32 on CPU give slightly different features,
    so an fp32 CPU extract never serves an fp16 GPU run); pass ``str(teacher.dtype)``.
    Dataset indices are not part of the key: entries are stored per image id. ``family``
    (``family.FAMILIES``: which layers ``blocks`` index, how the image is noised) is a field
    of every family but SD 1.x/2.x, whose keys predate it and stay as they were. ``vae_dtype``
    is a field only where the VAE encodes in another dtype than ``dtype`` (SDXL's float32 VAE
    under float16, ``family.vae_dtype``): every other key is as it was before it existed.
    """
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
    if family != "sd":
        fields["family"] = str(family)
    return fields


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


# path -> (inode, size, mtime_ns, checksum) of shards whose checksum this process verified.
_VERIFIED: dict[str, tuple[int, int, int, Any]] = {}


def _open_shard(path: Path) -> tuple[dict[str, Any], np.ndarray, dict[int, np.ndarray]]:
    """(header, ids, {block: rows}) of a shard file, unchecked; ``CorruptFile`` if unreadable."""
    header, members = read_archive(path)
    if "ids" not in members:
        raise CorruptFile(f"members {sorted(members)} lack ids")
    try:
        blocks = [int(b) for b in header.get("blocks", [])]
    except (TypeError, ValueError):
        raise CorruptFile(f"header blocks {header.get('blocks')!r}") from None
    missing = [b for b in blocks if f"block_{b}" not in members]
    if missing:
        raise CorruptFile(f"missing member block_{missing[0]}")
    return header, members["ids"], {b: members[f"block_{b}"] for b in blocks}


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

    def _check(self, key: str, shard: int, header: dict, ids: np.ndarray, arrays: dict) -> None:
        """Raise ``CorruptFile`` unless the header, ids and block arrays agree with each other and
        with this key and shard (the checksum is ``_verify``'s)."""
        if header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
            raise CorruptFile(f"format {header.get('format')!r} v{header.get('version')!r}")
        if header.get("key") != key:
            raise CorruptFile(f"belongs to key {str(header.get('key'))[:12]}..., not {key[:12]}...")
        if header.get("shard") != shard or header.get("shard_size") != self.shard_size:
            raise CorruptFile(
                f"header says shard {header.get('shard')} of size {header.get('shard_size')}, "
                f"expected {shard} of size {self.shard_size}"
            )
        if header.get("dtype") != "float16":
            raise CorruptFile(f"dtype {header.get('dtype')!r}")
        n = header.get("n")
        if ids.dtype != np.int64 or ids.ndim != 1 or ids.shape[0] != n or n < 1:
            raise CorruptFile(f"ids {ids.dtype} {ids.shape} vs n={n}")
        lo = shard * self.shard_size
        if np.any(np.diff(ids) <= 0) or ids[0] < lo or ids[-1] >= lo + self.shard_size:
            raise CorruptFile("ids not strictly increasing inside the shard's range")
        shapes = header.get("shapes", {})
        for b, a in arrays.items():
            want = tuple(shapes.get(str(b), ()))
            if a.dtype != STORE_DTYPE or a.shape != want or a.ndim != 3 or a.shape[0] != n:
                raise CorruptFile(f"block {b}: {a.dtype} {a.shape}, header says float16 {want}")
        if not arrays:
            raise CorruptFile("no blocks")

    def _verify(self, path: Path, key: str, shard: int) -> _Shard:
        header, ids, arrays = _open_shard(path)
        self._check(key, shard, header, ids, arrays)
        # The checksum pass reads every byte again; a shard already verified by this process
        # and not replaced since (same inode, size and mtime) is not hashed twice: a simulation
        # actor re-reads its shards every round, and at CIFAR scale that is ~0.5 GB per client.
        st = path.stat()
        tag = (st.st_ino, st.st_size, st.st_mtime_ns, header.get("sha256"))
        if _VERIFIED.get(str(path)) != tag:
            if _checksum(ids, arrays) != header.get("sha256"):
                raise CorruptFile("checksum mismatch")
            _VERIFIED[str(path)] = tag
        return _Shard(ids=ids, blocks=arrays)

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

    def load(self, key: str, ids: Any) -> tuple[dict[int, np.ndarray] | None, np.ndarray]:
        """Cached features of ``ids``: ``(feats, missing)``.

        ``feats`` = ``{block: float16 (m, P, C_b)}`` for the ids that were found,
        in the order they appear in ``ids`` (i.e. ``ids[~np.isin(ids,
        missing)]``), or None when none was found. ``missing`` = the sorted
        unique ids without a valid entry. Invalid shards are logged and count
        as missing; load never modifies the store.
        """
        ids = as_indices(ids, "ids")
        uniq = np.unique(ids)
        if uniq.size == 0:
            return None, uniq
        found_rows: dict[int, list[np.ndarray]] = {}
        found_ids: list[np.ndarray] = []
        ref: dict[int, tuple[int, ...]] | None = None
        shard_of = uniq // self.shard_size
        for sh in np.unique(shard_of):
            want = uniq[shard_of == sh]
            s = self._read(key, int(sh))
            if s is None:
                continue
            shapes = {b: a.shape[1:] for b, a in s.blocks.items()}
            if ref is None:
                ref = shapes
            elif shapes != ref:
                self.corrupt_seen += 1
                log.warning(
                    "feature cache: %s holds blocks/shapes %s unlike the other shards %s; ignored",
                    self.shard_path(key, int(sh)),
                    shapes,
                    ref,
                )
                continue
            pos = np.searchsorted(s.ids, want)
            pos_c = np.minimum(pos, len(s.ids) - 1)
            hit = s.ids[pos_c] == want
            if not hit.any():
                continue
            found_ids.append(want[hit])
            for b, a in s.blocks.items():
                found_rows.setdefault(b, []).append(a[pos_c[hit]])
        if not found_ids:
            return None, uniq
        fid = np.concatenate(found_ids)  # sorted (shards ascending, ids ascending within)
        missing = np.setdiff1d(uniq, fid, assume_unique=True)
        order = np.searchsorted(fid, ids[np.isin(ids, fid)])
        feats = {b: np.concatenate(rows)[order] for b, rows in sorted(found_rows.items())}
        return feats, missing

    def missing(self, key: str, ids: Any) -> np.ndarray:
        """Sorted unique ``ids`` without a valid entry (verifies the shards, keeps no features)."""
        uniq = np.unique(as_indices(ids, "ids"))
        have: list[np.ndarray] = []
        ref = None
        shard_of = uniq // self.shard_size
        for sh in np.unique(shard_of):
            s = self._read(key, int(sh))
            if s is None:
                continue
            shapes = {b: a.shape[1:] for b, a in s.blocks.items()}
            ref = shapes if ref is None else ref
            if shapes == ref:
                have.append(s.ids)
        return np.setdiff1d(uniq, np.concatenate(have)) if have else uniq

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
        header = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "key": key,
            "shard": shard,
            "shard_size": self.shard_size,
            "blocks": sorted(rows),
            "shapes": {str(b): list(a.shape) for b, a in rows.items()},
            "dtype": "float16",
            "n": int(ids.size),
            "sha256": _checksum(ids, rows),
        }
        write_archive(path, header, {"ids": ids, **{f"block_{b}": a for b, a in rows.items()}})


# --------------------------------------------------------------------------- cached extraction


@dataclass
class CacheStats:
    hits: int = 0  # unique ids read from the cache
    misses: int = 0  # unique ids computed by `extract`
    seconds: float = 0.0  # wall time of the whole call
    extract_seconds: float = 0.0  # time inside `extract`
    write_seconds: float = 0.0  # time the background writer spent saving extracted chunks
    stall_seconds: float = 0.0  # time extraction waited for the writer
    corrupt: int = 0  # invalid shard files met (logged, recomputed)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    return np.asarray(x)


class _Rows:
    """The per-block output over the sorted unique ids, filled from hits and extracted chunks; all
    parts must agree in blocks and shapes (else the key misses a field). Holds nothing when not ``keep``."""

    def __init__(self, key: str, n: int, dtype: Any, keep: bool) -> None:
        self.key, self.n, self.dtype, self.keep = key, n, dtype, keep
        self.shapes: dict[int, tuple[int, ...]] | None = None
        self.blocks: dict[int, np.ndarray] = {}

    def put(self, rows: np.ndarray, feats: Mapping[int, np.ndarray]) -> None:
        got = {int(b): tuple(a.shape[1:]) for b, a in feats.items()}
        if self.shapes is None:
            self.shapes = got
            if self.keep:
                self.blocks = {b: np.empty((self.n, *s), dtype=self.dtype) for b, s in got.items()}
        elif got != self.shapes:
            raise RuntimeError(
                f"feature cache key {self.key[:12]}...: cached blocks/shapes {self.shapes} differ from the "
                f"extractor's {got}; the key misses a field that changes the features"
            )
        if self.keep:
            for b, a in feats.items():
                self.blocks[int(b)][rows] = a


def _extract_missing(
    store: FeatureStore,
    key: str,
    missing: np.ndarray,
    extract: Callable[[np.ndarray], Mapping[int, Any]],
    chunk: int,
    stats: CacheStats,
) -> Iterator[tuple[np.ndarray, dict[int, np.ndarray]]]:
    """``extract`` the ``missing`` ids in sorted chunks; yields (chunk ids, float16-rounded features).

    Each chunk is saved by a background writer while the next one is extracted (one write in
    flight), so the accelerator does not wait for shard merging, hashing and fsync. Whatever
    ends the loop, the write in flight completes first: an interrupted call resumes after the
    last extracted chunk. ``stats.stall_seconds`` is the time extraction waited for a write.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="feature-cache-writer") as writer:
        pending: Future | None = None

        def wait() -> None:
            if pending is not None:
                ts = time.perf_counter()
                pending.result()  # a failed write fails the call
                stats.stall_seconds += time.perf_counter() - ts

        for start in range(0, missing.size, chunk):
            sub = missing[start : start + chunk]
            te = time.perf_counter()
            raw = extract(sub)
            stats.extract_seconds += time.perf_counter() - te
            feats = {int(b): _to_numpy(a) for b, a in raw.items()}
            for b, a in feats.items():
                if a.ndim != 3 or a.shape[0] != sub.size:
                    raise ValueError(
                        f"extract returned block {b} with shape {a.shape} for {sub.size} ids; "
                        "expected (n, P, C_b)"
                    )
            wait()
            pending = writer.submit(_timed_save, store, key, sub, feats, stats)
            stats.misses += int(sub.size)
            yield sub, {b: a.astype(STORE_DTYPE) for b, a in feats.items()}
        wait()


def _timed_save(store: FeatureStore, key: str, ids: np.ndarray, feats: dict, stats: CacheStats) -> None:
    t0 = time.perf_counter()
    store.save(key, ids, feats)
    stats.write_seconds += time.perf_counter() - t0


def cached_pooled_features(
    store: FeatureStore,
    key: str,
    ids: Any,
    extract: Callable[[np.ndarray], Mapping[int, Any]],
    *,
    chunk: int = 256,
    progress: bool = False,
    desc: str = "teacher features",
    out_dtype: Any = np.float32,
    keep: bool = True,
) -> tuple[dict[int, np.ndarray], CacheStats]:
    """Pooled features ``{block: (len(ids), P, C_b)}`` for ``ids``, from the cache or ``extract``.

    ``extract(ids_chunk) -> {block: (len(ids_chunk), P, C_b)}`` is called only for missing
    ids, on sorted chunks of at most ``chunk`` ids, each saved at once. Returned values are
    the float16-rounded ones whether computed now or read back (a hit and a miss give
    identical arrays), cast to ``out_dtype``; rows follow ``ids`` (duplicates allowed).
    ``keep=False`` only fills the cache and returns ``{}`` (``feddifrc extract``).
    """
    t0 = time.perf_counter()
    ids = as_indices(ids, "ids")
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    stats, corrupt0 = CacheStats(), store.corrupt_seen
    uniq = np.unique(ids)
    found, missing = store.load(key, uniq) if keep else (None, store.missing(key, uniq))
    stats.hits = int(uniq.size - missing.size)
    out = _Rows(key, uniq.size, out_dtype, keep)
    if found is not None:
        out.put(np.flatnonzero(~np.isin(uniq, missing)), found)
    with store.claimed(key, uniq) if missing.size else contextlib.nullcontext():
        if missing.size:  # another process may have extracted some while this one waited
            missing = _read_meanwhile(store, key, uniq, missing, out, stats, keep, desc)
        _extract_into(store, key, uniq, missing, extract, out, stats, chunk, progress, desc)
    pos = None if np.array_equal(ids, uniq) else np.searchsorted(uniq, ids)
    stats.corrupt = store.corrupt_seen - corrupt0
    stats.seconds = time.perf_counter() - t0
    return {b: a if pos is None else a[pos] for b, a in sorted(out.blocks.items())}, stats


def _read_meanwhile(
    store: FeatureStore,
    key: str,
    uniq: np.ndarray,
    missing: np.ndarray,
    out: _Rows,
    stats: CacheStats,
    keep: bool,
    desc: str,
) -> np.ndarray:
    """The ids still missing once the claim is ours; rows another process stored are read."""
    again, still = store.load(key, missing) if keep else (None, store.missing(key, missing))
    done = np.setdiff1d(missing, still)
    if done.size:
        log.info("%s: %d images were extracted by another process meanwhile; read", desc, done.size)
        if again is not None:
            out.put(np.searchsorted(uniq, done), again)
        stats.hits += int(done.size)
    return still


def _extract_into(
    store: FeatureStore,
    key: str,
    uniq: np.ndarray,
    missing: np.ndarray,
    extract: Callable[[np.ndarray], Mapping[int, Any]],
    out: _Rows,
    stats: CacheStats,
    chunk: int,
    progress: bool,
    desc: str,
) -> None:
    """Extract ``missing`` in chunks into ``out`` and the store, logging progress every 10%."""
    if not missing.size:
        return
    from tqdm.auto import tqdm

    style = dict(unit="img", desc=desc, disable=not progress, dynamic_ncols=True)
    log.info("%s: extracting %d of %d images (%d cached)", desc, missing.size, uniq.size, stats.hits)
    next_note, t_ex = missing.size / 10, time.perf_counter()
    with tqdm(total=int(uniq.size), initial=stats.hits, **style) as bar:
        for sub, feats in _extract_missing(store, key, missing, extract, chunk, stats):
            out.put(np.searchsorted(uniq, sub), feats)
            bar.update(int(sub.size))
            if stats.misses >= next_note:  # about every 10%, for `flwr log` (a ClientApp has no bar)
                next_note += missing.size / 10
                rate = stats.misses / (time.perf_counter() - t_ex)
                log.info(
                    "%s: %d/%d extracted (%.0f%%), %.2f images/s, about %.0f s left",
                    desc,
                    stats.misses,
                    missing.size,
                    100 * stats.misses / missing.size,
                    rate,
                    (missing.size - stats.misses) / rate,
                )


class LazyExtractor:
    """An ``extract`` for :func:`cached_pooled_features` that builds the teacher on the first miss.

    ``make_featurizer()`` returns a callable ``f(images_uint8, ids, prompts) ->
    {block: (B, P, C_b)}`` (the diffusion Featurizer); it is called at most
    once, and never when every id is cached. ``images_for(ids)`` returns the
    uint8 images ``(n, 3, H, W)`` of those dataset ids. Each call is split
    into sub-batches of ``batch_size`` images (``diffusion.batch-size``).
    """

    def __init__(
        self,
        make_featurizer: Callable[[], Callable[..., Mapping[int, Any]]],
        images_for: Callable[[np.ndarray], Any],
        prompts: Sequence[str],
        batch_size: int,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self._make = make_featurizer
        self._images_for = images_for
        self.prompts = tuple(prompts)
        self.batch_size = int(batch_size)
        self._featurizer: Callable[..., Mapping[int, Any]] | None = None

    @property
    def loaded(self) -> bool:
        return self._featurizer is not None

    def __call__(self, ids: np.ndarray) -> dict[int, np.ndarray]:
        if self._featurizer is None:
            self._featurizer = self._make()
        parts: dict[int, list[np.ndarray]] = {}
        for s in range(0, len(ids), self.batch_size):
            sub = np.asarray(ids[s : s + self.batch_size], dtype=np.int64)
            got = self._featurizer(self._images_for(sub), sub, self.prompts)
            for b, a in got.items():
                parts.setdefault(int(b), []).append(_to_numpy(a))
        return {b: np.concatenate(v) for b, v in parts.items()}
