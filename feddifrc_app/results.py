"""results.json: one typed record and its typed round rows, the only code that turns them into
JSON and back (no other module spells a row's key).

The ServerApp writes it (``RunDir.save_results``); the CLI's ``report`` / ``status``, the sweep,
the table and resume read it (``RunDir.load_results``). A key is present on disk only once the
run has set it (a run that fails in setup has no ``summary``), so every optional field is None
until set and None is never written (a round row's nulls: ``RoundRow``). This module names no
method: a method's own keys are declared in its package (``RESULTS``: key -> type, composed by
``methods.results_keys``), set by its code in ``Results.extra`` and typed on load by whoever
passes those declarations to ``Results.from_json``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


def json_key(name: str) -> str:
    """A field's key in results.json (``test_accuracy`` -> ``"test-accuracy"``)."""
    return name.replace("_", "-")


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


@dataclass
class RoundRow:
    """One round of results.json's ``rounds``: round 0 is the initial model.

    JSON keys are the field names with ``-`` for ``_``, in field order. A row this code builds
    writes a key once its value is set, and a null where null is a value: every row has its
    central scores (null: the server has no validation split, the self-supervised probe has no
    loss, or the server did not score the round: ``server.evaluate-every``); a round with
    federated evaluation its federated scores (null: no node replied); an
    accounted DP round its release (null: nothing was released). A row read from a file is
    written back as it was read: its keys, their order, and keys of another version (``extra``).
    A metric of a new kind is a field here (and, if null must be written, a line in ``_WITH``),
    set by the module that computes it.
    """

    round: int
    # A trained round: the partition ids sampled, their failures ({"node", "partition-id",
    # "reason"}), the strategy's aggregate of the nodes' train metrics.
    nodes: list[int] | None = None
    failures: list[dict[str, Any]] | None = None
    train_metrics: dict[str, float] | None = None
    # Under an accounted strategy.dp (privacy_accounting.account_round): the round's release and
    # the cumulative epsilons (an infinite epsilon is written null).
    dp_release: dict[str, Any] | None = None
    epsilon: float | None = None
    epsilon_if_sample_secret: float | None = None
    # With fraction-evaluate > 0 (federated_eval.py): the nodes' scores of the new global model on
    # their held-out data, example-weighted; each node's {"node", "partition-id", "num-examples",
    # "accuracy", "loss"}; its failures as ``failures``.
    federated_accuracy: float | None = None
    federated_loss: float | None = None
    evaluate_nodes: list[dict[str, Any]] | None = None
    evaluate_failures: list[dict[str, Any]] | None = None
    # The server's central scores of the global model (rounds.CentralEvaluator).
    val_accuracy: float | None = None
    val_loss: float | None = None
    test_accuracy: float | None = None
    test_loss: float | None = None
    seconds: float | None = None  # a trained round's wall time
    # Where each aggregated reply was computed (last: a key newer than the others): node id ->
    # {"partition-id", "host", "ray-node"} (client_app.origin; ray-node null outside Ray; the
    # whole value null: the reply named none).
    origins: dict[str, dict[str, Any] | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this code does not write
    # The keys of the object this row was read from, in its order (None: a row built here).
    read_keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    def set_scores(self, scores: dict[str, float | None]) -> None:
        """The central evaluator's scores, keyed as in results.json (``test-accuracy`` ...)."""
        for key, value in scores.items():
            if key not in _CENTRAL:
                raise KeyError(f"{key!r} is not a central score ({', '.join(_CENTRAL)})")
            setattr(self, _CENTRAL[key], value)

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "a round row") -> RoundRow:
        """The row of a parsed results.json object; a key of the wrong type is a TypeError naming it."""
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("round"), int)
            or isinstance(obj["round"], bool)
        ):
            raise TypeError(f"results.json {where} is not an object with an integer 'round' ({obj!r:.80})")
        known = {k: v for k, v in obj.items() if k in _ROW_FIELDS}
        for key, value in known.items():
            want = _ROW_TYPES[_ROW_FIELDS[key]]
            if value is not None and (not isinstance(value, want) or isinstance(value, bool)):
                raise TypeError(
                    f"results.json {where} key {key!r} is a {type(value).__name__}, expected "
                    f"{' or '.join(t.__name__ for t in _as_tuple(want))}"
                )
        return cls(
            **{_ROW_FIELDS[k]: v for k, v in known.items()},
            extra={k: v for k, v in obj.items() if k not in _ROW_FIELDS},
            read_keys=tuple(obj),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object (non-finite floats as they are: ``Results.to_json`` writes them null)."""
        if self.read_keys is None:
            keys = [json_key(f.name) for f in _FIELDS if self._written(f.name)] + list(self.extra)
        else:  # as read, then what was set since
            set_since = [json_key(f.name) for f in _FIELDS if getattr(self, f.name) is not None]
            keys = list(dict.fromkeys([*self.read_keys, *set_since, *self.extra]))
        return {k: getattr(self, _ROW_FIELDS[k]) if k in _ROW_FIELDS else self.extra[k] for k in keys}

    def holds(self, name: str) -> bool:
        """Whether results.json has field ``name`` in this row, null included (an epsilon of
        None is an infinite one when the row holds it, and no accounting when it does not)."""
        return json_key(name) in self.to_json()

    def _written(self, name: str) -> bool:
        with_ = _WITH.get(name)
        return getattr(self, name) is not None or (
            with_ is not None and (with_ == "round" or getattr(self, with_) is not None)
        )


# A field that is written even when null, and the field whose presence brings it.
_WITH = {
    **dict.fromkeys(("val_accuracy", "val_loss", "test_accuracy", "test_loss"), "round"),
    **dict.fromkeys(("federated_accuracy", "federated_loss"), "evaluate_nodes"),
    "dp_release": "epsilon",
}
_FIELDS = [f for f in fields(RoundRow) if f.name not in ("extra", "read_keys")]
_ROW_FIELDS = {json_key(f.name): f.name for f in _FIELDS}  # JSON key -> field name
_CENTRAL = {k: n for k, n in _ROW_FIELDS.items() if n.startswith(("val_", "test_"))}
# What from_json accepts for each field besides null: the lists and objects, every other one a number.
_ROW_TYPES: dict[str, type | tuple[type, ...]] = {n: (int, float) for n in _ROW_FIELDS.values()} | {
    "round": int,
    "nodes": list,
    "failures": list,
    "train_metrics": dict,
    "origins": dict,
    "dp_release": dict,
    "evaluate_nodes": list,
    "evaluate_failures": list,
}


@dataclass
class Results:
    """What a run reports; fields in the order a run writes them, so a file keeps its key order.

    JSON keys are the field names with ``-`` for ``_`` (``label_counts`` -> ``"label-counts"``).
    """

    method: str | None = None
    strategy: str | None = None
    dataset: str | None = None
    partition: str | None = None
    rounds: list[RoundRow] = field(default_factory=list)
    resumed: list[dict[str, int]] | None = None  # {"after-round", "run-id"} per resume
    # Keys this module does not type, kept as they are: a method's own (set by its server half,
    # declared in its package: typed on load by ``from_json``'s ``declared``), those of another
    # version or a hand edit. Written here, in the order they were set (a file: as it was read).
    extra: dict[str, Any] = field(default_factory=dict)
    setup_seconds: float | None = None
    label_counts: dict[str, list[int]] | None = None  # partition id -> training samples per class
    # The server's and the nodes' torch, CPU kernels and machine: {"server": {...}, "nodes":
    # [{..., "partitions": [...]}]} (server_app.record_platforms).
    platforms: dict[str, Any] | None = None
    privacy: dict[str, Any] | None = None  # strategy.dp's settings, weighting, delta, accountant
    status: str | None = None  # running, completed, diverged, stopped, failed
    process: dict[str, Any] | None = None  # pid and host of the ServerApp (the CLI's `status`)
    summary: dict[str, float | int | None] | None = None  # summarize(rounds), set on every save
    diverged_rounds: list[int] | None = None
    # server.evaluate-every > 1: the rounds the server scored centrally (0, every k-th, the last);
    # absent: every row was scored. A row not listed has null central scores.
    evaluated_rounds: list[int] | None = None
    error: str | None = None  # why a stopped or failed run ended
    # What the run was warned of, each once: at setup (strategy.dp's noise: "expect no learning"),
    # at its end (a model that learned nothing: rounds.no_learning, "no learning: ...").
    warnings: list[str] | None = None
    # The keys of the object this record was read from, in its order (None: a record built here).
    read_keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    def evaluated(self) -> list[RoundRow]:
        """The rows the server scored centrally: every row, or under ``server.evaluate-every`` > 1
        those of ``evaluated_rounds`` (the others hold null central scores)."""
        if self.evaluated_rounds is None:
            return list(self.rounds)
        scored = set(self.evaluated_rounds)
        return [r for r in self.rounds if r.round in scored]

    def warn(self, text: str) -> None:
        """Record a warning in ``warnings`` (once: a resumed run is warned again at setup)."""
        if text not in (self.warnings or []):
            self.warnings = [*(self.warnings or []), text]

    @classmethod
    def from_json(
        cls, obj: dict[str, Any], declared: Mapping[str, type | tuple[type, ...]] | None = None
    ) -> Results:
        """The record of a parsed results.json; a key of the wrong type is a TypeError naming it.
        ``declared``: the methods' own keys and their types (``methods.results_keys``), checked
        too; without it they are kept unchecked (a reader that imports no method)."""
        known = {json_key(f.name): f.name for f in fields(cls) if f.name not in ("extra", "read_keys")}
        out = cls(extra={k: v for k, v in obj.items() if k not in known}, read_keys=tuple(obj))
        types = {k: _TYPES[n] for k, n in known.items()} | {
            k: t for k, t in (declared or {}).items() if k not in known
        }
        for key, want in types.items():
            if key in obj:
                if not isinstance(obj[key], want) or isinstance(obj[key], bool) and want is not bool:
                    raise TypeError(
                        f"results.json key {key!r} is a {type(obj[key]).__name__}, expected "
                        f"{' or '.join(t.__name__ for t in _as_tuple(want))}"
                    )
                if key in known:
                    setattr(out, known[key], obj[key])
        out.rounds = [RoundRow.from_json(r, f"rounds[{i}]") for i, r in enumerate(out.rounds)]
        for key, value in (out.summary or {}).items():  # summarize's numbers (others: kept as they are)
            if key in SUMMARY_NUMBERS and value is not None:
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise TypeError(
                        f"results.json summary key {key!r} is a {type(value).__name__} ({value!r:.40}), "
                        "expected a number or null"
                    )
        return out

    def to_json(self) -> dict[str, Any]:
        """The JSON object: set keys in field order (``extra``'s where that field is), a record
        read from a file in its order and then what was set since; NaN and inf become null."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "extra":
                out |= self.extra
            elif f.name != "read_keys" and getattr(self, f.name) is not None:
                out[json_key(f.name)] = getattr(self, f.name)
        out["rounds"] = [r.to_json() for r in self.rounds]
        if self.read_keys is not None:  # as read (less what was cleared), then what was set since
            keys = dict.fromkeys([*(k for k in self.read_keys if k in out), *out])
            out = {k: out[k] for k in keys}
        return finite_or_none(out)


# The summary keys summarize() writes: numbers (or null) wherever results.json is read.
SUMMARY_NUMBERS = frozenset(
    ("final-accuracy", "best-accuracy", "mean-last-5-accuracy", "mean-last-10-accuracy", "val-best-round")
    + ("val-best-accuracy", "test-at-val-best-accuracy", "final-federated-accuracy")
)

# What from_json accepts for each key (JSON has one number type for int and float).
_TYPES: dict[str, type | tuple[type, ...]] = {
    "method": str,
    "strategy": str,
    "dataset": str,
    "partition": str,
    "rounds": list,
    "resumed": list,
    "setup_seconds": (int, float),
    "label_counts": dict,
    "platforms": dict,
    "privacy": dict,
    "status": str,
    "process": dict,
    "summary": dict,
    "diverged_rounds": list,
    "evaluated_rounds": list,
    "error": str,
    "warnings": list,
}


# How "best-accuracy" is named wherever it is printed: the paper's public code reports the
# maximum test accuracy over rounds (a choice read off test), so a paper's number stands beside it.
BEST_LABEL = "best (max over rounds, the paper's endpoint)"


def percent(x: float | None) -> str:
    """``61.20%``; ``-`` when there is none, ``NOT FINITE`` for NaN or inf (never ``nan%``)."""
    if x is None:
        return "-"
    return f"{100 * x:.2f}%" if math.isfinite(x) else f"NOT FINITE ({x})"


def summary_text(s: dict[str, Any]) -> str:
    """``final 61.20%  best (max over rounds, the paper's endpoint) 63.05%  mean of last 5 62.10%``."""
    return (
        f"final {percent(s['final-accuracy'])}  {BEST_LABEL} {percent(s['best-accuracy'])}  "
        f"mean of last 5 {percent(s['mean-last-5-accuracy'])}"
    )


def summarize(rounds: list[RoundRow]) -> dict[str, float | int | None]:
    """Test accuracy final, best and mean of the last 5 (and 10) trained rounds the server scored
    (every round, or every ``server.evaluate-every``-th and the last), reported together
    (the paper's code reports the max: selection on test), and the test accuracy at the round
    with the best VALIDATION accuracy (first such round), the one checkpoint choice that is not
    read off the test split; with federated evaluation, also the last federated accuracy.
    Round 0 (the initial model) counts only when no round has trained."""
    done = [r for r in rounds if r.test_accuracy is not None]
    trained = [r for r in done if r.round >= 1] or done
    accs = [r.test_accuracy for r in trained]
    out: dict[str, float | int | None] = dict.fromkeys(
        ("final-accuracy", "best-accuracy", "mean-last-5-accuracy", "mean-last-10-accuracy")
    )
    if accs:
        out["final-accuracy"], out["best-accuracy"] = accs[-1], max(accs)
        out["mean-last-5-accuracy"] = sum(accs[-5:]) / len(accs[-5:])
        out["mean-last-10-accuracy"] = sum(accs[-10:]) / len(accs[-10:])
    val = [r for r in trained if r.val_accuracy is not None]
    best = max(val, key=lambda r: r.val_accuracy) if val else None  # max() keeps the first
    out["val-best-round"] = best.round if best else None
    out["val-best-accuracy"] = best.val_accuracy if best else None
    out["test-at-val-best-accuracy"] = best.test_accuracy if best else None
    fed = [r.federated_accuracy for r in trained if r.federated_accuracy is not None]
    if fed:  # only runs with federated evaluation have the key, so other summaries are unchanged
        out["final-federated-accuracy"] = fed[-1]
    return out


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN / inf float replaced by None, so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj
