"""TDCL-anchors (methods/feddifrc/targets.py, projection.py; loss.tdcl-targets = "anchors"): the
class-prompt means of the fused targets, from the nodes' per-prompt sums, shipped by the server
half and replacing every image's TDCL targets on the node."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_config
from flwr.app import ConfigRecord, Message, RecordDict

from feddifrc_app.casting import ConfigError
from feddifrc_app.config import load_node_config
from feddifrc_app.data.registry import load_dataset
from feddifrc_app.files import write_json
from feddifrc_app.halves import SETUP_WORK, Node
from feddifrc_app.methods.feddifrc import node as node_half
from feddifrc_app.methods.feddifrc import targets as tg
from feddifrc_app.methods.feddifrc.projection import (
    ANCHORS,
    BASIS,
    STATS,
    Basis,
    class_anchors,
    fuse,
    prompt_sums,
)
from feddifrc_app.methods.feddifrc.server import FedDifRCServer
from feddifrc_app.methods.feddifrc.targets import TeacherTargets, target_rows
from feddifrc_app.methods.feddifrc.teacher import teacher_spec
from feddifrc_app.outputs import RunDir
from feddifrc_app.records import record_to_arrays
from feddifrc_app.results import Results

# One block of 2 channels, mean (1, 0), a basis that swaps the channels: fused = (x - m) @ SWAP.
BASIS_1 = Basis(
    "federated-pca",
    (1,),
    (np.array([1.0, 0.0], np.float32),),
    (np.array([[0.0, 1.0], [1.0, 0.0]], np.float32),),
)
# Images x (2 class prompts + the NDCR prompt) x 2 channels, held by two nodes.
NODE_A = np.array([[[1, 2], [3, 4], [9, 9]], [[3, 0], [5, 8], [9, 9]]], dtype=np.float32)
NODE_B = np.array([[[2, 4], [1, 0], [9, 9]]], dtype=np.float32)


def test_the_anchors_are_the_class_prompt_means_of_the_fused_rows_by_hand():
    sums = [prompt_sums({1: NODE_A}, 2), prompt_sums({1: NODE_B}, 2)]
    assert sums[0]["anchors.count"].tolist() == [2]
    assert sums[0]["anchors.1.sum"].tolist() == [[4, 2], [8, 12]]  # the NDCR prompt is not summed
    # prompt 0: mean (2, 2) - (1, 0) = (1, 2), swapped (2, 1); prompt 1: mean (3, 4) -> (2, 4) -> (4, 2)
    anchors = class_anchors(sums, BASIS_1)
    assert anchors.dtype == np.float32 and anchors.tolist() == [[2, 1], [4, 2]]
    # = the mean over all three images of their fused rows
    every = fuse({1: np.concatenate([NODE_A, NODE_B])}, BASIS_1)[:, :2]
    assert np.array_equal(every.mean(axis=0), anchors)
    with pytest.raises(ValueError, match="lacks the per-prompt sums"):
        class_anchors([sums[0], {}], BASIS_1)


def test_anchored_targets_are_the_same_for_every_image_and_keep_the_ndcr_target():
    ids = np.array([4, 1, 7])
    reps, ndcr = torch.randn(3, 2, 2), torch.randn(3, 2)
    own = TeacherTargets(rows=target_rows(ids), prompt_reps=reps, ndcr=ndcr)
    anchors = torch.tensor([[2.0, 1.0], [4.0, 2.0]])
    t = own.anchored(anchors)
    got, got_ndcr = t.take(torch.tensor([7, 4, 1, 7]))
    assert torch.equal(got, anchors.expand(4, 2, 2))  # whatever the image or its class
    assert torch.equal(got_ndcr, ndcr[[2, 0, 1, 2]])
    assert t.prompt_reps.stride(0) == 0  # a view of the (K, D) anchors, not n copies
    with pytest.raises(ValueError, match=r"anchors have shape \(3, 2\).*\(K, D\) = \(2, 2\)"):
        own.anchored(torch.zeros(3, 2))


def _node(cfg, data, ids) -> Node:
    config = load_node_config({"partition-id": 0, "num-partitions": 2})
    return Node(cfg, data, ids, torch.device("cpu"), 0, RecordDict(), config=config)


def _message(kind: str, content: dict) -> Message:
    return Message(RecordDict(content), dst_node_id=1, message_type=kind)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """One feature cache for this file (the features do not depend on loss.*)."""
    return tmp_path_factory.mktemp("anchors") / "cache"


def test_federated_anchors_equal_the_centralised_ones_and_reach_every_image(cache):
    """Two nodes' setup replies -> the server's anchors -> a train message -> the node's TDCL targets:
    the anchors equal the class-prompt means of the fused rows of all the nodes' images at once."""
    over = {"dataset.train-limit": 40, "diffusion.device": "cpu", "diffusion.cache-dir": str(cache)}
    cfg = make_config(**over, **{"loss.tdcl-targets": "anchors", "loss.ndcr-weight": 0.0})
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    parts = [np.arange(0, 7), np.arange(7, 12)]
    nodes = [_node(cfg, data, ids) for ids in parts]
    ask = _message("query", {"config": ConfigRecord({SETUP_WORK: True})})
    setup = {}
    for i, n in enumerate(nodes):
        info = ConfigRecord()
        setup[10 + i] = RecordDict({"info": info, **node_half.setup_reply(ask, n, info)})
    half, results = FedDifRCServer(cfg), Results(rounds=[], resumed=[])
    half.after_setup(setup, {10: 0, 11: 1}, results)
    sent = half.train_records()
    assert list(sent) == [BASIS, ANCHORS]
    assert results.extra["basis"]["anchors"] == {"prompts": 10, "width": 512}

    basis = Basis.from_arrays(record_to_arrays(sent[BASIS]))
    p = tg.plan(cfg, teacher_spec(cfg, cache), data, np.arange(12))
    pooled, _ = tg.pooled_features(p.features, p.ids)
    central = fuse(pooled, basis)[:, :10].mean(axis=0)  # (K, D), every image at once
    anchors = record_to_arrays(sent[ANCHORS])[ANCHORS]
    np.testing.assert_allclose(anchors, central, rtol=1e-5, atol=1e-5)
    assert np.abs(central).max() > 0.1  # not trivially zero

    tg.PREPARED.items.clear()
    half_b = node_half.node_half(_message("train", {"config": ConfigRecord(), **sent}), nodes[1])
    half_b.start(torch.nn.Linear(1, 1))
    reps, _ = half_b.targets.take(torch.as_tensor(parts[1]))
    assert torch.equal(reps, torch.from_numpy(anchors).expand(5, -1, -1))
    tg.PREPARED.items.clear()

    # A resumed run continues with the checkpoint's anchors (and asks the nodes for nothing).
    resumed = FedDifRCServer(cfg)
    resumed.restore(half.state())
    assert not resumed.setup_work()
    assert np.array_equal(record_to_arrays(resumed.train_records()[ANCHORS])[ANCHORS], anchors)
    # A train message without them is refused before any teacher work.
    with pytest.raises(ValueError, match="tdcl-targets = 'anchors' but the server sent no anchors"):
        node_half.node_half(_message("train", {"config": ConfigRecord(), BASIS: sent[BASIS]}), nodes[1])
    assert STATS in setup[10] and "anchors.count" in record_to_arrays(setup[10][STATS])


def test_the_default_sends_no_sums_and_no_anchors(cache):
    over = {"dataset.train-limit": 40, "diffusion.device": "cpu", "diffusion.cache-dir": str(cache)}
    cfg = make_config(**over)
    assert cfg.loss.tdcl_targets == "image"
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    info = ConfigRecord()
    reply = node_half.setup_reply(
        _message("query", {"config": ConfigRecord({SETUP_WORK: True})}), _node(cfg, data, np.arange(12)), info
    )
    assert not [k for k in record_to_arrays(reply[STATS]) if k.startswith("anchors")]
    half = FedDifRCServer(cfg)
    half.after_setup({10: RecordDict({"info": info, **reply})}, {10: 0}, Results(rounds=[], resumed=[]))
    assert list(half.train_records()) == [BASIS] and list(half.state()) == ["basis"]


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"diffusion.projection": "local-pca"}, "needs diffusion.projection = 'federated-pca'"),
        ({"diffusion.projection": "random"}, "needs diffusion.projection = 'federated-pca'"),
        ({"diffusion.projection": "per-batch"}, "needs diffusion.projection = 'federated-pca'"),
        ({"method": "feddifrc-ssl"}, "class-prompt targets of method 'feddifrc' \\(not 'feddifrc-ssl'\\)"),
        ({"method": "fedavg"}, "class-prompt targets of method 'feddifrc' \\(not 'fedavg'\\)"),
        ({"diffusion.condition": "global-model"}, "diffusion.condition = 'global-model' recomputes"),
        ({"loss.tdcl-weight": 0.0}, "loss.tdcl-weight = 0 turns TDCL off"),
    ],
)
def test_anchors_are_refused_where_they_cannot_be_exact(over, why):
    with pytest.raises(ConfigError, match=f"'loss.tdcl-targets' = 'anchors' is invalid: .*{why}"):
        make_config(**{"loss.tdcl-targets": "anchors", **over})
    make_config(**over)  # the same config without the anchors loads


def test_a_run_written_before_the_key_resumes_with_image_targets_and_refuses_anchors(tmp_path):
    """config_changes.KEYS_ADDED_SINCE: such a run computed with every image's own targets."""
    cfg = make_config(outputs_dir=str(tmp_path), run_name="old")
    run = RunDir.for_config(cfg, run_id=1)
    flat = cfg.to_flat()
    del flat["loss.tdcl-targets"]
    write_json(run.path / "config.json", flat)
    assert RunDir.for_config(make_config(resume_from=str(run.path)), 2).path == run.path
    with pytest.raises(ValueError, match=r"loss.tdcl-targets: 'image' -> 'anchors'"):
        RunDir.for_config(make_config(resume_from=str(run.path), **{"loss.tdcl-targets": "anchors"}), 2)
