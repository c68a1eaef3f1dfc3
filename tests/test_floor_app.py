"""benchmarks/floor_app, Flower's floor for benchmarks/deploy_vs_sim.py: its update must cost what
a real one costs to move, i.e. be as many distinct objects in Flower's content-addressed store."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "floor_app"))

from floor_app import client  # noqa: E402

# Equal arrays of one shape, as a zero-initialised model (or BN's ones and zeros) has them.
SHAPES = [(3, 3, 4, 4), (3, 3, 4, 4), (16,), (16,), (16,), (10, 16)]


@pytest.mark.parametrize("sgd_step", [False, True], ids=["floor", "training-floor"])
def test_the_floor_update_is_one_new_object_per_array(sgd_step: bool) -> None:
    received = ArrayRecord({f"a{i}": Array(np.zeros(s, dtype=np.float32)) for i, s in enumerate(SHAPES)})
    assert len({a.object_id for a in received.values()}) == 3  # what Flower would move of these
    msg = Message(
        RecordDict({"arrays": received, "config": ConfigRecord({})}), message_type="train", dst_node_id=1
    )
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={"sgd-step": sgd_step})

    reply = client.train(msg, ctx).content["arrays"]

    assert list(reply) == list(received)
    assert [a.numpy().shape for a in reply.values()] == SHAPES
    assert all(a.numpy().dtype == np.float32 for a in reply.values())
    ids = {a.object_id for a in reply.values()}
    assert len(ids) == len(SHAPES)  # every array travels
    assert not ids & {a.object_id for a in received.values()}  # none is the global model's
    if sgd_step:  # one SGD step at lr 0.1 from zeros with a standard normal gradient: std 0.1
        step = np.concatenate([a.numpy().ravel() for a in reply.values()])
        assert 0.07 < step.std() < 0.13
