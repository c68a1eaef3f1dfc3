"""What the server keeps of a node's error: the node's own words, first and short."""

from __future__ import annotations

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
