"""targets.py: a client's prepared targets on disk (what a new process loads instead of the
feature shards) and the key they are stored under."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_config
from flwr.app import ConfigRecord, Message, RecordDict

from feddifrc_app.config import load_node_config
from feddifrc_app.data.registry import load_dataset
from feddifrc_app.files import CorruptFile
from feddifrc_app.halves import Node
from feddifrc_app.methods.feddifrc import node as node_half
from feddifrc_app.methods.feddifrc import targets as tg
from feddifrc_app.methods.feddifrc.projection import random_basis
from feddifrc_app.methods.feddifrc.teacher import feature_set, teacher_prompts, teacher_spec

# ----------------------------------------------------------------------------- prepared targets on disk

N = 12  # this client's images


def _client(cache: Path, **over):
    """(cfg, data, ids, prompts, K) of a 12-image digits client with the tiny random teacher."""
    cfg = make_config(
        **{
            "dataset.train-limit": 40,
            "diffusion.device": "cpu",
            "diffusion.cache-dir": str(cache),
            "diffusion.projection": "random",  # local-pca needs more rows than 12 images give
            **over,
        }
    )
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    ids = np.arange(3, 3 + N, dtype=np.int64)
    return cfg, data, ids, teacher_prompts(cfg, data.class_names), data.num_classes


def _prepare(cache: Path, cfg, data, ids, prompts, k, basis=None):
    p = tg.plan(cfg, teacher_spec(cfg, cache), data, ids)
    assert (p.features.prompts, p.num_prompts_tdcl) == (prompts, k)
    return tg.client_targets(p, p.key(basis), basis)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client's features extracted once (the tiny teacher built there too)."""
    cache = tmp_path_factory.mktemp("targets") / "cache"
    cfg, data, ids, prompts, _ = _client(cache)
    _, stats = tg.pooled_features(feature_set(teacher_spec(cfg, cache), data, prompts), ids)
    assert stats.misses == N
    return cache


@pytest.fixture
def prepared(warm_cache: Path, tmp_path: Path):
    """A client whose targets were prepared once (file written), then a 'new process': nothing in
    memory. Yields (cache, client, targets, basis, the file)."""
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    client = _client(cache)
    tg.PREPARED.items.clear()
    first, basis, stats = _prepare(cache, *client)
    assert (stats.hits, stats.misses) == (N, 0)
    (path,) = (cache / "targets").glob("*.npz")
    tg.PREPARED.items.clear()
    yield cache, client, first, basis, path
    tg.PREPARED.items.clear()


def _no_shards(monkeypatch, cache: Path) -> None:
    shutil.rmtree(cache / "features")

    def refuse(*a, **k):
        raise AssertionError("the feature cache was read")

    monkeypatch.setattr(tg, "pooled_features", refuse)


def test_a_new_process_loads_prepared_targets_without_touching_the_shards(prepared, monkeypatch, caplog):
    cache, client, first, basis, path = prepared
    _no_shards(monkeypatch, cache)
    with caplog.at_level(logging.INFO, logger="flwr.feddifrc"):
        again, basis2, stats = _prepare(cache, *client)
    assert f"loaded {path.name} ({N} images)" in caplog.text
    assert (stats.hits, stats.misses) == (N, 0)
    assert first.prompt_reps.shape == (N, 10, 512) and first.ndcr.shape == (N, 512)
    assert torch.equal(again.prompt_reps, first.prompt_reps) and torch.equal(again.ndcr, first.ndcr)
    assert torch.equal(again.rows, first.rows) and basis2.fingerprint() == basis.fingerprint()
    # The same targets serve the same rows: a batch of dataset indices gathers identical values.
    idx = torch.tensor([3, 9, 14])
    for a, b in zip(again.take(idx), first.take(idx), strict=True):
        assert torch.equal(a, b)
    assert len(tg.PREPARED.items) == 1  # and kept in memory from then on


@pytest.mark.parametrize("damage", ["truncate", "flip", "tamper", "other-key", "other-ids"])
def test_a_damaged_targets_file_is_never_loaded_and_is_rewritten(prepared, damage, monkeypatch, caplog):
    cache, client, first, basis, path = prepared
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "flip":  # inside the last member's data
        for i in range(len(raw) - 300, len(raw) - 290):
            raw[i] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif damage == "tamper":  # a well-formed archive whose data no longer matches its checksum
        with np.load(path) as z:
            arrays = {k: z[k].copy() for k in z.files}
        arrays["ndcr"][2, 5] += 1
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    else:  # a valid file written for other images, or under another key, copied over this one
        cfg, data, ids, prompts, k = client
        other_ids = ids[:-1] if damage == "other-ids" else ids
        other_key = path.stem if damage == "other-ids" else "f" * 64
        n = len(other_ids)
        part = tg.TeacherTargets(first.rows, first.prompt_reps[:n].clone(), first.ndcr[:n].clone())
        tg.save_prepared(path, other_key, other_ids, part, basis)
    with pytest.raises(CorruptFile):
        tg.load_prepared(path, path.stem, client[2])

    reads = []
    real = tg.pooled_features
    monkeypatch.setattr(tg, "pooled_features", lambda *a, **k: reads.append(1) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        again, _, stats = _prepare(cache, *client)
    assert "is invalid" in caplog.text and str(path) in caplog.text
    assert reads == [1] and stats.hits == N  # prepared again from the (intact) feature cache
    assert torch.equal(again.prompt_reps, first.prompt_reps) and torch.equal(again.ndcr, first.ndcr)
    loaded, _ = tg.load_prepared(path, path.stem, client[2])  # rewritten, and it checks again
    assert torch.equal(loaded.ndcr, first.ndcr)


def test_the_targets_key_changes_with_everything_they_depend_on() -> None:
    cfg = make_config(**{"diffusion.projection": "random"})
    ids = np.arange(10, dtype=np.int64)
    basis = random_basis((5, 4, 3), (2, 2, 2), (1, 2, 3), seed=0)
    base = tg.targets_key(cfg, "a" * 64, ids, None, 10)
    assert tg.targets_key(cfg, "a" * 64, ids.copy(), None, 10) == base  # a pure function of its inputs
    changed = {
        "feature key (teacher weights, dtype, prompts, dataset)": tg.targets_key(
            cfg, "b" * 64, ids, None, 10
        ),
        "ids": tg.targets_key(cfg, "a" * 64, ids[:-1], None, 10),
        "id order": tg.targets_key(cfg, "a" * 64, ids[::-1].copy(), None, 10),
        "server basis": tg.targets_key(cfg, "a" * 64, ids, basis, 10),
        "other server basis": tg.targets_key(
            cfg, "a" * 64, ids, random_basis((5, 4, 3), (2, 2, 2), (1, 2, 3), seed=1), 10
        ),
        "TDCL prompts": tg.targets_key(cfg, "a" * 64, ids, None, 9),
        "projection": tg.targets_key(
            make_config(**{"diffusion.projection": "local-pca"}), "a" * 64, ids, None, 10
        ),
        "NDCR off": tg.targets_key(
            make_config(**{"diffusion.projection": "local-pca", "loss.ndcr-weight": 0.0}),
            "a" * 64,
            ids,
            None,
            10,
        ),
        "fused widths": tg.targets_key(
            make_config(**{"diffusion.projection": "random", "diffusion.channels": "128,128,256"}),
            "a" * 64,
            ids,
            None,
            10,
        ),
    }
    assert base not in changed.values() and len(set(changed.values())) == len(changed), changed


def test_another_basis_is_another_file_and_old_files_go_beyond_the_budget(prepared, monkeypatch) -> None:
    cache, client, first, basis, path = prepared
    cfg, data, ids, prompts, k = client
    fed = make_config(
        **{"dataset.train-limit": 40, "diffusion.device": "cpu", "diffusion.cache-dir": str(cache)}
    )  # federated-pca: the server's basis is part of the key
    _prepare(cache, fed, data, ids, prompts, k, basis)
    other = random_basis([basis.means[i].shape[0] for i in range(3)], basis.widths, basis.blocks, seed=3)
    _prepare(cache, fed, data, ids, prompts, k, other)
    files = sorted((cache / "targets").glob("*.npz"), key=lambda p: p.stat().st_mtime_ns)
    assert len({p.name for p in files}) == 3 and files[0] == path

    # Over the byte budget the least recently used go; a read counts as a use.
    tg.PREPARED.items.clear()
    os.utime(files[1], ns=(1, 1))  # the oldest now, but read next: kept
    _prepare(cache, fed, data, ids, prompts, k, basis)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = cache / "targets" / f".{path.name}.tmp-{int(dead.stdout)}-0123abcd"  # a writer killed mid-write
    live = cache / "targets" / f".{path.name}.tmp-{os.getpid()}-4567abcd"  # a writer still at it
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    # Room for two files: the one about to be rewritten and the most recently used other one.
    assert files[1].stat().st_mtime_ns > files[2].stat().st_mtime_ns
    monkeypatch.setattr(tg, "TARGETS_DISK_BUDGET", path.stat().st_size + files[1].stat().st_size)
    tg.PREPARED.items.clear()
    path.unlink()
    _prepare(cache, *client)  # rewritten now: the newest; one of the other two must go
    left = {p.name for p in (cache / "targets").iterdir()}
    assert left == {path.name, files[1].name, live.name}, left


def test_the_node_half_refuses_a_missing_federated_basis_before_touching_the_teacher(monkeypatch, tmp_path):
    """FedDifRC's node half fails on a train message without the server's basis before any teacher work."""
    cfg, data, ids, _, _ = _client(tmp_path / "cache", **{"diffusion.projection": "federated-pca"})

    def refuse(*a, **k):
        raise AssertionError("the teacher was resolved")

    monkeypatch.setattr(node_half, "teacher_spec", refuse)
    msg = Message(
        RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=1, message_type="train"
    )
    node = Node(
        cfg,
        data,
        ids,
        torch.device("cpu"),
        0,
        RecordDict(),
        config=load_node_config({"partition-id": 0, "num-partitions": 4}),
    )
    with pytest.raises(ValueError, match="federated-pca' but the server sent no basis"):
        node_half.node_half(msg, node)
    assert not (tmp_path / "cache").exists()


def test_node_targets_are_client_targets_plus_their_cost(prepared) -> None:
    cache, client, first, basis, _ = prepared
    cfg, data, ids, _, _ = client
    model, cpu = torch.nn.Linear(1, 1), torch.device("cpu")  # no model-conditioned targets here
    p = tg.plan(cfg, teacher_spec(cfg, cache), data, ids)
    targets, metrics = tg.node_targets(p, p.key(None), None, None, model, cpu)
    assert torch.equal(targets.prompt_reps, first.prompt_reps) and torch.equal(targets.ndcr, first.ndcr)
    assert set(metrics) == {"teacher-seconds", "teacher-cache-misses"}
    assert metrics["teacher-cache-misses"] == 0
