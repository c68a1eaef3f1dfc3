"""Cached extraction of pooled per-block teacher features: what is missing from the feature
store (``shards.FeatureStore``) is extracted, stored and returned beside what was there.

Torch-free: features come from an ``extract(ids)`` callable that is called only for ids
missing from the cache, so a warm cache never loads the teacher (``LazyExtractor``). An
extraction holds the claim of its id set (``FeatureStore.claimed``): a second extraction of
the same ids waits, then reads what the first stored. Each extracted chunk is saved by a
background writer while the next one is extracted.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from feddifrc_app import log
from feddifrc_app.data.partition import as_indices
from feddifrc_app.diffusion.shards import STORE_DTYPE, FeatureStore

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


@dataclass(kw_only=True)
class _Job:
    """One call of :func:`cached_pooled_features`: where its rows go and how it reports."""

    store: FeatureStore
    key: str
    uniq: np.ndarray  # the sorted unique ids asked for
    extract: Callable[[np.ndarray], Mapping[int, Any]]
    out: _Rows
    stats: CacheStats
    chunk: int
    keep: bool
    progress: bool
    desc: str


def _extract_missing(job: _Job, missing: np.ndarray) -> Iterator[tuple[np.ndarray, dict[int, np.ndarray]]]:
    """``extract`` the ``missing`` ids in sorted chunks; yields (chunk ids, float16-rounded features).

    Each chunk is saved by a background writer while the next one is extracted (one write in
    flight), so the accelerator does not wait for shard merging, hashing and fsync. Whatever
    ends the loop, the write in flight completes first: an interrupted call resumes after the
    last extracted chunk. ``stats.stall_seconds`` is the time extraction waited for a write.
    """
    stats = job.stats
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="feature-cache-writer") as writer:
        pending: Future | None = None

        def wait() -> None:
            if pending is not None:
                ts = time.perf_counter()
                pending.result()  # a failed write fails the call
                stats.stall_seconds += time.perf_counter() - ts

        for start in range(0, missing.size, job.chunk):
            sub = missing[start : start + job.chunk]
            te = time.perf_counter()
            raw = job.extract(sub)
            stats.extract_seconds += time.perf_counter() - te
            feats = {int(b): _to_numpy(a) for b, a in raw.items()}
            for b, a in feats.items():
                if a.ndim != 3 or a.shape[0] != sub.size:
                    raise ValueError(
                        f"extract returned block {b} with shape {a.shape} for {sub.size} ids; "
                        "expected (n, P, C_b)"
                    )
            wait()
            pending = writer.submit(_timed_save, job, sub, feats)
            stats.misses += int(sub.size)
            yield sub, {b: a.astype(STORE_DTYPE) for b, a in feats.items()}
        wait()


def _timed_save(job: _Job, ids: np.ndarray, feats: dict) -> None:
    t0 = time.perf_counter()
    job.store.save(job.key, ids, feats)
    job.stats.write_seconds += time.perf_counter() - t0


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
    found, missing = store.load(key, uniq, rows=keep)
    stats.hits = int(uniq.size - missing.size)
    job = _Job(
        store=store,
        key=key,
        uniq=uniq,
        extract=extract,
        out=_Rows(key, uniq.size, out_dtype, keep),
        stats=stats,
        chunk=chunk,
        keep=keep,
        progress=progress,
        desc=desc,
    )
    if found is not None:
        job.out.put(np.flatnonzero(~np.isin(uniq, missing)), found)
    with store.claimed(key, uniq) if missing.size else contextlib.nullcontext():
        if missing.size:  # another process may have extracted some while this one waited
            missing = _read_meanwhile(job, missing)
        _extract_into(job, missing)
    pos = None if np.array_equal(ids, uniq) else np.searchsorted(uniq, ids)
    stats.corrupt = store.corrupt_seen - corrupt0
    stats.seconds = time.perf_counter() - t0
    return {b: a if pos is None else a[pos] for b, a in sorted(job.out.blocks.items())}, stats


def _read_meanwhile(job: _Job, missing: np.ndarray) -> np.ndarray:
    """The ids still missing once the claim is ours; rows another process stored are read."""
    store, key = job.store, job.key
    again, still = store.load(key, missing, rows=job.keep)
    done = np.setdiff1d(missing, still)
    if done.size:
        log.info("%s: %d images were extracted by another process meanwhile; read", job.desc, done.size)
        if again is not None:
            job.out.put(np.searchsorted(job.uniq, done), again)
        job.stats.hits += int(done.size)
    return still


def _extract_into(job: _Job, missing: np.ndarray) -> None:
    """Extract ``missing`` in chunks into ``out`` and the store, logging progress every 10%."""
    if not missing.size:
        return
    from tqdm.auto import tqdm

    stats, desc, total = job.stats, job.desc, int(job.uniq.size)
    style = dict(unit="img", desc=desc, disable=not job.progress, dynamic_ncols=True)
    log.info("%s: extracting %d of %d images (%d cached)", desc, missing.size, total, stats.hits)
    next_note, t_ex = missing.size / 10, time.perf_counter()
    with tqdm(total=total, initial=stats.hits, **style) as bar:
        for sub, feats in _extract_missing(job, missing):
            job.out.put(np.searchsorted(job.uniq, sub), feats)
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
    into sub-batches of exactly ``batch_size`` images (``diffusion.batch-size``; the
    last one padded).
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
            # Every call holds batch_size images: a short last batch is padded with copies of its last
            # image (their rows dropped). The kernels a batch's shape selects change the float sums
            # (measured at 1 thread: a batch of 8 or 12 vs 16 changed 136 of 84,480 float16 values of
            # 48 images; where an image sits in a full batch changed none), so an image's features
            # do not depend on how many others the writer of the cache extracted with it.
            full = np.concatenate([sub, np.repeat(sub[-1:], self.batch_size - sub.size)])
            got = self._featurizer(self._images_for(full), full, self.prompts)
            for b, a in got.items():
                parts.setdefault(int(b), []).append(_to_numpy(a)[: sub.size])
        return {b: np.concatenate(v) for b, v in parts.items()}
