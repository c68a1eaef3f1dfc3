"""Import torch (as every real PyTorch ClientApp does) and reply at once with a new update.

The reply's arrays have the shapes of the ones received but new values: an update that repeated
the global model's bytes would be deduplicated by Flower's object store (content-addressed) and
never travel, which no real client's update does."""

import torch  # noqa: F401  (the import is the point: it is part of every ClientApp process's cost)
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    update = ArrayRecord({k: Array(a.numpy() + 1) for k, a in msg.content["arrays"].items()})
    content = RecordDict({"arrays": update, "metrics": MetricRecord({"num-examples": 1})})
    return Message(content, reply_to=msg)
