"""One rule for the metrics of a round's train replies: every reply carries the same keys.

Flower's strategies refuse to aggregate replies whose metric keys differ, so one odd node would
fail the whole round (it happened once, in MOON's first round). Nodes report every key of
their method, a method with nothing to report its neutral value (``train_local``: a node half's
``train-<name>`` is 0 where it added no term). This is the server's check of that, in one place,
before any strategy sees the replies:

- a reply that lacks a key the aggregation reads (``num-examples``, and the strategy's own:
  ``strategy.required_metrics``) is that node's failure, with the keys named;
- any other key that not every reply carries is left out of all of them, with a warning naming
  the key and the nodes without it: the round aggregates, without that metric.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from flwr.app import Message, MetricRecord

from feddifrc_app import log

METRICS = "metrics"  # the reply's MetricRecord (client_app.train)
# The train reply's ConfigRecord naming the machine that computed it (client_app.origin):
# results.json's per-round "origins". A ConfigRecord, so no strategy aggregates it.
ORIGIN = "origin"


def _keys(reply: Message) -> set[str]:
    return set(reply.content[METRICS].keys()) if METRICS in reply.content else set()


def conform(
    replies: list[Message], required: Collection[str], describe: Callable[[Message], dict[str, Any]]
) -> tuple[list[Message], list[dict[str, Any]]]:
    """(replies that all carry the same metric keys, one failure row per reply that lacks a
    ``required`` key). ``describe``: reply -> its failure row's ``node`` and ``partition-id``."""
    kept, failures = [], []
    for r in replies:
        if missing := sorted(set(required) - _keys(r)):
            reason = f"the reply lacks metric key(s) {missing}, which the aggregation reads"
            failures.append({**describe(r), "reason": reason})
        else:
            kept.append(r)
    if not kept:
        return kept, failures
    common = set.intersection(*(_keys(r) for r in kept))
    if odd := sorted(set.union(*(_keys(r) for r in kept)) - common):
        without = {k: [describe(r)["node"] for r in kept if k not in _keys(r)] for k in odd}
        log.warning("train replies: metric key(s) not sent by every node, left out this round: %s", without)
        for r in kept:
            r.content[METRICS] = MetricRecord({k: v for k, v in r.content[METRICS].items() if k in common})
    return kept, failures
