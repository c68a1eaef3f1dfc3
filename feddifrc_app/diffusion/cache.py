"""Keyed, atomic, verified on-disk store of pooled per-block teacher features.

Torch-free: features arrive from an ``extract(ids)`` callable, which is only
called for ids missing from the cache, so a warm cache never loads the teacher
(:class:`LazyExtractor` builds the featurizer on the first miss).

Layout (``root`` = ``<cache_dir>/features``)::

    <root>/<key>/key.json              the key's fields, for people and `feddifrc status`
    <root>/<key>/shard-000012.npz      dataset ids 12*256 .. 13*256-1 that are cached
    <root>/<key>/shard-000012.lock     flock file serialising writers of that shard

Granularity is the IMAGE (dataset index): different partitions, partition
settings and client counts reuse each other's entries, and a killed extraction
resumes where it stopped (each chunk is written as soon as it is computed).

Shard file format: an uncompressed ``np.savez`` archive, read back with
``allow_pickle=False`` (no pickle anywhere), holding

- ``header``: uint8, the utf-8 bytes of a JSON object ``{"format":
  "feddifrc-features", "version": 1, "key", "shard", "shard_size", "blocks",
  "shapes": {block: [n, P, C_b]}, "dtype": "float16", "n", "sha256"}``;
- ``ids``: int64 ``(n,)``, strictly increasing, all inside the shard's range;
- ``block_<b>``: float16 ``(n, P, C_b)`` pooled features of up-block ``b``
  BEFORE any projection (rows follow ``ids``; P = prompts in key order).

``sha256`` covers the ids bytes and every block's bytes (little-endian, block
order). A file that cannot be opened, or whose header, ids, shapes, dtype or
checksum disagree, is logged and treated as absent: its ids are recomputed and
the shard rewritten. A write merges the new rows into what is on disk under the
shard's lock, writes a temporary file in the same folder, fsyncs it and
``os.replace``\\ s it over the shard, so readers only ever see whole files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:  # POSIX; elsewhere writers are not serialised (a lost merge only costs recomputation)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

FORMAT = "feddifrc-features"
FORMAT_VERSION = 1
SHARD_SIZE = 256
STORE_DTYPE = np.float16

__all__ = [
    "CacheStats",
    "FeatureStore",
    "LazyExtractor",
    "cached_pooled_features",
    "config_key_fields",
    "feature_key",
    "key_fields",
    "key_from_fields",
    "teacher_prompts",
]


# --------------------------------------------------------------------------- keys


def key_fields(
    *,
    model_id: str,
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
) -> dict[str, Any]:
    """The canonical fields of a feature key (everything that changes the numbers).

    ``dtype`` is the teacher's compute dtype (fp16 on CUDA and fp32 on CPU give
    slightly different features); pass ``str(teacher.dtype)``. Dataset indices
    are not part of the key: entries are stored per image id.
    """
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_id": str(model_id),
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


def key_from_fields(fields: Mapping[str, Any]) -> str:
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("ascii")).hexdigest()


def feature_key(**kwargs: Any) -> str:
    """sha256 hex of the canonical JSON of :func:`key_fields` (same keyword arguments)."""
    return key_from_fields(key_fields(**kwargs))


def config_key_fields(
    cfg: Any,
    *,
    model_id: str,
    weights_hash: str,
    dtype: str,
    prompts: Sequence[str],
    dataset_fingerprint: str,
    conditioning: str = "none",
) -> dict[str, Any]:
    """:func:`key_fields` of a run ``Config`` (diffusion.* and seed) and a teacher identity.

    The ONE place that maps a config to a cache key, so ``feddifrc extract`` and
    the ClientApp compute the same key. Key = ``key_from_fields(fields)``.
    """
    d = cfg.diffusion
    return key_fields(
        model_id=model_id, weights_hash=weights_hash, resolution=d.resolution, timestep=d.timestep,
        blocks=d.blocks, prompts=prompts, seed=cfg.seed, ensemble=d.ensemble,
        dataset_fingerprint=dataset_fingerprint, conditioning=conditioning, dtype=dtype,
    )


# --------------------------------------------------------------------------- prompts


def teacher_prompts(
    cfg: Any, class_names: Sequence[str], negative_pool: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The prompt list the teacher is run with for ``cfg.method`` (its order is part of the key).

    - ``feddifrc`` (and ``fedavg``, should anyone ask): ``prompt_template.format(name)``
      for every class in LABEL order (prompt y is the TDCL positive of a sample
      with label y, the others its negatives), then ``diffusion.ndcr_prompt``
      LAST ("" = unconditional).
    - ``feddifrc-ssl``: ``ssl.positive_prompt`` first, then
      ``prompt_template.format(name)`` for every name of ``ssl.negatives``, or,
      when that is empty, for ``ssl.num_negatives`` names drawn without
      replacement by ``numpy.random.default_rng(cfg.seed)`` from
      ``negative_pool`` (default: the 200 Tiny-ImageNet class names) and kept
      in pool order, then ``ssl.ndcr_prompt`` LAST.
    """
    d = cfg.diffusion
    if cfg.method == "feddifrc-ssl":
        negatives = tuple(cfg.ssl.negatives)
        if not negatives:
            if negative_pool is None:
                from feddifrc_app.tiny_imagenet_names import TINY_IMAGENET_CLASS_NAMES as negative_pool
            pool = tuple(negative_pool)
            if not pool:
                raise ValueError("teacher_prompts: empty negative_pool for method 'feddifrc-ssl'")
            rng = np.random.default_rng(int(cfg.seed))
            pick = rng.choice(len(pool), size=min(int(cfg.ssl.num_negatives), len(pool)), replace=False)
            negatives = tuple(pool[i] for i in sorted(pick))
        return (cfg.ssl.positive_prompt, *(d.prompt_template.format(n) for n in negatives), cfg.ssl.ndcr_prompt)
    if not class_names:
        raise ValueError("teacher_prompts: no class names")
    return (*(d.prompt_template.format(c) for c in class_names), d.ndcr_prompt)


# --------------------------------------------------------------------------- store


class CorruptShard(Exception):
    """A shard file that must not be used (reason in the message)."""


@dataclass
class _Shard:
    ids: np.ndarray  # int64 (n,), strictly increasing
    blocks: dict[int, np.ndarray]  # float16 (n, P, C_b)


def _checksum(ids: np.ndarray, blocks: Mapping[int, np.ndarray]) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    for b in sorted(blocks):
        h.update(f"|{b}|".encode())
        h.update(np.ascontiguousarray(blocks[b], dtype="<f2").tobytes())
    return h.hexdigest()


def _as_ids(ids: Any) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {a.dtype}")
    a = a.astype(np.int64, copy=False)
    if a.size and a.min() < 0:
        raise ValueError("ids must be non-negative dataset indices")
    return a


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# path -> (inode, size, mtime_ns, checksum) of shards whose checksum this process verified.
_VERIFIED: dict[str, tuple[int, int, int, Any]] = {}


class FeatureStore:
    """Per-image feature shards under ``root`` (normally ``<cache_dir>/features``)."""

    def __init__(self, root: str | os.PathLike[str], shard_size: int = SHARD_SIZE) -> None:
        self.root = Path(root)
        if shard_size < 1:
            raise ValueError("shard_size must be >= 1")
        self.shard_size = int(shard_size)
        self.corrupt_seen = 0  # invalid shard files met so far (each is logged)

    # ---- paths

    def key_dir(self, key: str) -> Path:
        if not key or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"feature key must be lowercase hex, got {key!r}")
        return self.root / key

    def shard_path(self, key: str, shard: int) -> Path:
        return self.key_dir(key) / f"shard-{int(shard):06d}.npz"

    def shards(self, key: str) -> list[int]:
        d = self.key_dir(key)
        if not d.is_dir():
            return []
        out = []
        for p in d.glob("shard-*.npz"):
            with contextlib.suppress(ValueError):
                out.append(int(p.stem.split("-", 1)[1]))
        return sorted(out)

    def describe(self, key: str, fields: Mapping[str, Any]) -> None:
        """Write ``<key>/key.json`` (the key's fields) once; they must hash to ``key``."""
        if key_from_fields(fields) != key:
            raise ValueError("describe: the fields do not hash to this key")
        path = self.key_dir(key) / "key.json"
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(dict(fields), indent=1, sort_keys=True) + "\n").encode()
        self._atomic_write(path, lambda f: f.write(data))

    def cached_ids(self, key: str) -> np.ndarray:
        """Every id with a valid cached entry under ``key`` (reads and verifies all shards)."""
        parts = [s.ids for s in (self._read(key, sh) for sh in self.shards(key)) if s is not None]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    # ---- reading

    def _verify(self, path: Path, key: str, shard: int) -> _Shard:
        try:
            with np.load(path, allow_pickle=False) as z:
                names = set(z.files)
                if "header" not in names or "ids" not in names:
                    raise CorruptShard(f"members {sorted(names)} lack header/ids")
                header = json.loads(bytes(np.asarray(z["header"], dtype=np.uint8)).decode("utf-8"))
                ids = z["ids"]
                arrays = {}
                for b in header.get("blocks", []):
                    name = f"block_{int(b)}"
                    if name not in names:
                        raise CorruptShard(f"missing member {name}")
                    arrays[int(b)] = z[name]
        except CorruptShard:
            raise
        except Exception as e:  # zip/npy/json errors of a truncated or overwritten file
            raise CorruptShard(f"unreadable ({type(e).__name__}: {e})") from None
        if header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
            raise CorruptShard(f"format {header.get('format')!r} v{header.get('version')!r}")
        if header.get("key") != key:
            raise CorruptShard(f"belongs to key {str(header.get('key'))[:12]}..., not {key[:12]}...")
        if header.get("shard") != shard or header.get("shard_size") != self.shard_size:
            raise CorruptShard(
                f"header says shard {header.get('shard')} of size {header.get('shard_size')}, "
                f"expected {shard} of size {self.shard_size}"
            )
        if header.get("dtype") != "float16":
            raise CorruptShard(f"dtype {header.get('dtype')!r}")
        n = header.get("n")
        if ids.dtype != np.int64 or ids.ndim != 1 or ids.shape[0] != n or n < 1:
            raise CorruptShard(f"ids {ids.dtype} {ids.shape} vs n={n}")
        lo = shard * self.shard_size
        if np.any(np.diff(ids) <= 0) or ids[0] < lo or ids[-1] >= lo + self.shard_size:
            raise CorruptShard("ids not strictly increasing inside the shard's range")
        shapes = header.get("shapes", {})
        for b, a in arrays.items():
            want = tuple(shapes.get(str(b), ()))
            if a.dtype != STORE_DTYPE or a.shape != want or a.ndim != 3 or a.shape[0] != n:
                raise CorruptShard(f"block {b}: {a.dtype} {a.shape}, header says float16 {want}")
        if not arrays:
            raise CorruptShard("no blocks")
        # The checksum pass reads every byte again; a shard already verified by this process
        # and not replaced since (same inode, size and mtime) is not hashed twice: a simulation
        # actor re-reads its shards every round, and at CIFAR scale that is ~0.5 GB per client.
        st = path.stat()
        tag = (st.st_ino, st.st_size, st.st_mtime_ns, header.get("sha256"))
        if _VERIFIED.get(str(path)) != tag:
            if _checksum(ids, arrays) != header.get("sha256"):
                raise CorruptShard("checksum mismatch")
            _VERIFIED[str(path)] = tag
        return _Shard(ids=ids, blocks=arrays)

    def _read(self, key: str, shard: int) -> _Shard | None:
        path = self.shard_path(key, shard)
        if not path.exists():
            return None
        try:
            return self._verify(path, key, shard)
        except CorruptShard as e:
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
        ids = _as_ids(ids)
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
                    self.shard_path(key, int(sh)), shapes, ref,
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
        uniq = np.unique(_as_ids(ids))
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

    @contextlib.contextmanager
    def _locked(self, key: str, shard: int) -> Iterator[None]:
        lock = self.key_dir(key) / f"shard-{int(shard):06d}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "a+b") as f:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    @staticmethod
    def _atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(path.parent)

    def save(self, key: str, ids: Any, feats: Mapping[int, Any]) -> None:
        """Store ``feats`` ``{block: (n, P, C_b)}`` for ``ids`` (n unique ids), as float16.

        Each touched shard is re-read under its lock, merged (new rows win) and
        rewritten atomically. A shard on disk that is invalid, or whose blocks
        or shapes differ from ``feats``, is replaced by the new rows alone.
        """
        ids = _as_ids(ids)
        if ids.size == 0:
            return
        if np.unique(ids).size != ids.size:
            raise ValueError("save: ids must be unique")
        if not feats:
            raise ValueError("save: no blocks")
        new: dict[int, np.ndarray] = {}
        for b, a in feats.items():
            a = np.asarray(a)
            if a.ndim != 3 or a.shape[0] != ids.size:
                raise ValueError(f"save: block {b} has shape {a.shape}, expected ({ids.size}, P, C_b)")
            with np.errstate(over="ignore", invalid="ignore"):
                a16 = a.astype(STORE_DTYPE)
            if not np.all(np.isfinite(a16)):
                raise ValueError(
                    f"save: block {b} has NaN/inf values after conversion to float16 "
                    f"(max |x| = {np.nanmax(np.abs(a.astype(np.float64))):.4g}; float16 holds up to 65504)"
                )
            new[int(b)] = a16
        shapes = {b: a.shape[1:] for b, a in new.items()}
        self.key_dir(key).mkdir(parents=True, exist_ok=True)
        shard_of = ids // self.shard_size
        for sh in np.unique(shard_of):
            sh = int(sh)
            sel = np.flatnonzero(shard_of == sh)
            with self._locked(key, sh):
                path = self.shard_path(key, sh)
                for stale in path.parent.glob(f".{path.name}.tmp-*"):  # killed writers (we hold the lock)
                    with contextlib.suppress(OSError):
                        stale.unlink()
                old = self._read(key, sh)
                if old is not None and {b: a.shape[1:] for b, a in old.blocks.items()} != shapes:
                    log.warning("feature cache: %s has other blocks/shapes; replacing it", path)
                    old = None
                sid = ids[sel]
                if old is not None:
                    keep = ~np.isin(old.ids, sid)
                    sid = np.concatenate([old.ids[keep], sid])
                    rows = {b: np.concatenate([old.blocks[b][keep], new[b][sel]]) for b in new}
                else:
                    rows = {b: new[b][sel] for b in new}
                order = np.argsort(sid, kind="stable")
                sid = np.ascontiguousarray(sid[order])
                rows = {b: np.ascontiguousarray(rows[b][order]) for b in sorted(rows)}
                header = {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "key": key,
                    "shard": sh,
                    "shard_size": self.shard_size,
                    "blocks": sorted(rows),
                    "shapes": {str(b): list(a.shape) for b, a in rows.items()},
                    "dtype": "float16",
                    "n": int(sid.size),
                    "sha256": _checksum(sid, rows),
                }
                arrays = {
                    "header": np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8),
                    "ids": sid,
                    **{f"block_{b}": a for b, a in rows.items()},
                }
                self._atomic_write(path, lambda f: np.savez(f, **arrays))


# --------------------------------------------------------------------------- cached extraction


@dataclass
class CacheStats:
    hits: int = 0  # unique ids read from the cache
    misses: int = 0  # unique ids computed by `extract`
    seconds: float = 0.0  # wall time of the whole call
    extract_seconds: float = 0.0  # time inside `extract`
    corrupt: int = 0  # invalid shard files met (logged, recomputed)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    return np.asarray(x)


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

    ``extract(ids_chunk) -> {block: (len(ids_chunk), P, C_b)}`` is called only
    for missing ids, on sorted chunks of at most ``chunk`` ids; every chunk is
    saved before the next one starts, so an interrupted call resumes. Returned
    values are the float16-rounded ones whether they were computed now or read
    back (a hit and a miss give identical arrays), cast to ``out_dtype``.
    Rows follow ``ids`` (duplicates allowed). Empty ``ids`` give ``{}``.
    ``keep=False`` only fills the cache and returns ``{}`` (no features held in
    memory: ``feddifrc extract`` over a whole dataset).
    """
    t0 = time.perf_counter()
    ids = _as_ids(ids)
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    stats = CacheStats()
    corrupt0 = store.corrupt_seen
    uniq = np.unique(ids)
    if uniq.size == 0:
        stats.seconds = time.perf_counter() - t0
        return {}, stats
    if keep:
        found, missing = store.load(key, uniq)
    else:
        found, missing = None, store.missing(key, uniq)
    stats.hits = int(uniq.size - missing.size)
    out: dict[int, np.ndarray] = {}
    shapes: dict[int, tuple[int, ...]] | None = None

    def put(rows: np.ndarray, feats: Mapping[int, np.ndarray]) -> None:
        nonlocal shapes
        got = {int(b): tuple(a.shape[1:]) for b, a in feats.items()}
        if shapes is None:
            shapes = got
            if keep:
                for b, s in got.items():
                    out[b] = np.empty((uniq.size, *s), dtype=out_dtype)
        elif got != shapes:
            raise RuntimeError(
                f"feature cache key {key[:12]}...: cached blocks/shapes {shapes} differ from the "
                f"extractor's {got}; the key misses a field that changes the features"
            )
        if keep:
            for b, a in feats.items():
                out[int(b)][rows] = a

    if found is not None:
        put(np.flatnonzero(~np.isin(uniq, missing)), found)

    if missing.size:
        from tqdm.auto import tqdm

        bar = tqdm(total=int(uniq.size), initial=stats.hits, unit="img", desc=desc,
                   disable=not progress, dynamic_ncols=True)
        try:
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
                store.save(key, sub, feats)
                put(np.searchsorted(uniq, sub), {b: a.astype(STORE_DTYPE) for b, a in feats.items()})
                stats.misses += int(sub.size)
                bar.update(int(sub.size))
        finally:
            bar.close()

    if np.array_equal(ids, uniq):
        result = {b: out[b] for b in sorted(out)}
    else:
        pos = np.searchsorted(uniq, ids)
        result = {b: out[b][pos] for b in sorted(out)}
    stats.corrupt = store.corrupt_seen - corrupt0
    stats.seconds = time.perf_counter() - t0
    return result, stats


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
