"""FedAvg rounds timed from sampling to aggregate, with the app's own reply poll."""

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from feddifrc_app.federation import REPLY_POLL_SECONDS  # the same poll as the app it is the floor of

app = ServerApp()


def _exchange(grid: Grid, msgs: list) -> list:
    pending = set(grid.push_messages(msgs))
    replies = []
    while pending:
        got = list(grid.pull_messages(pending))
        replies += got
        pending -= {r.metadata.reply_to_message_id for r in got}
        if pending:
            time.sleep(REPLY_POLL_SECONDS)
    return replies


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    n = int(rc["min-nodes"])
    while len(grid.get_node_ids()) < n:
        time.sleep(0.5)
    # The app's update layout: one float32 array per entry of "shapes" ("3x3x16x16,16,..."), each
    # with its own values (equal arrays would be one object in Flower's content-addressed store).
    shapes = [tuple(int(d) for d in s.split("x") if d) for s in str(rc["shapes"]).split(",")]
    rng = np.random.default_rng(0)
    arrays = ArrayRecord(
        {f"a{i}": Array(rng.standard_normal(s).astype(np.float32)) for i, s in enumerate(shapes)}
    )
    strategy = FedAvg(fraction_train=1.0, min_train_nodes=n, min_available_nodes=n)
    seconds = []
    for rnd in range(1, int(rc["num-server-rounds"]) + 1):
        t0 = time.perf_counter()
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({}), grid))
        replies = _exchange(grid, msgs)
        if any(r.has_error() for r in replies):
            raise RuntimeError(f"round {rnd}: {[r.error.reason for r in replies if r.has_error()]}")
        arrays, _ = strategy.aggregate_train(rnd, replies)
        seconds.append(time.perf_counter() - t0)
    out = Path(str(rc["out-file"]))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"round-seconds": seconds}))
    tmp.replace(out)
