"""The federated rounds: sample, train through the strategy, aggregate, evaluate, checkpoint.

Evaluation is central (the server's validation and test splits) every round, or every
``server.evaluate-every``-th round and always the initial model and the last round, and, with
``fraction-evaluate > 0``, also federated (``federated_eval``: nodes score the new global
model on their held-out data, through the strategy's ``configure_evaluate`` /
``aggregate_evaluate``).

The loop drives the configured Flower strategy through its own ``configure_train`` /
``aggregate_train`` rather than ``Strategy.start``, so that node sampling is seeded,
``resume-from`` continues the round counter from a checkpoint, and failures and
timeouts are recorded per round.
"""

from __future__ import annotations

import math
import os
import socket
import time
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.supercore.run import RunNotRunningException

from feddifrc_app import log, methods, metric_keys, privacy, privacy_accounting
from feddifrc_app.config import Config
from feddifrc_app.data.images import ImageData
from feddifrc_app.data.loader import make_loader
from feddifrc_app.device import resolve_device
from feddifrc_app.federated_eval import FederatedEvaluation
from feddifrc_app.federation import Federation, RunStopped, check_stop
from feddifrc_app.halves import ServerHalf
from feddifrc_app.model import load_weights
from feddifrc_app.outputs import RunDir
from feddifrc_app.records import record_to_state, state_to_record
from feddifrc_app.results import Results, RoundRow, percent, summary_text
from feddifrc_app.strategy import (
    build_strategy,
    load_strategy_state,
    required_metrics,
    strategy_state,
)
from feddifrc_app.strategy_rules import strategy_settings
from feddifrc_app.tools import report
from feddifrc_app.tracking import NoTracker, Tracker
from feddifrc_app.train import DivergedError, evaluate, lr_remedy

# A round in which no node returns a usable update (every node failed or timed out, or nothing
# was aggregated) leaves the global model untrained; after this many such rounds in a row the
# run ends as failed rather than reporting an untrained model as its result. 1: the first one,
# since an input that fails one round (a bad batch size, a missing dataset) fails every round.
# Diverged rounds are not counted here: they end the run as "diverged" (see run_all).
MAX_EMPTY_ROUNDS = 1


class NoUpdateError(RuntimeError):
    """No node trained in ``MAX_EMPTY_ROUNDS`` consecutive rounds (the run fails, with the reason)."""


class FrozenModelError(RuntimeError):
    """The aggregate left the global model exactly as it was for ``max-frozen-rounds`` trained
    rounds in a row (e.g. DP clipping every update to a norm of 0): a run that learns nothing."""


# A run that completes is judged on its last NO_LEARNING_ROUNDS trained rounds (the validation
# split's central scores, else the test split's): an accuracy at chance (at most 1 / classes +
# CHANCE_MARGIN) in each, or a loss that rose in each to above the initial model's, is a model that
# learns nothing (e.g. DP noise far above what it absorbs). Its rounds are results, so the run still
# ends "completed", with the verdict in results.json's "warnings" ("no learning: ...") that report,
# status and the sweep table show. Earlier rounds do not count: a run at chance for its first rounds
# that then learns is fine; so is a loss rising from below the initial model's (late overfitting).
NO_LEARNING_ROUNDS = 3
CHANCE_MARGIN = 0.02
NO_LEARNING = "no learning:"  # how the verdict starts (a resumed run replaces an earlier one)


def no_learning(rounds: list[RoundRow], num_classes: int) -> str | None:
    """Why the last NO_LEARNING_ROUNDS trained rounds of ``rounds`` show a model that learns
    nothing, or None (also for fewer trained rounds, or scores the rule cannot read: a probe
    without a loss). ``rounds``: the rows the server scored (``Results.evaluated``: under
    ``server.evaluate-every`` > 1 the last 3 scored rounds are judged, not the last 3 rounds)."""
    n, trained = NO_LEARNING_ROUNDS, [r for r in rounds if r.round >= 1]
    if len(trained) < n or rounds[0].round != 0:
        return None
    split = "val" if all(r.val_accuracy is not None for r in trained[-n:]) else "test"
    acc = [getattr(r, f"{split}_accuracy") for r in trained[-n:]]
    chance = 1 / num_classes + CHANCE_MARGIN
    if all(a is not None and a <= chance for a in acc):
        return (
            f"{NO_LEARNING} {split} accuracy {', '.join(map(percent, acc))} in rounds "
            f"{trained[-n].round}-{trained[-1].round}, at most chance (1/{num_classes}) + "
            f"{CHANCE_MARGIN:.0%} = {percent(chance)} in each of the last {n} rounds"
        )
    loss = [getattr(r, f"{split}_loss") for r in rounds[-n - 1 :]]  # the last n and the one before
    initial = getattr(rounds[0], f"{split}_loss")
    if None in loss or initial is None or loss[-1] <= initial or any(b <= a for a, b in pairwise(loss)):
        return None
    return (
        f"{NO_LEARNING} {split} loss rose in each of the last {n} rounds "
        f"({' -> '.join(f'{v:.4g}' for v in loss)}), to above the initial model's {initial:.4g}"
    )


def _finite(arrays: ArrayRecord) -> bool:
    return all(np.isfinite(a.numpy()).all() for a in arrays.values() if a.numpy().dtype.kind == "f")


def _same(a: ArrayRecord, b: ArrayRecord) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def _non_finite_loss(central: dict[str, float | None]) -> str | None:
    """The first central split whose loss is non-finite (a model with finite weights can still
    score a NaN loss: BatchNorm statistics or logits out of float32's range)."""
    return next(
        (k for k, v in central.items() if k.endswith("-loss") and v is not None and not math.isfinite(v)),
        None,
    )


def record_end(run: RunDir, results: Results, e: BaseException) -> None:
    """A run that ends early says so in results.json: stopped, or failed with the reason."""
    stopped = isinstance(e, RunStopped | RunNotRunningException | KeyboardInterrupt | SystemExit)
    results.status = "stopped" if stopped else "failed"
    results.error = f"{type(e).__name__}: {e}"
    done = [r.round for r in results.rounds]
    when = f"after round {max(done)}" if done else "before its first round"
    log.warning("run %s %s: %s", results.status, when, e)
    run.save_results(results)


class CentralEvaluator:
    """Validation and test accuracy of the global model on the server, every scored round (or the run's
    method's own evaluation, ``methods.central_evaluation``). Choices are read from validation;
    test is the endpoint.

    It runs on ``server.device``, never ``train.device``: the ServerApp's machine (a CPU-only
    container in the documented deployment) need not have the nodes' GPU. Built before the setup
    exchange (server_app), so a device or dataset it cannot have fails before any node works."""

    def __init__(self, cfg: Config, test: ImageData, val: ImageData | None) -> None:
        self.cfg, self.device = cfg, resolve_device(cfg.server.device, "server.device")
        self.splits = {"val": self._loader(val) if val is not None else None, "test": self._loader(test)}
        if cfg.dataset.eval_limit:
            log.warning(
                "dataset.eval-limit = %d: validation and test are stratified subsets (%s images); "
                "accuracies are for a smoke run, not for comparison with full-split numbers",
                cfg.dataset.eval_limit,
                " / ".join(str(len(d)) for d in (val, test) if d is not None),
            )
        self.override = methods.central_evaluation(cfg, self._loader, self.device)

    def _loader(self, data: ImageData):
        return make_loader(
            data,
            np.arange(len(data)),
            train=False,
            batch_size=self.cfg.train.eval_batch_size,
            seed=self.cfg.seed,
        )

    def __call__(self, model: torch.nn.Module) -> dict[str, float | None]:
        if self.override is not None:
            return self.override(model, self.splits)
        out: dict[str, float | None] = {}
        for name, loader in self.splits.items():
            if loader is None:
                out |= {f"{name}-accuracy": None, f"{name}-loss": None}
            else:
                m = evaluate(model, loader, self.device)
                out |= {f"{name}-accuracy": m["accuracy"], f"{name}-loss": m["loss"]}
        return out


class RoundLoop:
    """All round state in one place: the global arrays, the strategy, the results being written."""

    def __init__(
        self,
        cfg: Config,
        fed: Federation,
        run: RunDir,
        results: Results,
        evaluator: CentralEvaluator,
        num_classes: int,
        *,
        method: ServerHalf | None = None,
        checkpoint: dict[str, Any] | None = None,
    ) -> None:
        """``checkpoint``: the one ``RunDir.begin`` returns under resume-from; the loop continues
        after its round with its model, strategy state and the method's state. ``method``: the
        methods' server half (``methods.server_half``), whose records go with every train message
        (the ServerApp builds the loop before the setup exchange, which completes the half)."""
        self.cfg, self.fed, self.run, self.results, self.evaluator = cfg, fed, run, results, evaluator
        self.num_classes = num_classes  # chance is 1 / num_classes (no_learning)
        self.method = method if method is not None else ServerHalf()
        torch.manual_seed(cfg.seed)
        self.model = methods.model_for(cfg, num_classes)
        self.strategy = build_strategy(cfg)
        self.federated = FederatedEvaluation(cfg, fed, self.strategy)
        self.first = 1
        if checkpoint is not None:
            load_weights(self.model, checkpoint["model"])
            load_strategy_state(self.strategy, checkpoint["strategy"])
            self.first = int(checkpoint["round"]) + 1
            self.method.restore(checkpoint)
        self.arrays = state_to_record(self.model.state_dict())
        self.empty_rounds = 0  # consecutive rounds without a usable update (MAX_EMPTY_ROUNDS)
        self.frozen_rounds = 0  # consecutive trained rounds whose aggregate changed nothing
        self.diverged_cause: str | None = None  # the first diverged round's reason
        self.tracker: Tracker = NoTracker()  # tracking.py: gets each committed row (run_all's)
        self.every = cfg.server.evaluate_every  # central evaluation every k rounds (evaluates)

    def evaluates(self, rnd: int) -> bool:
        """Whether the server scores round ``rnd`` centrally: every ``server.evaluate-every``-th
        round and the last (round 0, the initial model, always: ``run_all``)."""
        return rnd % self.every == 0 or rnd == self.cfg.num_server_rounds

    def _scores_text(self, row: RoundRow) -> str:
        if not self.evaluates(row.round):
            return f"not scored (server.evaluate-every = {self.every})"
        val = "-" if row.val_accuracy is None else f"{row.val_accuracy:.4f}"
        test = "-" if row.test_accuracy is None else f"{row.test_accuracy:.4f}"
        return f"val accuracy {val}, test accuracy {test}"

    def evaluate(self) -> dict[str, float | None]:
        load_weights(self.model, record_to_state(self.arrays))
        return self.evaluator(self.model)

    def run_all(self, tracker: Tracker | None = None) -> None:
        """``tracker`` (tracking.py) gets each row once it is committed, and the run's end."""
        self.tracker = tracker or self.tracker
        self.results.status = "running"
        # Who runs it: with the run directory's lock (files.lock_folder), how `feddifrc status`
        # tells a live run from one whose process died without a word.
        self.results.process = {"pid": os.getpid(), "host": socket.gethostname()}
        try:
            if self.first == 1:
                initial = RoundRow(0)
                initial.set_scores(self.evaluate())
                self.results.rounds = [initial]
                self.results.evaluated_rounds = [0] if self.every > 1 else None
                self.run.save_results(self.results)
                self.tracker.log(initial)
            for rnd in range(self.first, self.cfg.num_server_rounds + 1):
                check_stop()
                row = self.train_round(rnd)
                check_stop()  # a round that ends after the stop is not saved
                self.results.rounds.append(row)
                if self.every > 1 and self.evaluates(rnd):
                    self.results.evaluated_rounds = [*(self.results.evaluated_rounds or []), rnd]
                if self.empty_rounds >= MAX_EMPTY_ROUNDS:
                    raise self.no_update_error(row)  # results.json keeps the round's failures
                if self.cfg.max_frozen_rounds and self.frozen_rounds >= self.cfg.max_frozen_rounds:
                    raise self.frozen_error()
                self.save(rnd)
                log.info("round %d: %s (%.1fs)", rnd, self._scores_text(row), row.seconds)
        except BaseException as e:
            record_end(self.run, self.results, e)
            self.tracker.close(self.results.status)
            raise
        self.results.status = "diverged" if self.results.diverged_rounds else "completed"
        self.judge_learning()
        self.run.save_results(self.results)
        self.tracker.close(self.results.status)
        report.plot_accuracy(self.results, self.run.path / "accuracy.png")
        if self.results.status == "diverged":
            # Reported as a failed run (flwr ls), after every result is on disk, with the first cause.
            raise DivergedError(f"the run (rounds {self.results.diverged_rounds})", self.diverged_cause)
        log.info("finished: %s -> %s", summary_text(self.results.summary), self.run.path)

    def judge_learning(self) -> None:
        """A completed run's no-learning verdict (``no_learning``) in results.json's warnings,
        with what to check; an earlier process's verdict (before a resume) is replaced."""
        kept = [w for w in self.results.warnings or [] if not str(w).startswith(NO_LEARNING)]
        self.results.warnings = kept or None
        completed = self.results.status == "completed"
        why = no_learning(self.results.evaluated(), self.num_classes) if completed else None
        if why:
            why += (
                f"; the model learns nothing: check train.lr (= {self.cfg.train.lr:g}) and "
                f"{strategy_settings(self.cfg, methods.strategy_keys())}"
            )
            log.warning("%s", why)
            self.results.warn(why)

    def no_update_error(self, row: RoundRow) -> NoUpdateError:
        failures, n = row.failures, len(row.nodes)
        why = (
            f"{len(failures)} of {n} nodes failed; first failure: {failures[0]['reason']}"
            if failures
            # Flower's strategies return nothing for replies they cannot combine (it logs why,
            # e.g. "Skipping aggregation" for Bulyan with fewer than 4f + 3 replies; mixed metric
            # keys are settled before, in metric_keys.conform).
            else f"{n} nodes replied but strategy '{self.cfg.strategy.name}' aggregated nothing; "
            "the ServerApp log says why (e.g. Bulyan with fewer than 4f + 3 replies)"
        )
        return NoUpdateError(
            f"round {row.round}: no node returned a usable update ({why}); a run fails after "
            f"{MAX_EMPTY_ROUNDS} such round(s) in a row, since its model was not trained"
        )

    def frozen_error(self) -> FrozenModelError:
        inner = getattr(self.strategy, "clipping_norm", None)  # a DP wrapper's current norm
        clip = f"; the DP clipping norm is now {inner:g}" if inner is not None else ""
        keys = strategy_settings(self.cfg, methods.strategy_keys())
        return FrozenModelError(
            f"the global model has not changed in {self.frozen_rounds} trained round(s) in a row: every "
            f"aggregate equalled the model sent out ({keys}{clip}); a run fails "
            f"after max-frozen-rounds = {self.cfg.max_frozen_rounds} such rounds: it learns nothing"
        )

    def train_round(self, rnd: int) -> RoundRow:
        """One round, step by step: who trains, what they are sent and send back, the new global
        model (or the last one, when the aggregate diverges), the round's verdict, its DP
        accounting and the federated evaluation: the round's row."""
        t0 = time.perf_counter()
        chosen = self._sample(rnd)
        replies, failures = self._exchange(rnd, self._configure(rnd, chosen), chosen)
        row = RoundRow(rnd, nodes=[self.fed.partition_of[n] for n in chosen], failures=failures)
        row.origins = {str(r.metadata.src_node_id): self._origin(r) for r in replies}
        before, previous = strategy_state(self.strategy), self.arrays
        installed = self._aggregate(rnd, replies, row, before)
        updated = self._score(row, installed, previous, before)  # False: none, or rolled back
        self._judge(rnd, row, updated)
        # A rejected (non-finite) noisy aggregate still counts: it was computed and logged.
        privacy_accounting.account_round(
            self.cfg, row, self.results.rounds, privacy.release_of(self.strategy)
        )
        self.federated(rnd, self.arrays, row)
        row.seconds = time.perf_counter() - t0
        return row

    def _sample(self, rnd: int) -> list[int]:
        chosen = self.fed.sample(rnd)
        if not chosen:  # every node left: wait for one (or fail after round-timeout), never hang
            self.fed.wait_for_nodes()
            chosen = self.fed.sample(rnd)
        return chosen

    def _configure(self, rnd: int, chosen: list[int]) -> list[Message]:
        """The train messages: the global model and the train config."""
        # The strategy adds its own keys (FedProx's proximal-mu, SCAFFOLD's c) to the methods' ones.
        config = ConfigRecord(methods.train_config(self.cfg) | self.fed.round_config())
        msgs = list(self.strategy.configure_train(rnd, self.arrays, config, self.fed.view(chosen)))
        for m in msgs:  # the method's own records, beside the model
            for key, record in self.method.train_records().items():
                m.content[key] = record
        return msgs

    def _exchange(
        self, rnd: int, msgs: list[Message], chosen: list[int]
    ) -> tuple[list[Message], list[dict[str, Any]]]:
        """(replies the strategy can aggregate, failure rows): a node that failed or timed out,
        or whose reply lacks a metric key the aggregation reads (metric_keys.conform)."""
        ok, failures = self.fed.exchange(msgs, chosen)
        ok, odd = metric_keys.conform(ok, required_metrics(self.cfg), self._describe)
        failures += odd
        if failures:
            # Before Flower's "aggregate_train: Received N results and M failures": it is handed only
            # the good replies (our strategies read every reply's content, and a node that never
            # replied is no message at all), so its M is 0 and this line is the round's account.
            log.warning(
                "round %d: %d of %d nodes failed (aggregating the other %d): %s",
                rnd,
                len(failures),
                len(chosen),
                len(ok),
                failures,
            )
        return ok, failures

    def _aggregate(self, rnd: int, replies: list[Message], row: RoundRow, before: dict) -> bool:
        """The strategy's aggregate of the replies (its metrics in ``row``) becomes the global
        model; a non-finite one is rejected. Whether the model was updated."""
        arrays, metrics = self.strategy.aggregate_train(rnd, replies) if replies else (None, None)
        row.train_metrics = dict(metrics) if metrics is not None else {}
        if arrays is not None and not _finite(arrays):
            self._reject(before, row.failures, "the aggregated model", self._server_side())
            return False
        if arrays is None:
            return False
        self.frozen_rounds = self.frozen_rounds + 1 if _same(arrays, self.arrays) else 0
        self.arrays = arrays
        return True

    def _score(self, row: RoundRow, installed: bool, previous: ArrayRecord, before: dict) -> bool:
        """The global model's central scores in ``row``; an installed update whose central loss
        is non-finite is rolled back to ``previous`` and rejected. Whether the model was updated.
        A round the server does not score (``evaluates``) keeps null scores and is not checked
        here (its weights were: ``_aggregate``); the next scored round is, against its previous."""
        if not self.evaluates(row.round):
            return installed
        central = self.evaluate()
        if installed and (split := _non_finite_loss(central)):
            self.arrays = previous  # finite weights that score a NaN loss: rejected the same way
            remedy = f"{lr_remedy(self.cfg.train.lr)}, or {self._server_side()}"
            self._reject(before, row.failures, f"the aggregated model's central {split}", remedy)
            installed = False
            central = self.evaluate()
        row.set_scores(central)
        return installed

    def _judge(self, rnd: int, row: RoundRow, updated: bool) -> None:
        """A round with a diverged node or aggregate is recorded as diverged (the run ends as such);
        one without a usable update otherwise counts toward MAX_EMPTY_ROUNDS."""
        diverged = [f["reason"] for f in row.failures if DivergedError.TAG in str(f["reason"])]
        if diverged:
            self.results.diverged_rounds = [*(self.results.diverged_rounds or []), rnd]
            self.diverged_cause = self.diverged_cause or f"round {rnd}: {diverged[0]}"
            log.error("round %d diverged (%s); the global model stays the last finite one", rnd, diverged[0])
        if not updated:
            log.warning("round %d: no usable update; the global model is unchanged", rnd)
        self.empty_rounds = self.empty_rounds + 1 if not updated and not diverged else 0

    def _server_side(self) -> str:
        # Every reply is finite (a node that diverges sends none): a non-finite aggregate is the
        # server's doing, its strategy (and DP) keys, not train.lr.
        return f"the replies were finite: check {strategy_settings(self.cfg, methods.strategy_keys())}"

    def _reject(self, before: dict, failures: list[dict[str, Any]], what: str, remedy: str) -> None:
        """Record a diverged aggregate as the round's failure; a rejected update leaves no trace
        in the strategy's state."""
        load_strategy_state(self.strategy, before)
        failures.append({"node": None, "partition-id": None, "reason": str(DivergedError(what, remedy))})

    def _origin(self, reply: Message) -> dict[str, Any] | None:
        """A train reply's machine (client_app.origin): None for a ClientApp that names none."""
        if metric_keys.ORIGIN not in reply.content.config_records:
            return None
        said = reply.content.config_records[metric_keys.ORIGIN]
        where = {"host": said.get("host"), "ray-node": said.get("ray-node")}
        return {"partition-id": self.fed.partition_of.get(reply.metadata.src_node_id), **where}

    def _describe(self, reply: Message) -> dict[str, Any]:
        node = reply.metadata.src_node_id
        return {"node": node, "partition-id": self.fed.partition_of.get(node)}

    def save(self, rnd: int) -> None:
        payload = {
            "round": rnd,
            "model": record_to_state(self.arrays),
            "strategy": strategy_state(self.strategy),
            **self.method.state(),
        }
        # Results first: killed in between, resume repeats this round rather than losing its row.
        self.run.save_results(self.results)
        self.run.save_checkpoint(rnd, payload, keep=self.cfg.keep_checkpoints)
        self.tracker.log(self.results.rounds[-1])  # committed: a resume starts after this round
        report.plot_accuracy(self.results, self.run.path / "accuracy.png")
