"""What the server keeps of a node's error: the node's own words, first and short; and what its
wait for min-nodes logs, over a real LinkState and Grid."""

from __future__ import annotations

import re

from fakes import SuperLink

from feddifrc_app.federation import REASON_CHARS, node_reason

# What Flower's simulation relays for a ClientApp that raised (vce_api: str(type) + ":<'" + str(ex)
# + "'>", the Ray task error holding the actor's traceback and Flower's ClientAppException).
RAY = (
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
    '(pid=4242, ip=127.0.0.1, actor_id=ab12)\n  File "/site-packages/flwr/simulation/ray_transport/'
    'ray_actor.py", line 65, in run\n    raise ClientAppException(str(ex)) from ex\n'
    "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred. Message: "
    "1 training image(s) on this node: BatchNorm needs at least 2 per batch'>"
)


def test_a_ray_wrapped_client_error_is_reduced_to_the_nodes_own_message() -> None:
    assert len(RAY) > 400
    assert node_reason(RAY) == "1 training image(s) on this node: BatchNorm needs at least 2 per batch"


def test_deployment_and_traceback_errors_keep_their_type_and_message() -> None:
    assert (
        node_reason("<class 'ZeroDivisionError'>:<'division by zero'>")
        == "ZeroDivisionError: division by zero"
    )
    tb = (
        'Traceback (most recent call last):\n  File "x.py", line 1\nfeddifrc_app.device.DeviceError: no GPU\n'
    )
    assert node_reason(tb) == "DeviceError: no GPU"
    assert node_reason("Node Unavailable") == "Node Unavailable"
    assert node_reason("") == ""


def test_a_long_reason_is_cut_to_one_short_line() -> None:
    out = node_reason("Exception ClientAppException occurred. Message: " + "a\nb " * 400)
    assert len(out) == REASON_CHARS and out.endswith("...") and "\n" not in out
    assert out.startswith("a b a b")


# --------------------------------------------------------------------- waiting for min-nodes


def test_a_wait_for_min_nodes_that_gives_up_says_so_with_the_count_the_timeout_and_what_to_change(
    caplog,
) -> None:
    """A deployment whose min-nodes exceeds the SuperNodes that ever connect: the ServerApp's
    last words name min-nodes, the count, the timeout and the keys to change (they said only
    "no SuperNode connected" or "2 of min-nodes = 3 ... going on"), and the wait logs its count
    when it changes, not once a second."""
    import logging

    import pytest
    from conftest import make_config

    from feddifrc_app.federation import Federation

    link = SuperLink()
    cfg = make_config(min_nodes=3, min_nodes_timeout=1.0, fraction_train=0.5)
    with caplog.at_level(logging.INFO, logger="flwr.feddifrc"), pytest.raises(RuntimeError) as e:
        Federation(link.grid, cfg).wait_for_nodes()
    assert str(e.value) == (
        "no SuperNode connected within min-nodes-timeout = 1s (min-nodes = 3): start the SuperNodes and "
        "check that they reach this SuperLink's Fleet API (`flwr supernode list <connection>` shows them "
        "online), or raise min-nodes-timeout"
    )
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for nodes")]
    (line,) = waiting  # once for the count 0 (the wait polls every second, and repeats every 30 s)
    assert re.fullmatch(
        r"waiting for nodes: 0 of min-nodes = 3 connected; min-nodes-timeout = 1s \([01]s left\), "
        r"then the run goes on with those connected",
        line,
    ), line

    caplog.clear()
    nodes = sorted(link.supernode() for _ in range(2))
    with caplog.at_level(logging.INFO, logger="flwr.feddifrc"):
        assert Federation(link.grid, cfg).wait_for_nodes() == nodes
    (warning,) = [r for r in caplog.records if r.name == "flwr.feddifrc" and r.levelno == logging.WARNING]
    assert warning.getMessage() == (
        "only 2 of min-nodes = 3 SuperNodes connected within min-nodes-timeout = 1s: going on with 2 "
        "(fraction-train = 0.5 trains 1 a round). To run on 2, set min-nodes = 2 and fraction-train for "
        "them (a deployment: every node's num-partitions too; docs/deploy.md, 'Fewer machines than the "
        "paper's'); to run on 3, start the other 1 SuperNodes (a simulation: num-supernodes) or raise "
        "min-nodes-timeout"
    )


def test_a_supernode_that_connects_during_the_wait_ends_it_without_a_warning(caplog) -> None:
    import logging
    import threading

    from conftest import make_config

    from feddifrc_app.federation import Federation

    link = SuperLink()
    first = link.supernode()
    late: list[int] = []
    joins = threading.Timer(0.5, lambda: late.append(link.supernode()))
    cfg = make_config(min_nodes=2, min_nodes_timeout=600.0)  # only a failing wait would take that long
    joins.start()
    try:
        with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
            ids = Federation(link.grid, cfg).wait_for_nodes()
    finally:
        joins.cancel()
    assert ids == sorted([first, *late]) and len(ids) == 2
    assert [r.getMessage() for r in caplog.records if r.name == "flwr.feddifrc"] == []
