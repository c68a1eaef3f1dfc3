"""The server's view of the nodes: who is who (setup exchange), seeded sampling, and replies.

Flower's own loop (``Strategy.start``) samples with the unseeded global ``random`` and
drops the node a failed reply came from; here sampling is seeded per round on partition
ids, so a resumed run repeats the uninterrupted one, and every failure is named.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.exit import add_exit_handler

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.halves import SETUP_WORK
from feddifrc_app.strategy_rules import sampled_per_round  # (the config's rules use it too)

SETUP = f"{MessageType.QUERY}.setup"
# What a strategy knows of the federation beyond the nodes a round shows it (its Grid's
# get_node_ids): keys of the train config the round loop hands to configure_train (round_config).
# Under Flower's own Strategy.start a strategy goes without them: it samples from every node.
NUM_NODES = "num-nodes"  # N: the distinct nodes the federation has met (SCAFFOLD's |S| / N)
POPULATION = "population"  # the nodes this round's sample was drawn from (the DP accountant's N)
# How long a reply may wait for the ServerApp to notice it. Flower's Grid.send_and_receive sleeps
# 3 s between pulls of the SuperLink's HTTP Grid; one pull is one small request, so 0.1 s costs
# the SuperLink ~10 requests a second while a round waits.
REPLY_POLL_SECONDS = 0.1
# How often a wait for min-nodes repeats its count when the count stays the same.
WAIT_NOTE_SECONDS = 30.0


# How much of a node's error a round's record keeps: its own last message line, not Ray's repr,
# ANSI colours and the traceback around it (those stay in the ServerApp log).
REASON_CHARS = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_WRAPPED = "occurred. Message: "  # Flower's ClientAppException: "Exception X occurred. Message: <str(ex)>"
_RAISED = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))\s*:\s*(.+)$")
_FLOWER = re.compile(r"^<class '(?:[\w.]*\.)?(\w+)'>:<'(.*)$")  # Flower's "<class 'X'>:<'message'>"


def node_reason(reason: str) -> str:
    """A node's error in its own words: the message the ClientApp raised (or else the last
    ``SomeError: message`` line) without Ray's repr, ANSI colours and the traceback around it,
    on one line of at most ``REASON_CHARS`` characters."""
    text = _ANSI.sub("", reason)
    if _WRAPPED in text:
        line = " ".join(text.rsplit(_WRAPPED, 1)[1].split())
    else:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        line = next((ln for ln in reversed(lines) if _RAISED.match(ln)), lines[-1] if lines else "")
        if m := _RAISED.match(line) or _FLOWER.match(line):
            line = f"{m[1]}: {m[2]}"
    line = line.removesuffix("'>").strip()
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."


class RunStopped(Exception):
    """The run was stopped (``flwr stop``) or its process was told to exit."""


_stopping = threading.Event()
_watching = False


def watch_for_stop() -> None:
    """Notice ``flwr stop`` while the ServerApp still runs.

    Flower ends a stopped run's process through a signal and its exit handlers; in simulation the
    ServerApp is a thread that would go on until the forced exit. This flag, set by an exit
    handler, is checked while waiting for replies and between rounds, so no round starts or is
    saved after the stop is known.
    """
    global _watching
    if not _watching:
        add_exit_handler(_stopping.set, run_before_force_exit=True)
        _watching = True
    _stopping.clear()


def check_stop() -> None:
    if _stopping.is_set():
        raise RunStopped("the run was stopped (flwr stop, or the ServerApp process was signalled)")


class _Chosen:
    """A view of the Grid that shows the strategy only the nodes our seeded sampler chose."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid, self._ids = grid, node_ids

    def get_node_ids(self) -> list[int]:
        return list(self._ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def _senders(msgs: list[Message]) -> Callable[[Message], int]:
    """reply -> the node it answers for. When a node is lost, the SuperLink itself answers with an
    error whose src_node_id is the SuperLink's, so map replies through the message they reply to."""
    dst = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}
    return lambda r: dst.get(r.metadata.reply_to_message_id, r.metadata.src_node_id)


class Federation:
    """The connected nodes, their partition ids, and message exchange with them."""

    def __init__(self, grid: Grid, cfg: Config) -> None:
        self.grid, self.cfg = grid, cfg
        self.partition_of: dict[int, int] = {}
        self.population = 0  # nodes the last training sample was drawn from (sample)

    def _order(self, node: int) -> tuple[int, int]:
        # Partition order everywhere, so sampling and float sums are identical across runs.
        return (self.partition_of.get(node, 1 << 30), node)

    def distinct_nodes(self) -> int:
        """How many nodes the federation has met, each counted once: by partition id where a node
        has one (a simulated node, or one rejoined under a new node id, keeps it), else by node id
        (nodes that bring their own data folder all report partition id -1)."""
        return len({(p, None) if p >= 0 else (p, n) for n, p in self.partition_of.items()})

    def wait_for_nodes(self) -> list[int]:
        """Wait up to min-nodes-timeout for min-nodes nodes; any connected node will do after (a
        simulation with fewer SuperNodes than min-nodes starts after it, not after an hour).
        The log says how many are connected when that changes (and every ``WAIT_NOTE_SECONDS``),
        and, when the wait gives up, min-nodes, the count, the timeout and what to change."""
        timeout, want = self.cfg.min_nodes_timeout, self.cfg.min_nodes
        start = time.monotonic()
        said: tuple[int, float] | None = None  # (count, when) of the last "waiting" line
        while len(ids := sorted(self.grid.get_node_ids())) < want and time.monotonic() - start <= timeout:
            now = time.monotonic()
            if said is None or said[0] != len(ids) or now - said[1] >= WAIT_NOTE_SECONDS:
                log.info(
                    "waiting for nodes: %d of min-nodes = %d connected; min-nodes-timeout = %gs "
                    "(%.0fs left), then the run goes on with those connected",
                    len(ids),
                    want,
                    timeout,
                    max(0.0, timeout - (now - start)),
                )
                said = (len(ids), now)
            check_stop()
            time.sleep(1.0)
        if not ids:
            raise RuntimeError(
                f"no SuperNode connected within min-nodes-timeout = {timeout:g}s (min-nodes = {want}): "
                "start the SuperNodes and check that they reach this SuperLink's Fleet API "
                "(`flwr supernode list <connection>` shows them online), or raise min-nodes-timeout"
            )
        if len(ids) < want:
            per_round = sampled_per_round(self.cfg.fraction_train, len(ids))
            log.warning(
                "only %d of min-nodes = %d SuperNodes connected within min-nodes-timeout = %gs: going on "
                "with %d (fraction-train = %g trains %d a round). To run on %d, set min-nodes = %d and "
                "fraction-train for them (a deployment: every node's num-partitions too; docs/deploy.md, "
                "'Fewer machines than the paper's'); to run on %d, start the other %d SuperNodes (a "
                "simulation: num-supernodes) or raise min-nodes-timeout",
                len(ids),
                want,
                timeout,
                len(ids),
                self.cfg.fraction_train,
                per_round,
                len(ids),
                len(ids),
                want,
                want - len(ids),
            )
        return ids

    def setup(self, node_ids: list[int], want_stats: bool, sample: int = 0) -> dict[int, RecordDict]:
        """Ask nodes who they are (partition id, size, labels, teacher) and, once, for PCA statistics.

        ``sample`` > 0 (fewer than the nodes): every node says who it is, then a seeded sample of
        ``sample`` of them (drawn in partition order) is asked for the statistics, so the setup
        work and what the server holds grow with the sample, not with the federation."""
        if want_stats and 0 < sample < len(node_ids):
            out = self.setup(node_ids, want_stats=False)
            drawn = random.Random(f"setup {self.cfg.seed}").sample(list(out), sample)
            chosen = sorted(drawn, key=self._order)
            out.update(self.setup(chosen, want_stats=True))
            return out
        content = RecordDict({"config": ConfigRecord({SETUP_WORK: want_stats})})
        msgs = [Message(content=content, message_type=SETUP, dst_node_id=nid) for nid in node_ids]
        out: dict[int, RecordDict] = {}
        # With statistics, a node may first extract every image (SD-2.1, CIFAR-10: hours): its own timeout.
        timeout = self.cfg.strategy.setup_timeout if want_stats else self.cfg.strategy.round_timeout
        replies = self._send_and_receive(msgs, timeout)
        sender = _senders(msgs)  # after sending: message ids are set when a message is pushed
        errors = []
        for r in replies:
            if r.has_error():
                log.warning("setup: node %s failed: %s", sender(r), r.error.reason)
                errors.append(f"node {sender(r)}: {node_reason(r.error.reason)}")
            else:
                out[sender(r)] = r.content
                self.partition_of[sender(r)] = int(r.content["info"]["partition-id"])
        if not out and node_ids and (want_stats or not self.partition_of):
            # The reason reaches `flwr ls`, not only the ClientApp logs (a basis-nodes sample whose
            # every node failed too: the basis would have no statistics).
            raise RuntimeError(
                f"setup: no node answered ({'; '.join(errors) or f'no reply within {timeout:g}s'})"
            )
        # In partition order, not the replies': the federated basis sums the nodes' statistics in it.
        return {n: out[n] for n in sorted(out, key=self._order)}

    def sample(self, rnd: int, evaluate: bool = False) -> list[int]:
        """This round's nodes: ``fraction-train`` of the known ones (``evaluate``: ``fraction-evaluate``
        of them, drawn independently of the training ones), seeded by (seed, round)."""
        current = sorted(self.grid.get_node_ids())
        new = [n for n in current if n not in self.partition_of]
        if new:  # joined, or rejoined with a new id, since setup: learn who they are
            self.setup(new, want_stats=False)
        known = sorted((n for n in current if n in self.partition_of), key=self._order)
        fraction = self.cfg.fraction_evaluate if evaluate else self.cfg.fraction_train
        k = min(sampled_per_round(fraction, len(known)), len(known))
        if not evaluate:
            self.population = len(known)  # the DP accountant's N for this round (round_config)
        seed = f"evaluate {self.cfg.seed} {rnd}" if evaluate else self.cfg.seed * 1_000_003 + rnd
        return sorted(random.Random(seed).sample(known, k), key=self._order)

    def view(self, chosen: list[int]) -> _Chosen:
        return _Chosen(self.grid, chosen)

    def round_config(self) -> dict[str, int]:
        """The training round's NUM_NODES and POPULATION, for its train config."""
        return {NUM_NODES: self.distinct_nodes(), POPULATION: self.population}

    def _send_and_receive(self, msgs: list[Message], timeout: float) -> list[Message]:
        """Grid.send_and_receive (same push, pull and timeout) that also ends on a stop."""
        pending = set(self.grid.push_messages(msgs))
        # The in-memory (simulation) Grid has its own pull_interval (0.1 s); the HTTP one has none.
        poll = min(getattr(self.grid, "pull_interval", REPLY_POLL_SECONDS), REPLY_POLL_SECONDS)
        deadline = time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            check_stop()
            got = list(self.grid.pull_messages(pending))
            replies += got
            pending -= {r.metadata.reply_to_message_id for r in got}
            if not pending or time.monotonic() >= deadline:
                break
            # A pull costs the SuperLink a look-up per pending message: with thousands pending (the
            # setup query of a large federation) ask less often, at least once a second.
            time.sleep(min(1.0, poll * max(1.0, len(pending) / 100)))
        return replies

    def exchange(self, msgs: list[Message], chosen: list[int]) -> tuple[list[Message], list[dict[str, Any]]]:
        """Send, wait up to round-timeout; the good replies in partition order, and one row per failure."""
        replies = self._send_and_receive(msgs, self.cfg.strategy.round_timeout)
        sender = _senders(msgs)  # after sending: message ids are set when a message is pushed
        replies.sort(key=lambda r: self._order(sender(r)))
        got = {sender(r) for r in replies}
        failures = []
        for r in replies:
            if r.has_error():
                log.warning("node %s failed: %s", sender(r), r.error.reason)  # the whole of it, once
                n = sender(r)
                failures.append(
                    {
                        "node": n,
                        "partition-id": self.partition_of.get(n),
                        "reason": node_reason(r.error.reason),
                    }
                )
        failures += [
            {"node": n, "partition-id": self.partition_of[n], "reason": "no reply before round-timeout"}
            for n in chosen
            if n not in got
        ]
        return [r for r in replies if not r.has_error()], failures
