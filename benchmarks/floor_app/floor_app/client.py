"""Import torch (as every real PyTorch ClientApp does) and reply at once with a new update.

The reply's arrays have the shapes of the ones received but new values, every array its own: Flower's
object store is content-addressed, so an update that repeated the global model's bytes, or arrays
that equal each other (two zero-filled arrays of one shape), would travel once or not at all, which
no real client's update does. Measured: ResNet-10's 62 arrays as "received + 1" were 38 objects
per reply, as distinct values 128 (the app's own update: 122 objects).

With the run config's ``sgd-step = true`` (the training floor) the update is one ``torch.optim.SGD``
step on the received arrays with a random gradient: a new process's first optimizer imports
``torch._dynamo`` (1-3 s on 2 cores), a cost torch puts on every ClientApp process that trains."""

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    rng = np.random.default_rng()  # fresh values per reply, as a trained update has
    received = msg.content["arrays"]
    if context.run_config.get("sgd-step", False):
        params = {k: torch.from_numpy(a.numpy().copy()).requires_grad_() for k, a in received.items()}
        for p in params.values():
            p.grad = torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32))
        torch.optim.SGD(params.values(), lr=0.1).step()
        new = {k: p.detach().numpy() for k, p in params.items()}
    else:
        new = {k: rng.standard_normal(a.shape).astype(a.dtype) for k, a in received.items()}
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in new.items()})})
    content["metrics"] = MetricRecord({"num-examples": 1})
    return Message(content, reply_to=msg)
