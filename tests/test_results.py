"""results.json's record: the summary numbers, and a file read and written back unchanged."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path

import pytest

from feddifrc_app import methods, results
from feddifrc_app.results import Results, RoundRow, json_key, summarize, summary_text


def _rows(test, val=None, first=1):
    val = val or [None] * len(test)
    return [
        RoundRow(first + i, test_accuracy=t, val_accuracy=v)
        for i, (t, v) in enumerate(zip(test, val, strict=True))
    ]


def test_summary_final_best_mean_last5():
    accs = [0.1, 0.5, 0.3, 0.4, 0.2, 0.6, 0.35, 0.5, 0.45, 0.55, 0.65]
    s = summarize([RoundRow(0, test_accuracy=0.9), *_rows(accs)])  # round 0 is no training result
    assert s["final-accuracy"] == 0.65
    assert s["best-accuracy"] == 0.65
    assert s["mean-last-5-accuracy"] == pytest.approx((0.35 + 0.5 + 0.45 + 0.55 + 0.65) / 5)
    assert s["mean-last-10-accuracy"] == pytest.approx(sum(accs[1:]) / 10)
    assert s["val-best-round"] is None and s["test-at-val-best-accuracy"] is None  # no validation
    one = summarize(_rows([0.2]))
    assert (one["final-accuracy"], one["best-accuracy"], one["mean-last-5-accuracy"]) == (0.2, 0.2, 0.2)
    assert summarize([])["final-accuracy"] is None


def test_summary_reads_the_checkpoint_round_off_validation_not_test():
    # Test peaks in round 2, validation in rounds 3 and 4 (ties: the first): test at round 3.
    s = summarize(_rows([0.5, 0.9, 0.6, 0.7], val=[0.4, 0.5, 0.8, 0.8]))
    assert (s["val-best-round"], s["val-best-accuracy"], s["test-at-val-best-accuracy"]) == (3, 0.8, 0.6)
    assert s["best-accuracy"] == 0.9  # still reported beside it, as the paper's code does
    # Printed with the label that says it is the paper's endpoint, between final and mean of last 5.
    assert summary_text(s) == (
        "final 70.00%  best (max over rounds, the paper's endpoint) 90.00%  mean of last 5 67.50%"
    )
    # A damaged or empty summary never prints "nan%" or raises.
    odd = {"final-accuracy": float("nan"), "best-accuracy": None, "mean-last-5-accuracy": float("inf")}
    assert summary_text(odd) == (
        "final NOT FINITE (nan)  best (max over rounds, the paper's endpoint) -  "
        "mean of last 5 NOT FINITE (inf)"
    )


def test_a_results_json_reads_and_writes_back_byte_for_byte():
    # Every key a FedDifRC run with a federated basis writes, in the order it writes them.
    on_disk = {
        "method": "feddifrc",
        "strategy": "fedavg",
        "dataset": "mnist-5k",
        "partition": "dirichlet",
        "rounds": [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.5, "nodes": [0, 1]}],
        "resumed": [{"after-round": 1, "run-id": 7}],
        "basis": {"mode": "federated-pca", "fingerprint": "ab", "rows": 10, "nodes": 2, "widths": [4]},
        "setup-cache-misses": 3,
        "setup-seconds": 1.5,
        "teacher": {"model": "tiny-mnist", "weights-sha256": "cd", "random-weights": False, "devices": {}},
        "label-counts": {"0": [1, 2], "1": [2, 1]},
        "platforms": {
            "server": {"torch": "2.14.1", "cpu-kernels": "AVX2", "machine": "x86_64"},
            "nodes": [{"torch": "2.14.1", "cpu-kernels": "AVX2", "machine": "x86_64", "partitions": [0, 1]}],
        },
        "status": "diverged",
        "process": {"pid": 1, "host": "h"},
        "summary": summarize([RoundRow(1, test_accuracy=0.5)]),
        "diverged-rounds": [2],
        "error": "DivergedError: ...",
        "from-another-version": {"kept": True},
    }
    text = json.dumps(on_disk)
    for declared in (methods.results_keys(), None):  # as a resume reads it, and as `report` does
        r = Results.from_json(json.loads(text), declared)
        assert (r.setup_seconds, r.label_counts, r.extra) == (
            1.5,
            on_disk["label-counts"],
            {k: on_disk[k] for k in ("basis", "setup-cache-misses", "teacher", "from-another-version")},
        )
        assert json.dumps(r.to_json()) == text  # keys, values and their order
        r.status, r.error = "completed", None  # a resumed run: cleared keys go, new ones come last
        r.warn("w")
        assert list(r.to_json()) == [k for k in on_disk if k != "error"] + ["warnings"]
    assert Results(rounds=[]).to_json() == {"rounds": []}  # a key is written once it is set


def test_a_built_record_writes_a_methods_keys_where_a_run_always_wrote_them():
    r = Results("feddifrc", "fedavg", "mnist-5k", "dirichlet", [], [], setup_seconds=1.0, status="running")
    r.extra |= {"basis": {"mode": "federated-pca"}, "setup-cache-misses": 0, "teacher": {"model": "m"}}
    # Before setup-seconds, as in every file so far save "teacher" (it was written after it).
    assert list(r.to_json()) == [
        "method",
        "strategy",
        "dataset",
        "partition",
        "rounds",
        "resumed",
        "basis",
        "setup-cache-misses",
        "teacher",
        "setup-seconds",
        "status",
    ]


def test_a_key_of_the_wrong_type_is_named():
    with pytest.raises(TypeError, match="results.json key 'rounds' is a str, expected list"):
        Results.from_json({"rounds": "none"})
    with pytest.raises(TypeError, match="results.json key 'setup-seconds' is a str, expected int or float"):
        Results.from_json({"setup-seconds": "1"})
    with pytest.raises(TypeError, match="results.json key 'platforms' is a list, expected dict"):
        Results.from_json({"platforms": []})
    # A method's own keys, as its package declares them (methods.results_keys).
    declared = methods.results_keys()
    with pytest.raises(TypeError, match="results.json key 'setup-cache-misses' is a bool, expected int"):
        Results.from_json({"setup-cache-misses": True}, declared)
    with pytest.raises(TypeError, match="results.json key 'teacher' is a list, expected dict"):
        Results.from_json({"teacher": []}, declared)
    with pytest.raises(TypeError, match="results.json key 'basis' is a str, expected dict"):
        Results.from_json({"basis": "pca"}, declared)
    # Without the declarations (a reader that imports no method) they are kept unchecked.
    assert Results.from_json({"teacher": []}).extra == {"teacher": []}


def test_results_py_names_no_method():
    """results.py types what every run writes; a method's keys are its package's (``RESULTS``)."""
    source = Path(results.__file__).read_text().lower()
    words = {"feddifrc", "basis", "teacher", "cache-misses", "cache_misses", *methods.names()}
    assert [w for w in sorted(words) if w in source] == []
    assert {"basis", "setup-cache-misses", "teacher"} <= set(methods.results_keys())


def test_the_summary_has_the_final_federated_accuracy_only_with_federated_evaluation():
    rows = _rows([0.5, 0.6])
    assert "final-federated-accuracy" not in summarize(rows)  # default runs: the summary as before
    rows[0].federated_accuracy, rows[1].federated_accuracy = 0.4, None  # round 2: no node replied
    assert summarize(rows)["final-federated-accuracy"] == 0.4
    rows[1].federated_accuracy = 0.45
    assert summarize([RoundRow(0, test_accuracy=0.1), *rows])["final-federated-accuracy"] == 0.45


def test_a_built_row_writes_its_keys_in_results_jsons_order_with_null_only_where_it_is_a_value():
    row = RoundRow(3, nodes=[0, 1], failures=[], train_metrics={"train-ce": 1.5}, seconds=2.0)
    row.set_scores({"val-accuracy": None, "val-loss": None, "test-accuracy": 0.5, "test-loss": 1.0})
    row.epsilon, row.epsilon_if_sample_secret = math.inf, 1.0  # dp_release None: nothing was released
    row.evaluate_nodes, row.evaluate_failures = [], [{"node": 5, "partition-id": 0, "reason": "x"}]
    assert list(row.to_json()) == [
        "round",
        "nodes",
        "failures",
        "train-metrics",
        "dp-release",
        "epsilon",
        "epsilon-if-sample-secret",
        "federated-accuracy",
        "federated-loss",
        "evaluate-nodes",
        "evaluate-failures",
        "val-accuracy",
        "val-loss",
        "test-accuracy",
        "test-loss",
        "seconds",
    ]
    on_disk = Results(rounds=[row]).to_json()["rounds"][0]
    assert (on_disk["dp-release"], on_disk["epsilon"], on_disk["federated-accuracy"]) == (None, None, None)
    # the initial model's row: its central scores (null included), nothing else
    assert RoundRow(0).to_json() == {
        "round": 0,
        "val-accuracy": None,
        "val-loss": None,
        "test-accuracy": None,
        "test-loss": None,
    }
    assert row.holds("epsilon") and not RoundRow(0).holds("epsilon")
    with pytest.raises(KeyError, match="'train-ce' is not a central score"):
        row.set_scores({"train-ce": 1.0})


def test_a_row_read_from_a_file_is_written_back_as_read_and_a_wrong_type_is_named():
    old = {"round": 2, "epsilon": None, "test-accuracy": 0.5, "from-another-version": [1]}
    row = RoundRow.from_json(old)
    assert (row.round, row.test_accuracy, row.extra) == (2, 0.5, {"from-another-version": [1]})
    assert row.to_json() == old and list(row.to_json()) == list(old)
    assert row.holds("epsilon") and row.epsilon is None  # written null: an infinite epsilon
    row.seconds = 1.5  # set since it was read: after the keys as read
    assert list(row.to_json()) == [*old, "seconds"]
    with pytest.raises(TypeError, match=r"results.json rounds\[1\] key 'test-accuracy' is a str, expected"):
        Results.from_json({"rounds": [{"round": 0}, {"round": 1, "test-accuracy": "high"}]})
    with pytest.raises(TypeError, match=r"rounds\[0\] is not an object with an integer 'round'"):
        Results.from_json({"rounds": [{"test-accuracy": 0.5}]})
    with pytest.raises(TypeError, match="key 'nodes' is a dict, expected list"):
        RoundRow.from_json({"round": 1, "nodes": {}})


def test_no_module_but_results_spells_a_row_key():
    """Rows are read and written through RoundRow's fields: a key with a '-' (one that is not
    also a field name) appears as a string only in results.py. scripts/ read results.json on a
    host without the package, so they are not checked."""
    root = Path(__file__).resolve().parents[1]
    keys = [json_key(f.name) for f in fields(RoundRow) if "_" in f.name and f.name != "read_keys"]
    assert "test-accuracy" in keys and "train-metrics" in keys
    found = [
        f"{path.relative_to(root)}:{n}: {key}"
        for folder in ("feddifrc_app", "benchmarks")
        for path in sorted((root / folder).rglob("*.py"))
        if path.name != "results.py" or path.parent.name != "feddifrc_app"
        if "peer_app" not in path.parts  # a plain Flower app (benchmarks/peer_ratio.py): its own keys
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for key in keys
        if re.search(rf"[\"']{re.escape(key)}[\"']", line)
    ]
    assert found == []
