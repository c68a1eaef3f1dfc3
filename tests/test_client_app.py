"""ClientApp handlers called as plain functions with real Flower Messages and Contexts.

A tiny digits run (40 training images, 4 partitions -> 10 images per client), the embedded
tiny random-weight teacher at 16 px, 1 local epoch, teacher cache in a per-session tmp dir
(shared with test_train.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import default_run_config
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from feddifrc_app import client_app, config_loader
from feddifrc_app.config import ConfigError, load_node_config
from feddifrc_app.config_loader import load_config
from feddifrc_app.data import shares as ds
from feddifrc_app.data.loader import make_loader
from feddifrc_app.device import platform_info
from feddifrc_app.diffusion.pipeline import teacher_identity
from feddifrc_app.methods.feddifrc import targets as tg
from feddifrc_app.methods.feddifrc import teacher as th
from feddifrc_app.methods.feddifrc.projection import fit_basis, merge_client_stats, stats_from_arrays
from feddifrc_app.methods.feddifrc.teacher import (
    conditioned_reps,
    feature_set,
    featurizer,
    pooled_features,
    teacher_prompts,
    teacher_spec,
)
from feddifrc_app.model import build_model
from feddifrc_app.records import arrays_to_record, state_to_record
from feddifrc_app.train import evaluate as evaluate_model

ROOT = Path(__file__).resolve().parents[1]
N_PARTS = 4
N_IMAGES = 10  # per client: 40 images / 4 partitions
N_PROMPTS = 11  # 10 class prompts + the NDCR prompt


def run_config(teacher_cache: Path, **over) -> dict:
    base = dict(
        dataset__train_limit=40,
        diffusion__cache_dir=str(teacher_cache),
        train__device="cpu",
        diffusion__device="cpu",
    )  # batch 64: one SGD step over the 10 images
    base.update(over)
    return default_run_config(**base)


def context(rc: dict, pid: int = 0, state: RecordDict | None = None) -> Context:
    return Context(
        run_id=1,
        node_id=pid + 1,
        node_config={"partition-id": pid, "num-partitions": N_PARTS},
        state=state if state is not None else RecordDict(),
        run_config=rc,
    )


def call(kind: str, content: RecordDict, ctx: Context) -> Message:
    msg = Message(content=content, message_type=kind, dst_node_id=ctx.node_id)
    reply = client_app.app(msg, ctx)
    assert not reply.has_error(), reply.error.reason
    return reply


def setup_msg(want_stats: bool) -> RecordDict:
    return RecordDict({"config": ConfigRecord({"want-stats": want_stats})})


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return build_model("resnet10", 10).state_dict()


def train_msg(rnd: int = 1, basis=None, seed: int = 0, **config) -> RecordDict:
    c = RecordDict(
        {
            "arrays": state_to_record(model_state(seed)),
            "config": ConfigRecord({"server-round": rnd, **config}),
        }
    )
    if basis is not None:
        c["basis"] = arrays_to_record(basis.to_arrays())
    return c


def arrays(reply: Message) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in reply.content["arrays"].items()}


def same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def setup_replies(teacher_cache: Path) -> list[Message]:
    """query.setup with want-stats from clients 0 and 1 (fills the teacher cache for both)."""
    # Module scope runs before conftest's function-scoped task-identity fixture: set it here too.
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    try:
        rc = run_config(teacher_cache)
        return [call("query.setup", setup_msg(True), context(rc, pid)) for pid in (0, 1)]
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture(scope="module")
def basis(setup_replies: list[Message]):
    """The federated PCA basis the server would fit from the two clients' statistics."""
    stats = [
        stats_from_arrays({k: v.numpy() for k, v in r.content["pca-stats"].items()}) for r in setup_replies
    ]
    return fit_basis(merge_client_stats(stats), (256, 128, 128), (1, 2, 3))


# --------------------------------------------------------------------------- setup


def test_setup_reports_identity_label_counts_and_pca_statistics(teacher_cache: Path, setup_replies) -> None:
    rc = run_config(teacher_cache)
    cfg = load_config(rc)
    for pid, reply in zip((0, 1), setup_replies, strict=False):
        info = dict(reply.content["info"])
        data, ids = ds.client_split(cfg, load_node_config({"partition-id": pid, "num-partitions": N_PARTS}))
        assert info["partition-id"] == pid and info["num-partitions"] == N_PARTS
        assert info["num-examples"] == len(ids) == N_IMAGES
        assert list(info["label-counts"]) == np.bincount(data.labels[ids], minlength=10).tolist()
        assert sum(info["label-counts"]) == info["num-examples"]
        assert list(info["class-names"]) == data.class_names  # the server checks every node's list
        assert {k: info[f"platform-{k}"] for k in platform_info()} == platform_info()
        assert info["teacher-model"] == "tiny-seed0"
        assert info["teacher-random-weights"] is True
        assert info["teacher-device"] == "cpu float32"
        assert info["teacher-weights"] == teacher_identity("tiny-seed0", teacher_cache).weights_hash
        assert info["teacher-seconds"] >= 0
        stats = stats_from_arrays({k: v.numpy() for k, v in reply.content["pca-stats"].items()})
        assert sorted(stats) == [1, 2, 3]
        assert {b: s.channels for b, s in stats.items()} == {1: 256, 2: 128, 3: 128}
        for s in stats.values():
            assert s.count == N_IMAGES * N_PROMPTS
            assert np.allclose(s.outer, s.outer.T)
        # the statistics are those of the client's own pooled teacher features
        features = feature_set(teacher_spec(cfg, teacher_cache), data, teacher_prompts(cfg, data.class_names))
        pooled, _ = pooled_features(features, ids)
        assert np.allclose(stats[2].total, pooled[2].reshape(-1, 128).astype(np.float64).sum(0), rtol=1e-6)
    # a second setup without want-stats: identity only, no statistics, no teacher work
    again = call("query.setup", setup_msg(False), context(rc, 0))
    assert "pca-stats" not in again.content
    assert "teacher-seconds" not in again.content["info"]
    assert again.content["info"]["label-counts"] == setup_replies[0].content["info"]["label-counts"]


def test_setup_for_fedavg_names_no_teacher(tmp_path: Path) -> None:
    rc = run_config(tmp_path, method="fedavg")
    info = call("query.setup", setup_msg(False), context(rc, 2)).content["info"]
    assert "teacher-model" not in info and info["num-examples"] == N_IMAGES
    assert not any(tmp_path.iterdir())  # no tiny model built, no features


# --------------------------------------------------------------------------- train


def test_train_with_federated_basis_then_warm_cache_without_teacher(teacher_cache: Path, basis) -> None:
    rc = run_config(teacher_cache)
    content = train_msg(1, basis)
    sent = {k: v.numpy() for k, v in content["arrays"].items()}
    reply = call("train", content, context(rc, 0))
    got = arrays(reply)
    assert got.keys() == sent.keys()
    assert not same_arrays(got, sent)
    assert all(np.isfinite(v).all() for v in got.values())
    m = dict(reply.content["metrics"])
    assert m["num-examples"] == N_IMAGES
    assert m["train-tdcl"] > 0 and m["train-ndcr"] > 0
    assert all(math.isfinite(v) for v in m.values())
    assert m["teacher-cache-misses"] == 0  # setup filled the cache

    # a second call: the cache serves it, and no teacher gets built
    built = th.built()
    second = call("train", train_msg(2, basis), context(rc, 0))
    assert second.content["metrics"]["teacher-cache-misses"] == 0
    assert th.built() == built


def test_targets_are_prepared_once_per_process_and_per_basis(
    teacher_cache: Path, setup_replies, basis, tmp_path
) -> None:
    """A node's second round reuses its fused targets: no cache read (the cache may even be gone)."""
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(teacher_cache, cache)
    rc = run_config(cache)
    tg.PREPARED.items.clear()
    first = call("train", train_msg(1, basis), context(rc, 0)).content["metrics"]
    assert len(tg.PREPARED.items) == 1
    ((targets, _),) = tg.PREPARED.items.values()
    assert targets.prompt_reps.shape == (N_IMAGES, 10, 512) and targets.ndcr.shape == (N_IMAGES, 512)
    shutil.rmtree(cache / "features")  # a re-read would have to extract again: misses > 0
    second = call("train", train_msg(2, basis), context(rc, 0)).content["metrics"]
    assert first["teacher-cache-misses"] == second["teacher-cache-misses"] == 0
    assert not (cache / "features").exists() and len(tg.PREPARED.items) == 1

    # Another basis (or node) is another entry, computed from the features again.
    own = stats_from_arrays({k: v.numpy() for k, v in setup_replies[0].content["pca-stats"].items()})
    other = fit_basis(own, (256, 128, 128), (1, 2, 3))
    third = call("train", train_msg(3, other), context(rc, 0)).content["metrics"]
    assert third["teacher-cache-misses"] == N_IMAGES and len(tg.PREPARED.items) == 2

    # Least recently used entries go once the byte budget is exceeded; the newest always stays.
    budget, tg.PREPARED.budget = tg.PREPARED.budget, 1
    try:
        tg.PREPARED.put("newest", tg.PREPARED.get(next(iter(tg.PREPARED.items))))
        assert list(tg.PREPARED.items) == ["newest"]
    finally:
        tg.PREPARED.budget = budget
        tg.PREPARED.items.clear()


def test_train_is_deterministic_per_round(teacher_cache: Path, basis) -> None:
    rc = run_config(teacher_cache)
    a = arrays(call("train", train_msg(3, basis), context(rc, 1)))
    b = arrays(call("train", train_msg(3, basis), context(rc, 1)))
    c = arrays(call("train", train_msg(4, basis), context(rc, 1)))
    assert same_arrays(a, b)
    assert not same_arrays(a, c)


def test_a_new_clientapp_process_imports_torchvision_only_at_a_transform(tmp_path: Path) -> None:
    """A deployment starts a process per message: importing the ClientApp and everything a
    mnist-5k / digits train message imports, and loading mnist-5k at its native size, must not
    import torchvision (its import pulls in torch._dynamo: seconds); the first transform does."""
    code = (
        "import json, sys\n"
        "import feddifrc_app.client_app, feddifrc_app.train, feddifrc_app.model\n"
        "import feddifrc_app.methods.feddifrc.losses, feddifrc_app.methods.feddifrc.targets\n"
        "import feddifrc_app.methods.moon, sklearn.datasets, mlxtend.data\n"
        "from feddifrc_app.tools.run_config import app_defaults\n"
        "from feddifrc_app.config_loader import load_config\n"
        "from feddifrc_app.data.registry import load_dataset\n"
        "from feddifrc_app.data.transforms import eval_transform\n"
        "seen = ['torchvision' in sys.modules]\n"
        f"rc = {{**app_defaults({str(ROOT)!r}), 'dataset.data-dir': {str(tmp_path)!r}}}\n"
        "data = load_dataset(load_config(rc).dataset, 'train')\n"
        "seen.append('torchvision' in sys.modules)\n"
        "eval_transform(data)(data.images[0])\n"
        "print(json.dumps([data.name, data.images.shape[-1], *seen, 'torchvision' in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout.strip().splitlines()[-1]) == ["mnist-5k", 28, False, False, True]


def test_the_train_handler_logs_its_own_time(tmp_path: Path, caplog) -> None:
    rc = run_config(tmp_path, method="fedavg")
    msg = Message(content=train_msg(1), message_type="train", dst_node_id=1)
    with caplog.at_level(logging.INFO, logger="flwr.feddifrc"):
        reply = client_app.app(msg, context(rc, 0))
    assert not reply.has_error(), reply.error
    m = re.search(r"train message: handled in ([\d.]+) s", caplog.text)
    assert m, caplog.text
    assert float(m.group(1)) >= reply.content["metrics"]["train-seconds"] > 0  # training is part of it


def test_each_handler_logs_the_process_age_and_the_message_age(tmp_path: Path, caplog) -> None:
    rc = run_config(tmp_path, method="fedavg", fraction_evaluate=1.0, evaluate_holdout=0.3)
    msg = Message(content=train_msg(1), message_type="evaluate", dst_node_id=1)
    msg.metadata.created_at = time.time() - 100.0  # the server created it 100 s ago
    with caplog.at_level(logging.INFO, logger="flwr.feddifrc"):
        assert not client_app.app(msg, context(rc, 0)).has_error()
    since_created = time.time() - msg.metadata.created_at  # measured, not a bound on the handler's speed
    m = re.search(r"evaluate message: process age ([\d.]+) s, created ([\d.]+) s ago", caplog.text)
    assert m, caplog.text
    assert 100.0 <= float(m.group(2)) <= since_created + 0.005  # logged as %.2f

    # The age is the process's own: in a new process, at least the time it has run its code and at
    # most the time since it was launched (monotonic clocks on both sides).
    code = (
        "import time; t0 = time.monotonic()\n"
        "import logging, types; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from feddifrc_app.client_app import _arrived\n"
        "time.sleep(1.0)\n"
        "meta = types.SimpleNamespace(message_type='train', created_at=time.time())\n"
        "ran = time.monotonic() - t0\n"
        "_arrived(types.SimpleNamespace(metadata=meta))\n"
        "print(ran)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    launched = time.monotonic()
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    since_launch = time.monotonic() - launched
    assert cp.returncode == 0, cp.stderr
    age = float(re.search(r"train message: process age ([\d.]+) s, created [\d.]+ s ago", cp.stderr).group(1))
    ran = float(cp.stdout.strip().splitlines()[-1])
    assert ran - 0.02 <= age <= since_launch + 0.02, (ran, age, since_launch)  # /proc counts in 10 ms ticks


def test_fedavg_train_needs_no_basis_and_no_teacher(tmp_path: Path) -> None:
    built = th.built()
    rc = run_config(tmp_path, method="fedavg")
    content = train_msg(1)
    sent = {k: v.numpy() for k, v in content["arrays"].items()}
    reply = call("train", content, context(rc, 0))
    m = dict(reply.content["metrics"])
    assert not same_arrays(arrays(reply), sent)
    assert m["num-examples"] == N_IMAGES and m["train-ce"] > 0
    assert not any(k.startswith(("teacher-", "train-tdcl", "train-ndcr")) for k in m)
    assert th.built() == built
    assert not any(tmp_path.iterdir())  # nothing written to the teacher cache


def test_proximal_mu_from_the_message_adds_the_fedprox_term(tmp_path: Path) -> None:
    rc = run_config(tmp_path, method="fedavg", train__batch_size=5)  # 2 steps: the term is 0 at the first
    m = call("train", train_msg(1, **{"proximal-mu": 1.0}), context(rc, 0)).content["metrics"]
    assert m["train-prox"] > 0
    plain = call("train", train_msg(1), context(rc, 0)).content["metrics"]
    assert "train-prox" not in plain


def test_keep_momentum_stores_buffers_in_context_state(tmp_path: Path) -> None:
    rc = run_config(tmp_path, method="fedavg", train__keep_momentum=True)
    state = RecordDict()
    call("train", train_msg(1), context(rc, 0, state))
    assert "momentum" in state
    mom = state["momentum"]
    assert isinstance(mom, ArrayRecord)
    names = {n for n, _ in build_model("resnet10", 10).named_parameters()}
    assert set(mom) == names
    first = {k: v.numpy().copy() for k, v in mom.items()}
    # round 2 starts from the stored buffers: same message, with vs without them, differs
    with_mom = arrays(call("train", train_msg(2), context(rc, 0, state)))
    without = arrays(call("train", train_msg(2), context(rc, 0, RecordDict())))
    assert not same_arrays(with_mom, without)
    assert not same_arrays({k: v.numpy() for k, v in state["momentum"].items()}, first)  # updated
    # keep-momentum off: nothing stored
    off = RecordDict()
    call("train", train_msg(1), context(run_config(tmp_path, method="fedavg"), 0, off))
    assert "momentum" not in off


def test_evaluate_scores_the_sent_model_on_the_held_out_part_only(teacher_cache: Path) -> None:
    rc = run_config(teacher_cache, fraction_evaluate=1.0, evaluate_holdout=0.3)
    eval_msg = RecordDict(
        {"arrays": state_to_record(model_state(5)), "config": ConfigRecord({"server-round": 1})}
    )
    m = dict(call("evaluate", eval_msg, context(rc, 0)).content["metrics"])
    assert m["num-examples"] == 3  # round(0.3 * 10) of the 10 images, the other 7 train
    assert 0.0 <= m["eval-accuracy"] <= 1.0
    assert math.isfinite(m["eval-loss"]) and m["eval-loss"] > 0
    # the same numbers as evaluating the model directly on the held-out images
    cfg = load_config(rc)
    node = load_node_config({"partition-id": 0, "num-partitions": N_PARTS})
    data, held = ds.client_holdout(cfg, node)
    model = build_model("resnet10", 10)
    model.load_state_dict(model_state(5))
    direct = evaluate_model(
        model, make_loader(data, held, train=False, batch_size=256, seed=0), torch.device("cpu")
    )
    assert m["eval-accuracy"] == pytest.approx(direct["accuracy"])
    assert m["eval-loss"] == pytest.approx(direct["loss"], rel=1e-5)


def test_with_a_hold_out_the_teacher_sees_and_trains_against_the_training_part_only(tmp_path: Path) -> None:
    rc = run_config(tmp_path, fraction_evaluate=1.0, evaluate_holdout=0.3, diffusion__projection="random")
    info = call("query.setup", setup_msg(True), context(rc, 0)).content["info"]
    assert info["num-examples"] == 7 and sum(info["label-counts"]) == 7  # the 10 less the 3 held out
    assert info["teacher-cache-misses"] == 7  # the 3 held-out images never go through the teacher
    m = call("train", train_msg(1), context(rc, 0)).content["metrics"]
    assert m["teacher-cache-misses"] == 0 and m["num-examples"] == 7.0  # the same 7, cached by id
    cfg, node = load_config(rc), load_node_config({"partition-id": 0, "num-partitions": N_PARTS})
    train_ids, held = ds.client_split(cfg, node)[1], ds.client_holdout(cfg, node)[1]
    targets, _ = next(reversed(tg.PREPARED.items.values()))  # the targets this train message used
    assert (targets.rows[torch.as_tensor(train_ids)] >= 0).all()
    assert all(int(i) >= len(targets.rows) or targets.rows[int(i)] == -1 for i in held)


def test_evaluate_without_a_hold_out_fails_saying_so(teacher_cache: Path) -> None:
    msg = Message(content=train_msg(1), message_type="evaluate", dst_node_id=1)
    with pytest.raises(ValueError, match="evaluate message, but evaluate-holdout = 0"):
        client_app.app(msg, context(run_config(teacher_cache), 0))


# --------------------------------------------------------------------------- model-conditioned targets


def test_global_model_condition_reports_its_cost(teacher_cache: Path, basis) -> None:
    rc = run_config(teacher_cache, diffusion__condition="global-model")
    m = call("train", train_msg(1, basis), context(rc, 0)).content["metrics"]
    assert m["condition-seconds"] > 0
    assert m["train-tdcl"] > 0 and math.isfinite(m["train-tdcl"])


def test_conditioned_reps_depend_on_the_global_model(teacher_cache: Path, basis) -> None:
    cfg = load_config(run_config(teacher_cache, diffusion__condition="global-model"))
    data, ids = ds.client_split(cfg, load_node_config({"partition-id": 0, "num-partitions": N_PARTS}))
    ids = ids[:4]  # 4 images x 10 class prompts: keeps the UNet work small
    p = tg.plan(cfg, teacher_spec(cfg, teacher_cache), data, ids)
    features = p.features
    pooled, _ = pooled_features(features, ids)
    static, _ = tg.build_targets(p, pooled, basis)
    out = {}
    for seed in (0, 1):
        model = build_model("resnet10", 10)
        model.load_state_dict(model_state(seed))
        out[seed] = conditioned_reps(features, ids, static.prompt_reps, basis, model, torch.device("cpu"))
    a, b = out[0], out[1]
    assert a.shape == static.prompt_reps.shape == (4, 10, 512)
    scale = float(static.prompt_reps.abs().mean())
    # far beyond the float16 rounding of the cached static features
    assert float((a - static.prompt_reps).abs().mean()) > 1e-2 * scale
    assert float((a - b).abs().mean()) > 1e-2 * scale  # another model, other reps
    assert torch.isfinite(a).all()
    no_tdcl = static.prompt_reps[:, :0]  # no class prompt contrasted: nothing to recompute
    assert conditioned_reps(features, ids, no_tdcl, basis, model, torch.device("cpu")) is no_tdcl

    # The images' VAE latents were encoded once: a later round re-encodes nothing, same numbers.
    feat = featurizer(features.spec)
    assert {int(i) for i in ids} <= set(th._LATENTS[th._latent_key(features.spec, data)])  # others add more

    def no_encode(images):
        raise AssertionError("VAE encode called again for the same images")

    feat.encode, model = no_encode, build_model("resnet10", 10)
    model.load_state_dict(model_state(0))
    try:
        again = conditioned_reps(features, ids, static.prompt_reps, basis, model, torch.device("cpu"))
    finally:
        del feat.encode
    assert torch.equal(again, a)


# --------------------------------------------------------------------------- errors


def _data_calls() -> int:
    info = ds._load_train_cached.cache_info()
    return info.hits + info.misses


@pytest.mark.parametrize("kind", ["query.setup", "train", "evaluate"])
@pytest.mark.parametrize(
    "key,value", [("train.lr", -1.0), ("dataset.train-limit", "forty"), ("diffusion.projection", "pca")]
)
def test_bad_run_config_fails_naming_the_key_before_touching_data(tmp_path: Path, kind, key, value) -> None:
    rc = run_config(tmp_path)
    rc[key] = value
    content = setup_msg(True) if kind == "query.setup" else train_msg(1)
    before = _data_calls()
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        client_app.app(Message(content=content, message_type=kind, dst_node_id=1), context(rc, 0))
    assert _data_calls() == before
    assert not any(tmp_path.iterdir())


def test_a_run_config_is_loaded_once_per_process_keyed_by_every_value_and_its_type(tmp_path: Path) -> None:
    """The handlers' config is built once per run config (a simulation actor answers thousands of
    setup queries of one run), never served for another config: a changed value, the same value
    of another type (True / 1 / 1.0), or another home folder is loaded again; a refused one is
    refused every time."""
    key = config_loader._config_key
    rc = run_config(tmp_path)
    cfg = config_loader.process_config(rc)
    assert cfg == load_config(rc)
    assert config_loader.process_config(dict(rc)) is cfg
    lr = {**rc, "train.lr": rc["train.lr"] * 2}
    assert config_loader.process_config(lr).train.lr == rc["train.lr"] * 2
    assert key({"k": True}) != key({"k": 1}) and key({"k": 1}) != key({"k": 1.0})
    elsewhere = config_loader._process_config(key(rc), str(tmp_path / "home"))
    assert elsewhere is not cfg and elsewhere == cfg
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"train\.lr"):
            config_loader.process_config({**rc, "train.lr": -1.0})


def test_bad_node_config_fails_naming_the_key(tmp_path: Path) -> None:
    ctx = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 4, "num-partitions": 4},
        state=RecordDict(),
        run_config=run_config(tmp_path),
    )
    before = _data_calls()
    with pytest.raises(ConfigError, match="partition-id"):
        client_app.app(Message(content=train_msg(1), message_type="train", dst_node_id=1), ctx)
    assert _data_calls() == before


@pytest.mark.parametrize(
    ("node_config", "fragment"),
    [
        (
            {"partition-id": 0, "num-partitions": 4, "data_dir": "/x"},
            r"unknown node config key\(s\) \['data_dir'\]",
        ),
        (
            {"partition-id": 0, "num-partitions": 4, "cache-dir": "FILE"},
            "cache-dir .*= '.*FILE' is not a folder",
        ),
    ],
)
def test_node_setup_refuses_typos_and_unusable_cache_dirs(tmp_path: Path, node_config, fragment) -> None:
    (tmp_path / "FILE").write_text("x")
    node_config = {k: str(tmp_path / v) if v == "FILE" else v for k, v in node_config.items()}
    ctx = Context(
        run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=run_config(tmp_path)
    )
    with pytest.raises((ConfigError, OSError), match=fragment):
        client_app.app(Message(content=setup_msg(False), message_type="query.setup", dst_node_id=1), ctx)


def test_federated_pca_without_a_basis_fails_clearly(teacher_cache: Path, setup_replies) -> None:
    rc = run_config(teacher_cache)
    with pytest.raises(ValueError, match="federated-pca.*basis"):
        client_app.app(Message(content=train_msg(1), message_type="train", dst_node_id=1), context(rc, 0))


@pytest.mark.parametrize("kind", ["train", "evaluate"])
def test_arrays_that_do_not_match_the_model_are_refused(tmp_path: Path, kind) -> None:
    rc = run_config(tmp_path, method="fedavg", fraction_evaluate=1.0, evaluate_holdout=0.3)
    renamed = {f"module.{k}": v for k, v in model_state().items() if not k.endswith("num_batches_tracked")}
    content = RecordDict({"arrays": ArrayRecord(renamed), "config": ConfigRecord({"server-round": 1})})
    with pytest.raises(ValueError, match="do not match"):
        client_app.app(Message(content=content, message_type=kind, dst_node_id=1), context(rc, 0))


def test_moon_node_keeps_its_previous_model_and_always_reports_the_term(tmp_path: Path) -> None:
    from feddifrc_app.methods import moon

    state = RecordDict()
    rc = run_config(tmp_path, method="moon", train__batch_size=5)
    ctx, sent = context(rc, 0, state), moon.train_config(load_config(rc))  # the server half's keys
    first = call("train", train_msg(1, **sent), ctx).content["metrics"]
    assert first["train-moon"] == 0.0 and moon.PREVIOUS in state  # no previous model yet: CE only
    second = call("train", train_msg(2, seed=1, **sent), ctx).content["metrics"]
    assert second["train-moon"] > 0  # now the global and the previous local model differ


def test_scaffold_node_sends_its_control_change_and_keeps_c_i_until_confirmed(tmp_path: Path) -> None:
    from flwr.app import ArrayRecord

    from feddifrc_app.methods import fednova, scaffold

    state = RecordDict()
    rc = run_config(tmp_path, method="fedavg", strategy__name="scaffold", train__batch_size=5)
    msg = train_msg(1)
    msg[scaffold.CONTROL] = ArrayRecord({})  # round 1: c = 0
    msg["config"][scaffold.ACCEPTED] = 0  # no delta c_i of this node in c yet
    reply = call("train", msg, context(rc, 0, state)).content
    steps = int(reply["metrics"]["local-steps"])
    assert steps == 2  # 10 images in batches of 5
    name = "layer1.conv1.weight"
    x, y = model_state(0)[name], reply["arrays"][name].numpy()
    # c = c_i = 0: delta c_i = c_i+ = (x - y) / (a_K lr), a_K the momentum-effective step count
    want = (x.numpy() - y) / (fednova.normalising_factor(steps, 0.9) * 0.05)
    np.testing.assert_allclose(reply[scaffold.DELTA][name].numpy(), want, rtol=1e-4, atol=1e-6)
    # c_i+ waits for the server's word (scaffold.confirmed_control) before it is this node's c_i
    assert scaffold.OWN not in state and state[scaffold.PENDING_ROUND]["round"] == 1
    np.testing.assert_allclose(state[scaffold.PENDING][name].numpy(), want, rtol=1e-4, atol=1e-6)
