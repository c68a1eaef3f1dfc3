"""Import torch (as every real PyTorch ClientApp does) and echo the update back."""

import torch  # noqa: F401  (the import is the point: it is part of every ClientApp process's cost)
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    content = RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 1})})
    return Message(content, reply_to=msg)
