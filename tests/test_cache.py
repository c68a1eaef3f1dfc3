"""Feature cache: keys, hits, misses, atomic writes, corruption, resumption.

The extractor is a plain deterministic function of the image id (the real
``extract`` contract: a feature depends only on its id), so no teacher is built.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from feddifrc_app.diffusion.cache import LazyExtractor, cached_pooled_features
from feddifrc_app.diffusion.shards import FeatureStore, key_fields, key_from_fields

P = 3
CH = {1: 5, 2: 4}

BASE = dict(
    weights_hash="ab" * 32,
    resolution=16,
    timestep=300,
    blocks=(1, 2),
    prompts=("a photo of a zero", "a photo of a one", ""),
    seed=7,
    ensemble=1,
    dataset_fingerprint="f00d",
    conditioning="none",
    dtype="float32",
)


def feats_of(ids: np.ndarray) -> dict[int, np.ndarray]:
    ids = np.asarray(ids, dtype=np.float64)
    out = {}
    for b, c in CH.items():
        grid = np.arange(P * c, dtype=np.float64).reshape(1, P, c)
        out[b] = (np.sin(ids[:, None, None] * 0.37 + grid * 0.11 + b) * 10).astype(np.float32)
    return out


class Counter:
    """extract(ids) that records which ids it computed, optionally failing after k calls."""

    def __init__(self, fail_after: int | None = None):
        self.calls: list[np.ndarray] = []
        self.fail_after = fail_after

    def __call__(self, ids):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls.append(np.array(ids))
        return feats_of(ids)

    @property
    def computed(self) -> np.ndarray:
        return np.concatenate(self.calls) if self.calls else np.zeros(0, np.int64)


@pytest.fixture
def store(tmp_cache: Path) -> FeatureStore:
    return FeatureStore(tmp_cache / "features", shard_size=8)


def key_for(**kwargs) -> str:
    return key_from_fields(key_fields(**kwargs))


KEY = key_for(**BASE)


def test_key_changes_with_every_field():
    assert KEY == key_for(**dict(BASE))  # deterministic
    assert len(KEY) == 64 and int(KEY, 16) >= 0
    changed = dict(
        weights_hash="cd" * 32,
        resolution=32,
        timestep=299,
        blocks=(1, 3),
        prompts=("a photo of a zero", "a photo of a one", "x"),
        seed=8,
        ensemble=2,
        dataset_fingerprint="beef",
        conditioning="global-model:abc",
        dtype="float16",
    )
    assert set(changed) == set(BASE)
    keys = {key_for(**{**BASE, k: v}) for k, v in changed.items()}
    assert len(keys) == len(changed) and KEY not in keys
    # Prompt ORDER is part of the key (prompt index = label).
    assert key_for(**{**BASE, "prompts": tuple(reversed(BASE["prompts"]))}) != KEY
    assert key_for(**{**BASE, "dtype": "torch.float32"}) == KEY  # torch dtype str normalised


def test_changed_key_misses(store):
    ids = np.arange(10)
    cached_pooled_features(store, KEY, ids, Counter())
    other = key_for(**{**BASE, "timestep": 299})
    ex = Counter()
    _, st = cached_pooled_features(store, other, ids, ex)
    assert st.hits == 0 and st.misses == 10 and ex.computed.tolist() == list(range(10))


def test_hit_returns_identical_arrays_and_never_calls_extract(store):
    ids = np.array([13, 2, 5, 40, 2, 7])  # unsorted, duplicate, several shards
    first, st1 = cached_pooled_features(store, KEY, ids, Counter(), chunk=3)
    assert (st1.hits, st1.misses) == (0, 5)
    for b, c in CH.items():
        assert first[b].shape == (6, P, c) and first[b].dtype == np.float32
        np.testing.assert_array_equal(first[b], feats_of(ids)[b].astype(np.float16).astype(np.float32))

    def boom(_):
        raise AssertionError("a warm cache must not extract")

    second, st2 = cached_pooled_features(store, KEY, ids, boom)
    assert (st2.hits, st2.misses, st2.corrupt) == (5, 0, 0)
    for b in CH:
        np.testing.assert_array_equal(first[b], second[b])


def test_extract_called_only_for_missing_ids(store):
    cached_pooled_features(store, KEY, np.arange(0, 20, 2), Counter())  # a partition: even ids
    ex = Counter()
    out, st = cached_pooled_features(store, KEY, np.arange(0, 20), ex, chunk=4)  # another setting
    assert ex.computed.tolist() == list(range(1, 20, 2))
    assert all(len(c) <= 4 for c in ex.calls)
    assert (st.hits, st.misses) == (10, 10)
    for b in CH:
        np.testing.assert_array_equal(
            out[b], feats_of(np.arange(20))[b].astype(np.float16).astype(np.float32)
        )


def test_load_reports_found_and_missing(store):
    store.save(KEY, np.array([3, 9, 1]), feats_of(np.array([3, 9, 1])))
    feats, missing = store.load(KEY, np.array([9, 4, 1, 9]))
    assert missing.tolist() == [4]
    assert feats[1].dtype == np.float16 and feats[1].shape == (3, P, CH[1])
    np.testing.assert_array_equal(feats[2], feats_of(np.array([9, 1, 9]))[2].astype(np.float16))
    none, missing = store.load(KEY, np.array([100, 101]))
    assert none is None and missing.tolist() == [100, 101]


def test_killed_writer_leaves_no_half_file(store, monkeypatch):
    ids = np.arange(8)
    cached_pooled_features(store, KEY, ids, Counter())
    path = store.shard_path(KEY, 0)
    good = path.read_bytes()

    # A writer killed while writing its temp file: the shard itself is untouched.
    def dying_savez(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(np, "savez", dying_savez)
    with pytest.raises(KeyboardInterrupt):
        store.save(KEY, np.array([1]), feats_of(np.array([1])))
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert not list(path.parent.glob(".*tmp*"))  # cleaned up on the way out

    # A temp file left by a process killed -9 is ignored by readers and swept by the next writer.
    stale = path.with_name(f".{path.name}.tmp-99999-dead")
    stale.write_bytes(b"PK\x03\x04 garbage")
    _, st = cached_pooled_features(store, KEY, ids, Counter())
    assert (st.hits, st.corrupt) == (8, 0)
    store.save(KEY, np.array([2]), feats_of(np.array([2])))
    assert not stale.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "wrong-key", "tamper"])
def test_damaged_shard_detected_logged_and_rebuilt(store, damage, caplog):
    ids = np.arange(16)  # shards 0 and 1
    ref, _ = cached_pooled_features(store, KEY, ids, Counter())
    path = store.shard_path(KEY, 1)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "flip":  # inside the last block's data, past its npy header
        for i in range(len(raw) - 200, len(raw) - 190):
            raw[i] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(raw)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "tamper":  # a well-formed archive whose data no longer matches its checksum
        with np.load(path) as z:
            arrays = {k: z[k].copy() for k in z.files}
        arrays["block_2"][3, 1, 2] += 1
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    elif damage == "wrong-key":  # a valid shard of another key copied into this folder
        other = key_for(**{**BASE, "seed": 8})
        store.save(other, np.arange(8, 16), feats_of(np.arange(8, 16)))
        path.write_bytes(store.shard_path(other, 1).read_bytes())

    ex = Counter()
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        out, st = cached_pooled_features(store, KEY, ids, ex)
    assert "is invalid" in caplog.text and str(path) in caplog.text
    assert ex.computed.tolist() == list(range(8, 16))  # only the damaged shard's ids
    assert (st.hits, st.misses) == (8, 8) and st.corrupt >= 1
    for b in CH:
        np.testing.assert_array_equal(out[b], ref[b])
    # Rebuilt: the next read is clean and computes nothing.
    _, st = cached_pooled_features(store, KEY, ids, Counter(fail_after=0))
    assert (st.hits, st.misses, st.corrupt) == (16, 0, 0)


def test_interrupted_extraction_resumes(store):
    ids = np.arange(3, 43)  # 40 ids
    ex = Counter(fail_after=3)  # dies during the 4th chunk
    with pytest.raises(KeyboardInterrupt):
        cached_pooled_features(store, KEY, ids, ex, chunk=5)
    done = ex.computed
    assert done.tolist() == list(range(3, 18))  # 3 chunks of 5 saved
    ex2 = Counter()
    out, st = cached_pooled_features(store, KEY, ids, ex2, chunk=5)
    assert ex2.computed.tolist() == list(range(18, 43))  # only the rest
    assert (st.hits, st.misses) == (15, 25)
    for b in CH:
        np.testing.assert_array_equal(out[b], feats_of(ids)[b].astype(np.float16).astype(np.float32))


def test_a_second_extraction_of_the_same_ids_waits_and_reads_instead_of_computing(store):
    """Two extractions of one id set at once (the same partition twice, or `feddifrc extract`
    beside a run): the second waits on the set's claim, then reads what the first stored. Another
    id set in the same shards does not wait. flock locks belong to an open file, so threads
    contend exactly as processes do."""
    import threading

    first_in, release = threading.Event(), threading.Event()
    first = Counter()

    def slow(ids):
        first_in.set()
        assert release.wait(60), "the test's guard: the first extraction was never released"
        return first(ids)

    ids = np.arange(3, 23, 2)  # 10 ids over shards 0-2 (shard size 8)
    result = {}

    def run(name, these, extract):
        result[name] = cached_pooled_features(store, KEY, these, extract, chunk=5)

    t = threading.Thread(target=run, args=("a", ids, slow))
    t.start()
    assert first_in.wait(60)
    other = Counter()  # the interleaved ids of another node: its own claim, no wait
    run("c", ids + 1, other)
    assert other.computed.tolist() == (ids + 1).tolist()
    second = Counter()
    u = threading.Thread(target=run, args=("b", ids, second))
    u.start()
    u.join(0.5)
    assert u.is_alive() and not second.calls  # waiting on the claim, computing nothing
    release.set()
    t.join(60)
    u.join(60)
    assert first.computed.tolist() == ids.tolist() and not second.calls
    out, st = result["b"]
    assert (st.hits, st.misses) == (10, 0)
    for b in CH:
        np.testing.assert_array_equal(out[b], feats_of(ids)[b].astype(np.float16).astype(np.float32))


def test_chunks_are_written_while_the_next_one_is_extracted(store, monkeypatch):
    """One write in flight: a save can only finish once the next chunk's extraction has started
    (with synchronous writes this would wait forever, hence the guard timeout); a failed write
    fails the call."""
    import threading

    started = [threading.Event() for _ in range(4)]
    ex = Counter()

    def extract(ids):
        started[len(ex.calls)].set()
        return ex(ids)

    real_save, saved = store.save, []

    def save(key, ids, feats):
        if len(saved) < 3:  # chunks 0..2: wait for the next chunk's extraction to begin
            assert started[len(saved) + 1].wait(timeout=120), "the write blocked extraction"
        real_save(key, ids, feats)
        saved.append(ids.tolist())

    monkeypatch.setattr(store, "save", save)
    _, st = cached_pooled_features(store, KEY, np.arange(20), extract, chunk=5)
    assert saved == [list(range(i, i + 5)) for i in range(0, 20, 5)] and st.misses == 20
    assert st.write_seconds > 0 and 0 <= st.stall_seconds

    def broken(key, ids, feats):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "save", broken)
    with pytest.raises(OSError, match="No space left"):
        cached_pooled_features(store, "ab" * 32, np.arange(20), Counter(), chunk=5)


def test_extraction_logs_its_progress_for_flwr_log(store, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="flwr"):
        cached_pooled_features(store, KEY, np.arange(40), Counter(), chunk=4, desc="x/train")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("x/train")]
    assert lines[0] == "x/train: extracting 40 of 40 images (0 cached)"
    assert len(lines) == 11 and lines[1].startswith("x/train: 4/40 extracted (10%), ")
    assert lines[-1].startswith("x/train: 40/40 extracted (100%), ") and lines[-1].endswith("about 0 s left")


def test_save_validates(store):
    with pytest.raises(ValueError, match="shape"):
        store.save(KEY, np.arange(3), feats_of(np.arange(2)))
    with pytest.raises(ValueError, match="unique"):
        store.save(KEY, np.array([1, 1]), feats_of(np.array([1, 1])))
    with pytest.raises(ValueError, match="float16"):
        store.save(KEY, np.arange(2), {1: np.full((2, P, 5), 1e6, np.float32)})
    with pytest.raises(ValueError, match="non-negative"):
        store.save(KEY, np.array([-1]), feats_of(np.array([0])))


def test_extractor_shape_mismatch_under_same_key_is_an_error(store):
    cached_pooled_features(store, KEY, np.arange(4), Counter())
    with pytest.raises(RuntimeError, match="misses a field"):
        cached_pooled_features(
            store,
            KEY,
            np.arange(6),
            lambda i: {b: np.zeros((len(i), P + 1, c), np.float32) for b, c in CH.items()},
        )


def test_describe_and_shard_layout(store):
    fields = key_fields(**BASE)
    store.describe(KEY, fields)
    assert (store.key_dir(KEY) / "key.json").exists()
    with pytest.raises(ValueError):
        store.describe(KEY, {**fields, "seed": 9})
    cached_pooled_features(store, KEY, np.array([1, 20, 3]), Counter())
    assert store.missing(KEY, np.arange(21)).tolist() == [i for i in range(21) if i not in (1, 3, 20)]
    assert sorted(p.name for p in store.key_dir(KEY).glob("shard-*.npz")) == [
        "shard-000000.npz",
        "shard-000002.npz",
    ]


def test_lazy_extractor_builds_teacher_only_on_a_miss(store):
    built = []
    seen_batches = []

    def make_featurizer():
        built.append(1)

        def featurizer(images, ids, prompts):
            assert images.shape == (len(ids), 3, 4, 4) and images.dtype == np.uint8
            assert prompts == BASE["prompts"]
            seen_batches.append(len(ids))
            return feats_of(ids)

        return featurizer

    images = np.zeros((50, 3, 4, 4), np.uint8)
    ex = LazyExtractor(make_featurizer, lambda i: images[i], BASE["prompts"], batch_size=4)
    cached_pooled_features(store, KEY, np.arange(10), ex, chunk=6)
    # chunks of 6 and 4 ids: every call holds batch_size images (the short one padded, its rows dropped)
    assert built == [1] and ex.loaded and seen_batches == [4, 4, 4]
    cold = LazyExtractor(make_featurizer, lambda i: images[i], BASE["prompts"], batch_size=4)
    cached_pooled_features(store, KEY, np.arange(10), cold)
    assert not cold.loaded and built == [1]


def test_concurrent_writers_of_one_shard_lose_nothing(tmp_cache):
    # Simulation clients share a cache dir and their partitions interleave inside a shard.
    # Writers merge under the shard's flock (separate open() calls conflict even in threads).
    import threading

    root = tmp_cache / "features"
    errors = []

    def client(i):
        try:
            mine = np.arange(i, 64, 4)  # client i's ids, all in shard 0
            for part in np.array_split(mine, 8):
                FeatureStore(root, shard_size=64).save(KEY, part, feats_of(part))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store = FeatureStore(root, shard_size=64)
    assert store.missing(KEY, np.arange(64)).size == 0
    feats, missing = store.load(KEY, np.arange(64))
    assert missing.size == 0
    np.testing.assert_array_equal(feats[1], feats_of(np.arange(64))[1].astype(np.float16))


def test_verified_shards_are_not_rehashed_until_replaced(store, monkeypatch):
    import feddifrc_app.diffusion.shards as cache_mod
    from feddifrc_app import files

    ids = np.arange(0, 8, 2)
    cached_pooled_features(store, KEY, ids, Counter())
    calls = []
    real = cache_mod._checksum
    monkeypatch.setattr(cache_mod, "_checksum", lambda *a: calls.append(1) or real(*a))
    files._VERIFIED.clear()
    store.load(KEY, ids)
    assert len(calls) == 1  # first read in this process: verified
    store.load(KEY, ids)
    assert len(calls) == 1  # unchanged file: trusted, not hashed again
    cached_pooled_features(store, KEY, np.array([1]), Counter())  # id 0's shard rewritten (new inode)
    calls.clear()
    store.load(KEY, np.array([0]))
    assert len(calls) == 1  # a replaced shard is verified again
