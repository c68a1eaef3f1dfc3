"""SCAFFOLD (Karimireddy et al., ICML 2020): control variates that correct client drift.

Client i, K local steps of lr eta_l from the global model x, with server / own control
variates c / c_i: every step adds (c - c_i) to the gradient; afterwards (option II)
``c_i+ = c_i - c + (x - y_i) / (K * eta_l)`` and the node sends y_i and
``delta_c_i = c_i+ - c_i``. Server: ``x <- x + eta_g * sum_i w_i (y_i - x)`` (w_i the
example weights, as FedAvg) and ``c <- c + (|S| / N) * mean_i delta_c_i``, with |S| the
nodes that replied and N the federation's distinct nodes: the train config's ``num-nodes``
(``federation.NUM_NODES``, set by the round loop) or, without it, the nodes the Grid has (all
that Flower's own ``Strategy.start`` samples from). Control variates cover trainable parameters only.

A node's new c_i counts only once the server has added its delta_c_i to c: the node keeps
c_i+ as pending (with its round) and each train message tells it the last round whose
delta_c_i from it the server accepted (``ACCEPTED``). A round whose aggregate the server
rejects (non-finite: ``rounds.RoundLoop`` restores the strategy state, so also ``accepted``),
and a reply that never arrived, leave both c and c_i as they were: c = (1/N) sum_i c_i holds.

With SGD momentum rho (the paper uses plain SGD), K steps of lr move the model like a_K
plain steps, ``a_K = (K - rho (1 - rho^K) / (1 - rho)) / (1 - rho)`` (FedNova's factor),
so option II divides by ``a_K * lr``; dividing by ``K * lr`` overstates c_i about
1 / (1 - rho) times, and on mnist-5k (rho = 0.9, alpha = 0.05) drove the loss up from
round 2 and the model to chance by round 4. With rho = 0 it is the paper's ``K * lr``.

Here: the record keys and the config rules (Flower-free: ``load_config`` runs them where
Flower is not installed); the node half in ``node.py``, the strategy in ``server.py``,
imported when a hook is called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from feddifrc_app.methods._local_steps import fresh_momentum
from feddifrc_app.strategy_rules import TWO_RECORDS

if TYPE_CHECKING:
    from flwr.app import Message

    from feddifrc_app.halves import Node
    from feddifrc_app.methods.scaffold.node import Corrected

CONTROL = "scaffold-c"  # server -> node: the server control variate
DELTA = "scaffold-dc"  # node -> server: the change of the node's control variate
OWN = "scaffold-ci"  # Context.state: this node's control variate, kept across rounds
PENDING = "scaffold-ci-pending"  # Context.state: c_i+ of the node's last training, not yet confirmed
PENDING_ROUND = "scaffold-ci-round"  # Context.state: {"round": the round that c_i+ is from}
ACCEPTED = "scaffold-accepted"  # server -> node config: last round whose delta_c_i from it made c


def check_config(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    if v["strategy.name"] == "scaffold":
        fresh_momentum(v)  # option II divides by FedNova's a_K


def node_state(v: Mapping[str, Any]) -> str:
    return "strategy.name = 'scaffold'" if v["strategy.name"] == "scaffold" else ""


def dp_refusal(v: Mapping[str, Any]) -> str:
    # Server-side clipping would clip delta c against the model; the client mods refuse it.
    return f"strategy.name = 'scaffold' {TWO_RECORDS}" if v["strategy.name"] == "scaffold" else ""


def node_half(msg: Message, n: Node) -> Corrected | None:
    from feddifrc_app.methods.scaffold import node

    return node.node_half(msg, n)


# The strategies this package brings (``strategies``) -> the strategy.* keys that shape their aggregate.
STRATEGIES = {"scaffold": ("server-learning-rate",)}


def strategies() -> dict[str, Any]:
    """``strategy.name`` -> (the run config, the arguments every strategy takes) -> SCAFFOLD."""
    from feddifrc_app.methods.scaffold.server import Scaffold

    return {"scaffold": lambda c, k: Scaffold(**k, server_learning_rate=c.strategy.server_learning_rate)}
