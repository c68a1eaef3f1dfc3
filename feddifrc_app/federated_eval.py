"""Federated evaluation: sampled nodes score the global model on their own held-out data.

With ``fraction-evaluate > 0``, after each round's aggregation the server samples that share of
the known nodes (seeded by seed and round, independently of the training sample), sends them
the new global model through the strategy's own ``configure_evaluate``, and combines their
replies with its ``aggregate_evaluate`` (Flower's example-weighted mean, ``num-examples`` as
the weight). Each node answers with its ``evaluate`` handler on the ``evaluate-holdout`` part
of its data, which it never trains on (``data.shares.client_holdout``). Central evaluation on the
server's validation and test splits is unchanged beside it.

A round's row (``results.RoundRow``) gains ``federated_accuracy`` and ``federated_loss``
(example-weighted over the nodes that replied; None if none), ``evaluate_nodes`` (each node's
own numbers) and ``evaluate_failures`` (as a training round's ``failures``), and
nothing at all with ``fraction-evaluate = 0`` (the default): such a results.json is unchanged.
A node that fails evaluation is an entry of ``evaluate_failures`` (logged), never a failed run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp.strategy import Strategy

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.federation import Federation
from feddifrc_app.results import RoundRow

# The evaluate handler's metric keys (client_app.evaluate) and Flower's weighting key.
ACCURACY, LOSS, EXAMPLES = "eval-accuracy", "eval-loss", "num-examples"


def node_rows(replies: Sequence[Message], partition_of: Mapping[int, int]) -> list[dict[str, Any]]:
    """One row per good reply (in the order given): the node's own numbers. A good reply comes
    from its node (only the SuperLink's error replies carry another sender)."""
    rows = []
    for r in replies:
        m, node = r.content["metrics"], int(r.metadata.src_node_id)
        rows.append(
            {
                "node": node,
                "partition-id": partition_of.get(node),
                "num-examples": int(m[EXAMPLES]),
                "accuracy": float(m[ACCURACY]),
                "loss": float(m[LOSS]),
            }
        )
    return rows


def set_evaluation(
    row: RoundRow,
    aggregate: MetricRecord | None,
    replies: Sequence[Message],
    failures: list[dict[str, Any]],
    partition_of: Mapping[int, int],
) -> None:
    """A round's federated evaluation in its ``row``, from the strategy's aggregate of ``replies``
    (None: nothing was aggregated), the good replies themselves and the failure rows."""
    row.federated_accuracy = None if aggregate is None else float(aggregate[ACCURACY])
    row.federated_loss = None if aggregate is None else float(aggregate[LOSS])
    row.evaluate_nodes = node_rows(replies, partition_of)
    row.evaluate_failures = failures


class FederatedEvaluation:
    """The server's half: one call per trained round, after aggregation."""

    def __init__(self, cfg: Config, fed: Federation, strategy: Strategy) -> None:
        self.cfg, self.fed, self.strategy = cfg, fed, strategy

    def __call__(self, rnd: int, arrays: ArrayRecord, row: RoundRow) -> None:
        """Round ``rnd``'s federated evaluation of ``arrays``, in its ``row`` (nothing when it is off)."""
        if self.cfg.fraction_evaluate == 0:
            return
        chosen = self.fed.sample(rnd, evaluate=True)
        msgs = list(self.strategy.configure_evaluate(rnd, arrays, ConfigRecord(), self.fed.view(chosen)))
        ok, failures = self.fed.exchange(msgs, chosen) if msgs else ([], [])
        if failures:
            log.warning(
                "round %d: %d of %d nodes failed evaluation (the federated numbers are the other %d's): %s",
                rnd,
                len(failures),
                len(chosen),
                len(ok),
                failures,
            )
        aggregate = self.strategy.aggregate_evaluate(rnd, ok) if ok else None
        set_evaluation(row, aggregate, ok, failures, self.fed.partition_of)
        if row.federated_accuracy is None:
            log.warning(
                "round %d: no federated evaluation (%d of %d sampled nodes replied, nothing aggregated)",
                rnd,
                len(ok),
                len(chosen),
            )
        else:
            log.info(
                "round %d: federated accuracy %.4f, loss %.4f (%d nodes, %d examples)",
                rnd,
                row.federated_accuracy,
                row.federated_loss,
                len(ok),
                sum(n["num-examples"] for n in row.evaluate_nodes),
            )
