"""strategy.dp: Flower's DP wrappers around any strategy, and the client mod, measured."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import default_run_config, make_config
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from feddifrc_app import privacy
from feddifrc_app.config import ConfigError
from feddifrc_app.strategy import build_strategy, load_strategy_state, required_metrics, strategy_state


class _Grid:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


def _reply(msg: Message, w: np.ndarray) -> Message:
    content = RecordDict(
        {"arrays": ArrayRecord({"w": torch.from_numpy(w)}), "metrics": MetricRecord({"num-examples": 1.0})}
    )
    return Message(content, reply_to=msg)


def _round(cfg_overrides: dict, x: np.ndarray, ys: list[np.ndarray], n_grid: int):
    """One server-side round: (the aggregate, the replies as the wrapped strategy saw them)."""
    s = build_strategy(make_config(**cfg_overrides))
    msgs = list(
        s.configure_train(1, ArrayRecord({"w": torch.from_numpy(x)}), ConfigRecord({}), _Grid(n_grid))
    )
    seen = []
    inner = s.strategy.aggregate_train
    s.strategy.aggregate_train = lambda rnd, replies: (seen.extend(replies), inner(rnd, replies))[1]
    arrays, _ = s.aggregate_train(1, [_reply(m, y) for m, y in zip(msgs, ys, strict=True)])
    return arrays["w"].numpy(), [r.content["arrays"]["w"].numpy() for r in seen]


def test_server_fixed_clipping_bounds_every_update_by_the_clipping_norm():
    x = np.array([1.0, 1.0, 1.0, 1.0], dtype=np.float32)
    updates = [
        np.array([0.3, 0.4, 0, 0]),
        np.array([3.0, 4.0, 0, 0]),
        np.array([0, 0, -6.0, 8.0]),
    ]  # 0.5, 5, 10
    dp = {
        "strategy__dp": "server-fixed",
        "strategy__dp_clipping_norm": 1.0,
        "strategy__dp_noise_multiplier": 0.0,
    }
    agg, seen = _round(dp | {"min_nodes": 3}, x, [(x + u).astype(np.float32) for u in updates], 3)
    norms = [float(np.linalg.norm(y - x)) for y in seen]
    assert norms == pytest.approx([0.5, 1.0, 1.0], rel=1e-6)  # each bounded by C = 1, small ones kept
    np.testing.assert_allclose(seen[1] - x, [0.6, 0.8, 0, 0], rtol=1e-6)  # direction kept
    np.testing.assert_allclose(
        agg, x + np.mean([[0.3, 0.4, 0, 0], [0.6, 0.8, 0, 0], [0, 0, -0.6, 0.8]], 0), rtol=1e-6
    )


def test_server_fixed_noise_has_the_configured_standard_deviation_measured():
    # std = noise-multiplier x clipping-norm / sampled nodes = 2 x 1.5 / 4 = 0.75, with 4 nodes
    # really sampled though min-nodes (and so Flower's start value) is 1. Zero updates: the
    # aggregate is x plus the noise alone; 200,000 draws estimate its std within 0.2%. (Not exactly
    # zero: Flower's clip divides by the update's norm.)
    x = np.zeros(200_000, dtype=np.float32)
    dp = {
        "strategy__dp": "server-fixed",
        "strategy__dp_clipping_norm": 1.5,
        "strategy__dp_noise_multiplier": 2.0,
    }
    torch.manual_seed(0)
    np.random.seed(0)
    tiny = x.copy()
    tiny[0] = 1e-6
    agg, _ = _round(dp, x, [tiny.copy() for _ in range(4)], 4)
    assert float(agg.std()) == pytest.approx(0.75, rel=0.01)
    assert abs(float(agg.mean())) < 0.01


def test_adaptive_clipping_moves_the_norm_and_it_survives_a_checkpoint():
    dp = {
        "strategy__dp": "server-adaptive",
        "strategy__dp_noise_multiplier": 0.0,
        "strategy__name": "fedadam",
    }
    x = np.zeros(2, dtype=np.float32)
    s = build_strategy(make_config(**dp))
    assert s.clipping_norm == 0.1  # Flower's initial-clipping-norm
    msgs = list(s.configure_train(1, ArrayRecord({"w": torch.from_numpy(x)}), ConfigRecord({}), _Grid(2)))
    s.aggregate_train(1, [_reply(m, np.array([3.0, 4.0], dtype=np.float32)) for m in msgs])  # both clipped
    # Flower's rule, C <- C exp(-lr (clipped fraction - target)): both clipped (noise-free count),
    # so C = 0.1 exp(-0.2 x 0.5). It SHRINKS: Andrew et al. count the unclipped updates there (README).
    assert s.clipping_norm == pytest.approx(0.1 * np.exp(-0.2 * 0.5))
    state = strategy_state(s)
    assert set(state) >= {"clipping_norm", "m_t", "v_t"}  # the wrapper's and FedAdam's
    t = build_strategy(make_config(**dp))
    load_strategy_state(t, state)
    assert t.clipping_norm == pytest.approx(s.clipping_norm)
    np.testing.assert_array_equal(t.strategy.m_t["w"], s.strategy.m_t["w"])


def _context(**overrides) -> Context:
    return Context(1, 1, {}, RecordDict(), default_run_config(method="fedavg", **overrides))


def _train_msg(**config) -> Message:
    content = RecordDict(
        {"arrays": ArrayRecord({"w": torch.zeros(2)}), "config": ConfigRecord({"server-round": 1, **config})}
    )
    return Message(content=content, message_type="train", dst_node_id=1)


def _node(msg: Message, ctx: Context) -> Message:  # the node trains to w = [3, 4]
    return _reply(msg, np.array([3.0, 4.0], dtype=np.float32))


def test_client_mod_clips_only_a_message_that_asks_for_it():
    ctx = _context(strategy__dp="client-fixed")
    plain = privacy.client_mod(_train_msg(), ctx, _node)
    assert plain.content["arrays"]["w"].numpy().tolist() == [3.0, 4.0]  # no clipping-norm: untouched
    asked = privacy.client_mod(_train_msg(clipping_norm=1.0), ctx, _node)
    np.testing.assert_allclose(asked.content["arrays"]["w"].numpy(), [0.6, 0.8], rtol=1e-6)
    adaptive = privacy.client_mod(
        _train_msg(clipping_norm=1.0),
        _context(strategy__dp="client-adaptive", strategy__dp_noise_multiplier=0.0),
        _node,
    )
    assert adaptive.content["metrics"]["norm_bit"] == 1  # the update was clipped (5 > 1)
    setup = Message(
        content=RecordDict({"config": ConfigRecord({"want-stats": False})}),
        message_type="query.setup",
        dst_node_id=1,
    )
    assert privacy.client_mod(setup, ctx, lambda m, c: "passed") == "passed"


def test_client_wrappers_ask_for_clipping_and_the_adaptive_one_reads_the_norm_bit():
    for mode in ("client-fixed", "client-adaptive"):
        cfg = make_config(method="fedavg", strategy__dp=mode, strategy__dp_noise_multiplier=0.0)
        s = build_strategy(cfg)
        (msg,) = s.configure_train(1, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), _Grid(1))
        assert msg.content["config"]["clipping_norm"] == (10.0 if mode == "client-fixed" else 0.1)
    assert required_metrics(
        make_config(method="fedavg", strategy__dp="client-adaptive", strategy__dp_noise_multiplier=0.0)
    ) == {
        "num-examples",
        "norm_bit",
    }


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"strategy__name": "scaffold"}, "scaffold.*second ArrayRecord"),
        ({"method": "fednh"}, "fednh.*second ArrayRecord"),
        ({"method": "feddifrc", "strategy__dp": "client-fixed"}, "federated-pca"),
        (
            {"strategy__dp": "server-adaptive", "min_nodes": 10},
            r"sampled nodes / 20 = 10 / 20: .*below 2 x that count noise \(1; min-nodes = 10\)",
        ),
    ],
)
def test_dp_settings_that_cannot_work_fail_at_load(overrides, match):
    overrides = {"strategy__dp": "server-fixed", "method": "fedavg"} | overrides
    with pytest.raises(ConfigError, match=match):
        make_config(**overrides)


def test_results_record_the_dp_settings():
    assert privacy.settings(make_config()) is None
    assert privacy.settings(make_config(strategy__dp="server-fixed")) == {
        "mode": "server-fixed",
        "noise-multiplier": 1.0,
        "clipping-norm": 10.0,
    }
    adaptive = privacy.settings(
        make_config(method="fedavg", strategy__dp="client-adaptive", strategy__dp_clipped_count_stddev=1.0)
    )
    assert adaptive == {
        "mode": "client-adaptive",
        "noise-multiplier": 1.0,
        "initial-clipping-norm": 0.1,
        "target-clipped-quantile": 0.5,
        "clip-norm-lr": 0.2,
        "clipped-count-stddev": 1.0,
    }
