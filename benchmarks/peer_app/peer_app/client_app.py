"""peer-app: a Flower ClientApp (quickstart-pytorch's train handler)."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from peer_app.task import Net, app_config, load_data
from peer_app.task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model on local data."""
    cfg = app_config(str(context.run_config["app-config"]))
    # The app's per-(seed, round, node) stream: the same batches and augmentation.
    rnd, pid = int(msg.content["config"]["server-round"]), int(context.node_config["partition-id"])
    seed = (cfg.seed * 1_000_003 + rnd * 9_176 + pid) % (2**31)
    torch.manual_seed(seed)
    trainloader = load_data(cfg, context.node_config, seed)
    model = Net(cfg, trainloader.dataset.data.num_classes)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())

    train_loss = train_fn(model, trainloader, cfg)

    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)
