"""strategy.dp: Flower's DP wrappers around any strategy, the client mod, the uniform weights
under DP and the (epsilon, delta) accountant, measured."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
import torch
from conftest import default_run_config, make_config
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS, compute_epsilon
from fakes import RecordingGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.differential_privacy import compute_adaptive_noise_params

from feddifrc_app import privacy, privacy_accounting
from feddifrc_app.config import ConfigError
from feddifrc_app.federation import POPULATION
from feddifrc_app.privacy import Release
from feddifrc_app.privacy_accounting import account_round, accounted_multiplier, epsilon
from feddifrc_app.results import Results, RoundRow
from feddifrc_app.server_app import private_settings
from feddifrc_app.strategy import build_strategy, load_strategy_state, required_metrics, strategy_state
from feddifrc_app.tools.report import privacy_line


def _nodes(n: int) -> RecordingGrid:
    """Flower's public Grid with nodes 1..n (the strategies read only get_node_ids)."""
    return RecordingGrid(list(range(1, n + 1)))


def _reply(msg: Message, w: np.ndarray, examples: float = 1.0) -> Message:
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": torch.from_numpy(w)}),
            "metrics": MetricRecord({"num-examples": examples, "train-ce": float(w[0])}),
        }
    )
    return Message(content, reply_to=msg)


def _round(cfg_overrides: dict, x: np.ndarray, ys: list[np.ndarray], n_grid: int):
    """One server-side round: (the aggregate, the replies as the wrapped strategy saw them)."""
    s = build_strategy(make_config(**cfg_overrides))
    msgs = list(
        s.configure_train(1, ArrayRecord({"w": torch.from_numpy(x)}), ConfigRecord({}), _nodes(n_grid))
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
    msgs = list(s.configure_train(1, ArrayRecord({"w": torch.from_numpy(x)}), ConfigRecord({}), _nodes(2)))
    s.aggregate_train(1, [_reply(m, np.array([3.0, 4.0], dtype=np.float32)) for m in msgs])  # both clipped
    # Flower's rule, C <- C exp(-lr (clipped fraction - target)): both clipped (noise-free count),
    # so C = 0.1 exp(-0.2 x 0.5). It SHRINKS: Andrew et al. count the unclipped updates there (privacy.md).
    assert s.clipping_norm == pytest.approx(0.1 * np.exp(-0.2 * 0.5))
    state = strategy_state(s)
    assert set(state) >= {"clipping_norm", "m_t", "v_t"}  # the wrapper's and FedAdam's
    t = build_strategy(make_config(**dp))
    load_strategy_state(t, state)
    assert t.clipping_norm == pytest.approx(s.clipping_norm)
    np.testing.assert_array_equal(t.strategy.m_t["w"], s.strategy.m_t["w"])


@pytest.mark.parametrize("mode", ["server-adaptive", "client-adaptive"])
def test_adaptive_noise_is_scaled_by_the_norm_the_round_clipped_to(mode):
    # Flower moves the clipping norm C_t -> C_{t+1} before it adds the noise; the noise must be
    # z_u C_t / m (Andrew et al.), what the accountant assumes. z = 1, count std 10, 4 nodes:
    # z_u = (1 - 1/400)^-1/2; C_0 = 0.1, so std 0.025 z_u, whatever the noisy count made of C_1.
    dp = {
        "method": "fedavg",
        "strategy__dp": mode,
        "strategy__dp_noise_multiplier": 1.0,
        "strategy__dp_clipped_count_stddev": 10.0,
    }
    s = build_strategy(make_config(**dp))
    x = np.zeros(200_000, dtype=np.float32)
    msgs = list(s.configure_train(1, ArrayRecord({"w": torch.from_numpy(x)}), ConfigRecord({}), _nodes(4)))
    tiny = x.copy()
    tiny[0] = 1e-6  # not clipped (norm bit 0); not exactly zero (Flower divides by the norm)
    replies = [_reply(m, tiny.copy()) for m in msgs]
    for r in replies:
        r.content["metrics"]["norm_bit"] = 0.0  # what the client mod reports for it
    np.random.seed(3)
    agg, _ = s.aggregate_train(1, replies)
    z_u = (1 - 1 / 400) ** -0.5
    assert s.noise_multiplier == pytest.approx(z_u)
    assert abs(np.log(s.clipping_norm / 0.1)) > 0.1  # the norm moved by more than 10%
    assert float(agg["w"].numpy().std()) == pytest.approx(0.025 * z_u, rel=0.01)


@pytest.mark.parametrize("name", ["fedavgm", "fedadam"])
def test_server_optimisers_step_on_the_noisy_mean(name):
    # Zero updates, noise std z C / m = 2 x 1.5 / 4 = 0.75. Flower's wrapper would add it after
    # the server step, so FedAvgM's momentum and FedAdam's moments would see the noiseless mean
    # (about 0) and keep it; here they see the noisy mean, and nothing is added after the step.
    dp = {
        "method": "fedavg",
        "strategy__name": name,
        "strategy__dp": "server-fixed",
        "strategy__dp_clipping_norm": 1.5,
        "strategy__dp_noise_multiplier": 2.0,
    }
    x = np.zeros(200_000, dtype=np.float32)
    tiny = x.copy()
    tiny[0] = 1e-6
    np.random.seed(0)
    s = build_strategy(make_config(**dp))
    assert isinstance(s.strategy, privacy.NoisyMean) and type(s.strategy).__name__.lower() == name
    msgs = list(s.configure_train(1, ArrayRecord({"w": torch.from_numpy(x)}), ConfigRecord({}), _nodes(4)))
    out = s.aggregate_train(1, [_reply(m, tiny.copy()) for m in msgs])[0]["w"].numpy()
    if name == "fedavgm":  # first round: momentum = x - noisy mean; x <- x - 1.0 x momentum
        noise = -s.strategy.momentum_vector[0]
        np.testing.assert_allclose(out, x + noise, atol=1e-6)  # no noise after the step
    else:  # m_1 = (1 - beta_1)(noisy mean - x): the noise, scaled
        noise = s.strategy.m_t["w"] / (1 - 0.9)
        v = s.strategy.v_t["w"]
        eta = 0.01 * np.sqrt(1 - 0.99**2) / (1 - 0.9**2)  # Flower's bias-corrected step at round 1
        np.testing.assert_allclose(
            out, x + eta * s.strategy.m_t["w"] / (np.sqrt(v) + 0.001), rtol=1e-4, atol=1e-7
        )
    assert float(noise.std()) == pytest.approx(0.75, rel=0.01)
    assert privacy_accounting.not_accounted(make_config(**dp)) == ""  # accounted as the uniform mean


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


def test_flowers_dp_arithmetic_errors_name_the_dp_keys_and_the_nodes_own_errors_pass():
    x = np.ones(4, dtype=np.float32)
    dp = {"strategy__dp": "server-fixed", "strategy__dp_noise_multiplier": 0.0, "min_nodes": 2}
    with pytest.raises(privacy.DPError) as e:  # an update of norm 0: Flower divides by it
        _round(dp, x, [x.copy(), x + 1], 2)
    assert str(e.value).startswith(
        "round 1: Flower's differential privacy failed (ZeroDivisionError: float division by zero)"
    )
    assert str(e.value).endswith(
        "check strategy.name = 'fedavg', strategy.dp = 'server-fixed', strategy.dp-noise-multiplier = 0.0, "
        "strategy.dp-clipping-norm = 10.0"
    )
    ctx = _context(strategy__dp="client-fixed")
    still = lambda m, c: _reply(m, np.zeros(2, dtype=np.float32))  # noqa: E731 - trains to w = x
    with pytest.raises(privacy.DPError, match=r"^this node's clipping: Flower's differential privacy"):
        privacy.client_mod(_train_msg(clipping_norm=1.0), ctx, still)

    def raising(m, c):  # the ClientApp's own error is not DP's
        raise ZeroDivisionError("in training")

    with pytest.raises(ZeroDivisionError, match="in training"):
        privacy.client_mod(_train_msg(clipping_norm=1.0), ctx, raising)


def test_client_wrappers_ask_for_clipping_and_the_adaptive_one_reads_the_norm_bit():
    for mode in ("client-fixed", "client-adaptive"):
        cfg = make_config(method="fedavg", strategy__dp=mode, strategy__dp_noise_multiplier=0.0)
        s = build_strategy(cfg)
        (msg,) = s.configure_train(1, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), _nodes(1))
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
        (
            {"strategy__dp": "server-adaptive", "strategy__dp_clipped_count_stddev": 0.5},
            r"'strategy.dp-clipped-count-stddev' = 0.5: .*below 2 x that count noise \(1\); raise",
        ),
    ],
)
def test_dp_settings_that_cannot_work_fail_at_load(overrides, match):
    overrides = {"strategy__dp": "server-fixed", "method": "fedavg"} | overrides
    with pytest.raises(ConfigError, match=match):
        make_config(**overrides)


@pytest.mark.parametrize(
    "mode", privacy_modes := ["server-fixed", "server-adaptive", "client-fixed", "client-adaptive"]
)
def test_every_dp_mode_loads_with_the_other_keys_at_their_defaults(mode):
    cfg = make_config(strategy__dp=mode)  # FedDifRC with its federated-PCA basis, min-nodes 1
    assert cfg.method == "feddifrc" and cfg.diffusion.projection == "federated-pca"
    s = build_strategy(cfg)
    if mode.endswith("adaptive"):  # 0 derives max(m / 20, z) = 1: Flower's z_u = (1 - 1/4)^-1/2
        assert s.clipped_count_stddev == 1.0 and s.noise_multiplier == pytest.approx((4 / 3) ** 0.5)
        s.configure_train(1, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), _nodes(40))
        assert s.clipped_count_stddev == 2.0  # 40 / 20, above z: Flower's own default
        assert s.noise_multiplier == pytest.approx((1 - 1 / 16) ** -0.5)


def test_a_client_mode_clips_the_update_and_hands_the_basis_to_the_clientapp():
    msg = _train_msg(clipping_norm=1.0)
    msg.content["basis"] = ArrayRecord({"b": torch.ones(3)})
    seen = {}

    def node(m: Message, c: Context) -> Message:
        seen["basis"] = m.content["basis"]["b"].numpy().tolist()
        return _node(m, c)

    out = privacy.client_mod(msg, _context(strategy__dp="client-fixed"), node)
    assert seen["basis"] == [1.0, 1.0, 1.0]
    np.testing.assert_allclose(out.content["arrays"]["w"].numpy(), [0.6, 0.8], rtol=1e-6)


def test_noise_far_above_what_a_model_absorbs_is_warned_and_recorded_in_results(tmp_path):
    """m is the nodes a round samples of those connected (the noise is calibrated to them), not
    min-nodes: the quickstart's 2 nodes at the default min-nodes = 1 give 10 / 2 = 5, not 10."""
    from feddifrc_app.results import Results
    from feddifrc_app.server_app import warn_noise

    (warn,) = [privacy.noise_warning(make_config(strategy__dp="server-fixed"), nodes=2)]
    assert warn.startswith(
        "strategy.dp = 'server-fixed': DP noise of std 5 per coordinate per round (strategy.dp-noise-"
        "multiplier 1 x strategy.dp-clipping-norm 10 / 2 sampled node(s)) is far above 0.01"
    )
    adaptive = make_config(strategy__dp="server-adaptive")  # 1 x 0.1 / 20 = 0.005
    assert privacy.noise_warning(adaptive, nodes=20) is None
    assert "0.05 per coordinate" in privacy.noise_warning(adaptive, nodes=2)
    half = make_config(strategy__dp="client-adaptive", fraction_train=0.5)  # 8 of 16 sampled
    assert "0.0125 per coordinate" in privacy.noise_warning(half, nodes=16)
    assert privacy.noise_warning(make_config(), nodes=2) is None  # no DP
    results = Results()
    for _ in range(2):  # a resumed run is warned at setup again: recorded once
        warn_noise(make_config(strategy__dp="server-fixed"), 2, results)
    assert results.warnings == [warn]
    assert Results.from_json(results.to_json()).warnings == [warn]
    warn_noise(adaptive, 20, none := Results())
    assert none.warnings is None and "warnings" not in none.to_json()


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


# --------------------------------------------------------------------------- uniform weights


@pytest.mark.parametrize("name", ["fedavg", "fedadam", "multikrum"])
def test_under_dp_replies_weigh_the_same_whatever_their_examples(name):
    # Two nodes, 1 and 3 examples, no noise, no clipping (updates of norm 1 < C = 10): without DP
    # FedAvg is example-weighted (1/4, 3/4); under DP it is the plain mean Flower's noise assumes.
    x = np.zeros(2, dtype=np.float32)
    ys = [np.array([1.0, 0.0], dtype=np.float32), np.array([0.0, 1.0], dtype=np.float32)]
    extra = {"strategy__num_nodes_to_select": 2, "min_nodes": 2} if name == "multikrum" else {}
    for dp in ("none", "server-fixed", "client-fixed"):
        cfg = make_config(
            method="fedavg", strategy__name=name, strategy__dp=dp, strategy__dp_noise_multiplier=0.0, **extra
        )
        s = build_strategy(cfg)
        # The round loop drew the 2 from 7 nodes: N travels in the train config (federation.round_config).
        config = ConfigRecord({POPULATION: 7})
        msgs = list(s.configure_train(1, ArrayRecord({"w": torch.from_numpy(x)}), config, _nodes(2)))
        replies = [_reply(m, y, n) for m, y, n in zip(msgs, ys, (1.0, 3.0), strict=True)]
        arrays, metrics = s.aggregate_train(1, replies)
        if name == "fedavg":
            want = [0.25, 0.75] if dp == "none" else [0.5, 0.5]
            np.testing.assert_allclose(arrays["w"].numpy(), want, rtol=1e-6)
            assert metrics["train-ce"] == pytest.approx(want[0])  # the metrics weigh the same way
        if name == "multikrum":  # both selected: their mean, uniform under DP
            np.testing.assert_allclose(arrays["w"].numpy(), [0.25, 0.75] if dp == "none" else [0.5, 0.5])
        if dp != "none":
            assert privacy.release_of(s) == Release(7, 2, 2, 0.0, None)  # N from the config, m, m', z


def test_under_dp_federated_evaluation_stays_example_weighted():
    cfg = make_config(
        method="fedavg", strategy__dp="server-fixed", fraction_evaluate=1.0, evaluate_holdout=0.1
    )
    s = build_strategy(cfg)
    (msg,) = s.configure_evaluate(1, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), _nodes(1))
    replies = [
        Message(RecordDict({"metrics": MetricRecord({"num-examples": n, "eval-accuracy": a})}), reply_to=msg)
        for n, a in ((1.0, 0.0), (3.0, 1.0))
    ]
    assert s.aggregate_evaluate(1, replies)["eval-accuracy"] == pytest.approx(0.75)


# --------------------------------------------------------------------------- the accountant


def test_without_subsampling_the_epsilon_is_the_closed_form_gaussian_composition():
    # m = N: T rounds of the Gaussian mechanism with multiplier sigma have RDP alpha T / (2 sigma^2).
    # Replace-one: the mean of m clipped updates moves by 2C / m, Flower's std is z C / m, so
    # sigma = z / 2 (z = 2 here: sigma = 1).
    z, n, delta = 2.0, 4, 1e-5
    sigma = accounted_multiplier("fedavg", Release(n, n, n, z, None))
    assert sigma == pytest.approx(z / 2)
    eps = []
    for t in range(1, 6):
        closed, _ = compute_epsilon(
            np.array(DEFAULT_RDP_ORDERS), np.array(DEFAULT_RDP_ORDERS) * t / (2 * sigma**2), delta
        )
        events = [(n, n, sigma)] * t
        assert epsilon(events, delta, amplified=False) == pytest.approx(closed, rel=1e-9)
        assert epsilon(events, delta, amplified=True) == pytest.approx(closed, rel=1e-9)  # q = 1
        eps.append(epsilon(events, delta, amplified=False))
    assert eps == sorted(eps) and len(set(eps)) == 5  # grows with every round
    # sigma = 1, delta = 1e-5: 4.73 after one round (sqrt(2 ln(1.25 / delta)) = 4.84), 12.30 after five
    assert eps[0] == pytest.approx(4.729, abs=1e-3) and eps[-1] == pytest.approx(12.302, abs=1e-3)


def test_sampling_without_replacement_is_dp_accountings_event_and_amplifies():
    events = [(10, 2, 1.0)] * 3  # 2 of 10 nodes a round, sigma = 1, three rounds
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(10, 2, dp_accounting.GaussianDpEvent(1.0)), 3)
    amplified = epsilon(events, 1e-5, amplified=True)
    assert amplified == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    # 4.67 against 9.01 for the same three rounds without amplification
    assert amplified == pytest.approx(4.673, abs=1e-3)
    assert epsilon(events, 1e-5, amplified=False) == pytest.approx(9.010, abs=1e-3)
    assert epsilon([(10, 2, 0.0)], 1e-5, amplified=True) == float("inf")  # no noise, no privacy


def test_the_accounted_multiplier_of_each_mechanism():
    z = 1.2
    # A node failed: 3 of the 4 the noise was calibrated for; the mean's sensitivity is 2C / 3.
    assert accounted_multiplier("fedprox", Release(9, 4, 3, z, None)) == pytest.approx(z * 3 / 8)
    # Krum releases one clipped update (sensitivity 2C) with Flower's std z C / m.
    assert accounted_multiplier("krum", Release(9, 4, 4, z, None)) == pytest.approx(z / 8)
    # Adaptive clipping: Flower's split of z between the update and the clipped count (std s,
    # sensitivity 1) composes back into exactly z / 2 (Andrew et al.'s split, replace-one).
    s = 1.0
    count_std, z_update = compute_adaptive_noise_params(z, 4, s)
    assert z_update > z and count_std == s
    assert accounted_multiplier("fedavg", Release(9, 4, 4, z_update, count_std)) == pytest.approx(z / 2)
    with pytest.raises(ValueError, match="not accounted"):
        accounted_multiplier("fedmedian", Release(9, 4, 4, z, None))


def _accounted(cfg, earlier: list[RoundRow], release: Release | None) -> RoundRow:
    row = RoundRow(len(earlier))
    account_round(cfg, row, earlier, release)
    return row


def test_round_keys_compose_the_earlier_rows_and_say_when_nothing_is_accounted():
    cfg = make_config(method="fedavg", strategy__dp="server-fixed", strategy__dp_noise_multiplier=2.0)
    r = Release(4, 4, 4, 2.0, None)
    first = _accounted(cfg, [RoundRow(0)], r)
    assert [k for k in first.to_json() if k not in RoundRow(1).to_json()] == [
        "dp-release",
        "epsilon",
        "epsilon-if-sample-secret",
    ]
    assert first.dp_release == {
        "population": 4,
        "sampled": 4,
        "aggregated": 4,
        "update-multiplier": 2.0,
        "count-stddev": None,
    }
    second = _accounted(cfg, [RoundRow(0), first], r)
    assert second.epsilon == pytest.approx(epsilon([(4, 4, 1.0)] * 2, 1e-5, amplified=False))
    assert second.epsilon > first.epsilon > 0
    assert second.epsilon_if_sample_secret == pytest.approx(second.epsilon)  # m = N: no amplification
    nothing = _accounted(cfg, [RoundRow(0), first], None)  # a round that released nothing
    assert nothing.dp_release is None and nothing.epsilon == first.epsilon
    assert nothing.to_json()["dp-release"] is None  # written null: the round released nothing
    median = make_config(method="fedavg", strategy__name="fedmedian", strategy__dp="server-fixed")
    assert _accounted(median, [], r) == RoundRow(0)
    assert privacy_accounting.settings(median)["accountant"] is None
    assert "fedmedian" in privacy_accounting.settings(median)["not-accounted"]


def test_results_and_report_carry_the_final_epsilon():
    cfg = make_config(method="fedavg", strategy__dp="server-fixed", strategy__dp_noise_multiplier=2.0)
    block = privacy.settings(cfg) | privacy_accounting.settings(cfg)
    assert block["delta"] == 1e-5 and block["accountant"].startswith("dp_accounting.rdp.RdpAccountant")
    assert block["weighting"].startswith("uniform")
    row = _accounted(cfg, [RoundRow(0)], Release(4, 4, 4, 2.0, None))
    line = privacy_line(Results(rounds=[RoundRow(0), row], privacy=block))
    assert f"epsilon {row.epsilon:.4g} at delta 1e-05 after round 1" in line
    median = make_config(method="fedavg", strategy__name="fedmedian", strategy__dp="server-fixed")
    blk = private_settings(median)  # what the ServerApp writes (and warns about)
    assert blk == privacy.settings(median) | privacy_accounting.settings(median)
    assert "no epsilon: strategy.name = 'fedmedian'" in privacy_line(Results(privacy=blk))
    assert private_settings(make_config()) is None  # no DP, no block
