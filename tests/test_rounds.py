"""The round loop judges a run by its model: a non-finite aggregate or central loss is a divergence
named after its cause, and a global model that never changes fails the run."""

from __future__ import annotations

import json
import math

import pytest
from conftest import make_config
from fakes import central_scores, round_loop, shifted
from flwr.app import MetricRecord

from feddifrc_app.outputs import RunDir
from feddifrc_app.results import Results, RoundRow
from feddifrc_app.rounds import CHANCE_MARGIN, NO_LEARNING_ROUNDS, FrozenModelError, no_learning
from feddifrc_app.train import DivergedError


def _on_disk(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "results.json").read_text())


def test_a_non_finite_aggregate_of_finite_replies_names_the_strategy_keys_not_train_lr(tmp_path) -> None:
    loop = round_loop(tmp_path, lambda m: central_scores(2.3), strategy__name="qfedavg", strategy__q=15.0)
    sent = loop.arrays
    loop.strategy.aggregate_train = lambda rnd, replies: (shifted(sent, math.inf), MetricRecord())
    with pytest.raises(DivergedError) as e:
        loop.run_all()
    first = (
        "diverged: the aggregated model became non-finite; the replies were finite: check "
        "strategy.name = 'qfedavg', strategy.q = 15.0"
    )
    assert str(e.value) == f"diverged: the run (rounds [1, 2]) became non-finite; round 1: {first}"
    assert "train.lr" not in str(e.value)
    assert loop.arrays is sent  # the last finite model stays
    res = _on_disk(tmp_path)
    assert res["status"] == "diverged" and res["diverged-rounds"] == [1, 2]
    assert res["rounds"][1]["failures"] == [{"node": None, "partition-id": None, "reason": first}]


def test_a_finite_model_whose_central_loss_is_nan_is_a_divergence_and_is_rolled_back(tmp_path) -> None:
    seen: list[float] = []

    def evaluator(model) -> dict[str, float | None]:
        w = float(next(model.parameters()).detach().abs().max())
        seen.append(w)
        return central_scores(math.nan if w > 100 else 2.3)  # the aggregate below scores a NaN loss

    loop = round_loop(tmp_path, evaluator, num_server_rounds=1)
    sent = loop.arrays
    loop.strategy.aggregate_train = lambda rnd, replies: (shifted(sent, 1e3), MetricRecord())
    with pytest.raises(DivergedError, match=r"round 1: diverged: the aggregated model's central test-loss"):
        loop.run_all()
    assert loop.arrays is sent and seen[1] > 100 and seen[2] == seen[0]  # scored again after the rollback
    res = _on_disk(tmp_path)
    assert res["status"] == "diverged" and res["rounds"][1]["test-loss"] == 2.3
    (reason,) = [f["reason"] for f in res["rounds"][1]["failures"]]
    assert reason == (
        "diverged: the aggregated model's central test-loss became non-finite; lower train.lr (= 0.05) "
        "or the loss weights, or the replies were finite: check strategy.name = 'fedavg'"
    )


def test_a_global_model_that_never_changes_fails_the_run_with_the_dp_settings(tmp_path) -> None:
    loop = round_loop(
        tmp_path,
        lambda m: central_scores(2.3),
        strategy__dp="server-adaptive",
        strategy__dp_clipped_count_stddev=1.0,
        min_nodes=2,
    )
    loop.strategy.aggregate_train = lambda rnd, replies: (loop.arrays, MetricRecord())  # clipped to 0
    with pytest.raises(FrozenModelError) as e:
        loop.run_all()
    assert str(e.value).startswith(
        "the global model has not changed in 1 trained round(s) in a row: every aggregate equalled the "
        "model sent out (strategy.name = 'fedavg', strategy.dp = 'server-adaptive', "
        "strategy.dp-noise-multiplier = 1.0, strategy.dp-initial-clipping-norm = 0.1"
    )
    assert "the DP clipping norm is now 0.1" in str(e.value)
    res = _on_disk(tmp_path)
    assert res["status"] == "failed" and res["error"].startswith("FrozenModelError: the global model")
    assert [r["round"] for r in res["rounds"]] == [0, 1]


def test_max_frozen_rounds_counts_rounds_in_a_row_and_zero_never_judges(tmp_path) -> None:
    loop = round_loop(tmp_path, lambda m: central_scores(2.3), num_server_rounds=4, max_frozen_rounds=2)
    moves = iter([0.0, 0.5, 0.0, 0.0])  # frozen, moved, frozen, frozen: fails after round 4
    loop.strategy.aggregate_train = lambda rnd, replies: (shifted(loop.arrays, next(moves)), MetricRecord())
    with pytest.raises(FrozenModelError, match=r"not changed in 2 trained round\(s\) in a row"):
        loop.run_all()
    assert [r["round"] for r in _on_disk(tmp_path)["rounds"]] == [0, 1, 2, 3, 4]

    off = round_loop(tmp_path / "off", lambda m: central_scores(2.3), max_frozen_rounds=0)
    off.strategy.aggregate_train = lambda rnd, replies: (off.arrays, MetricRecord())
    off.run_all()
    assert _on_disk(tmp_path / "off")["status"] == "completed"


# ------------------------------------------------------------------ a model that learns nothing


def _rows(accs: list[float], losses: list[float], split: str = "test") -> list[RoundRow]:
    """Round 0 (the initial model) and one trained round per further value."""
    rows = []
    for rnd, (acc, loss) in enumerate(zip(accs, losses, strict=True)):
        row = RoundRow(rnd)
        row.set_scores({f"{split}-accuracy": acc, f"{split}-loss": loss})
        rows.append(row)
    return rows


def test_the_no_learning_rule_judges_the_last_rounds_by_chance_accuracy_or_rising_loss() -> None:
    assert NO_LEARNING_ROUNDS == 3 and CHANCE_MARGIN == 0.02
    # The DP quickstart of issue 45: 10.00% every round, test loss 2.34 -> 12.72.
    dp = _rows([0.1] * 11, [2.34, 3.1, 4.0, 4.9, 5.5, 6.6, 7.7, 8.8, 9.9, 11.2, 12.72])
    assert no_learning(dp, 10) == (
        "no learning: test accuracy 10.00%, 10.00%, 10.00% in rounds 8-10, at most chance (1/10) "
        "+ 2% = 12.00% in each of the last 3 rounds"
    )
    # Above chance, but the loss rose in each of the last 3 rounds to above the initial model's.
    rising = _rows([0.1, 0.3, 0.2, 0.2, 0.2], [2.3, 2.0, 2.2, 2.4, 2.6])
    assert no_learning(rising, 10) == (
        "no learning: test loss rose in each of the last 3 rounds (2 -> 2.2 -> 2.4 -> 2.6), to above "
        "the initial model's 2.3"
    )
    # Validation is judged where there is one (the split choices are read from).
    val = _rows([0.5, 0.51, 0.5, 0.52], [0.7] * 4, split="val")
    for r in val:
        r.set_scores({"test-accuracy": 0.9, "test-loss": 0.1})
    assert no_learning(val, 2).startswith("no learning: val accuracy 51.00%, 50.00%, 52.00% in rounds 1-3")
    # Not judged: a run at chance for its first rounds that then learns (docs/privacy.md's measured
    # run), a loss rising from below the initial model's (late overfitting), fewer trained rounds,
    # a probe without a loss.
    late = [0.1, 0.1, 0.101, 0.118, 0.1, 0.11, 0.112, 0.135, 0.276, 0.384, 0.544]
    assert no_learning(_rows(late, [2.3] * 11), 10) is None
    assert no_learning(_rows([0.1, 0.8, 0.8, 0.8, 0.8], [2.3, 0.5, 0.6, 0.7, 0.8]), 10) is None
    assert no_learning(_rows([0.1, 0.1, 0.1], [2.3, 2.4, 2.5]), 10) is None
    assert no_learning(_rows([0.5, 0.9, 0.9, 0.9], [None] * 4), 10) is None


def test_a_run_that_learns_nothing_completes_with_a_recorded_warning(tmp_path) -> None:
    """The round loop's end: results.json says completed AND why its model learned nothing (with
    the keys to check); a resumed run that then learns drops the old verdict, keeps other warnings."""
    loop = round_loop(
        tmp_path, lambda m: central_scores(2.3), num_server_rounds=3, strategy__dp="server-adaptive"
    )
    loop.results.warn("strategy.dp = 'server-adaptive': ... expect no learning")
    loop.results.warn("strategy.dp = 'server-adaptive': ... expect no learning")  # once
    loop.strategy.aggregate_train = lambda rnd, replies: (shifted(loop.arrays, 1e-3), MetricRecord())
    loop.run_all()
    res = _on_disk(tmp_path)
    assert res["status"] == "completed"
    assert res["warnings"] == [
        "strategy.dp = 'server-adaptive': ... expect no learning",
        "no learning: test accuracy 10.00%, 10.00%, 10.00% in rounds 1-3, at most chance (1/10) + 2% = "
        "12.00% in each of the last 3 rounds; the model learns nothing: check train.lr (= 0.05) and "
        "strategy.name = 'fedavg', strategy.dp = 'server-adaptive', strategy.dp-noise-multiplier = 1.0, "
        "strategy.dp-initial-clipping-norm = 0.1, strategy.dp-target-clipped-quantile = 0.5, "
        "strategy.dp-clip-norm-lr = 0.2, strategy.dp-clipped-count-stddev = 0.0",
    ]
    learned = round_loop(
        tmp_path / "l", lambda m: central_scores(2.3) | {"test-accuracy": 0.9}, num_server_rounds=3
    )
    learned.results.warnings = ["no learning: an earlier process's verdict", "other"]
    learned.strategy.aggregate_train = lambda rnd, replies: (shifted(learned.arrays, 1e-3), MetricRecord())
    learned.run_all()
    assert _on_disk(tmp_path / "l")["warnings"] == ["other"]


# ------------------------------------------------------------------ server.evaluate-every


def test_evaluate_every_k_rounds_records_the_scored_rounds_and_readers_skip_the_others(tmp_path) -> None:
    """server.evaluate-every = 3 over 7 rounds: the server scores rounds 0, 3, 6 and the last (7),
    results.json lists them and holds null central scores in the other rows; the summary, the
    no-learning rule, `feddifrc status` and the sweep table read only the scored rows."""
    from feddifrc_app.tools import report
    from feddifrc_app.tools.cmd_runs import _status_line

    accs = iter([0.1, 0.11, 0.1, 0.105])  # rounds 0, 3, 6, 7: each at most chance + 2% (12%)
    loop = round_loop(
        tmp_path, lambda m: central_scores(2.3) | {"test-accuracy": next(accs)}, num_server_rounds=7
    )
    assert loop.every == 1  # the default: every round (today's behaviour)
    (tmp_path / "k").mkdir()
    loop = round_loop(
        tmp_path / "k",
        lambda m: central_scores(2.3) | {"test-accuracy": next(accs)},
        num_server_rounds=7,
        server__evaluate_every=3,
    )
    loop.strategy.aggregate_train = lambda rnd, replies: (shifted(loop.arrays, 1e-3), MetricRecord())
    loop.run_all()
    res = _on_disk(tmp_path / "k")
    assert res["status"] == "completed" and res["evaluated-rounds"] == [0, 3, 6, 7]
    assert [r["test-accuracy"] for r in res["rounds"]] == [0.1, None, None, 0.11, None, None, 0.1, 0.105]
    assert all("val-accuracy" in r and "test-loss" in r for r in res["rounds"])  # null, not left out
    s = res["summary"]
    assert (s["final-accuracy"], s["best-accuracy"], s["mean-last-5-accuracy"]) == (0.105, 0.11, 0.105)
    assert res["warnings"][0].startswith(
        "no learning: test accuracy 11.00%, 10.00%, 10.50% in rounds 3-7, at most chance"
    )
    (run := tmp_path / "k" / "run" / "config.json").write_text(json.dumps({"num-server-rounds": 7}))
    read, why = report.completed_results(run.parent)
    assert why == "" and [r.round for r in read.evaluated()] == [0, 3, 6, 7]
    assert "round 7/7  latest 10.50%  best 11.00%" in _status_line(run.parent / "results.json", read)
    report._plot_curves({("fedavg", "s"): {"runs": [read, read]}}, ["s"], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_resume_keeps_the_scored_rounds_up_to_its_checkpoint(tmp_path) -> None:
    run = RunDir(tmp_path)
    run.save_results(Results(rounds=[RoundRow(r) for r in range(5)], evaluated_rounds=[0, 2, 4]))
    run.save_checkpoint(3, {"round": 3, "model": {}}, keep=2)
    cfg = make_config(method="fedavg", server__evaluate_every=2, resume_from=str(tmp_path))
    results, _ = run.begin(cfg, run_id=9)
    assert [r.round for r in results.rounds] == [0, 1, 2, 3] and results.evaluated_rounds == [0, 2]
