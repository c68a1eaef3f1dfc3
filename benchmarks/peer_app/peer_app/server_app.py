"""peer-app: a Flower ServerApp (quickstart-pytorch's: FedAvg through Strategy.start, central evaluation).

The rounds are timed between the ends of consecutive central evaluations (``evaluate_fn`` runs
after the initial model and after every round's aggregate): one full round each."""

import json
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from peer_app.task import Net, app_config, eval_loaders, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    path = str(context.run_config["app-config"])
    cfg = app_config(path)
    loaders = eval_loaders(path)
    num_classes = loaders["test"].dataset.data.num_classes
    torch.manual_seed(cfg.seed)
    arrays = ArrayRecord(Net(cfg, num_classes).state_dict())
    stamps: list[float] = []
    accuracy: list[float] = []

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net(cfg, num_classes)
        model.load_state_dict(arrays.to_torch_state_dict())
        out = {}
        for name, loader in loaders.items():
            out[f"{name}-loss"], out[f"{name}-accuracy"] = test(model, loader)
        accuracy.append(out["test-accuracy"])
        stamps.append(time.perf_counter())
        return MetricRecord(out)

    strategy = FedAvg(
        fraction_train=cfg.fraction_train,
        fraction_evaluate=0.0,  # the app's fraction-evaluate = 0: central evaluation only
        min_train_nodes=1,
        min_available_nodes=cfg.min_nodes,
    )
    strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({}),
        num_rounds=cfg.num_server_rounds,
        evaluate_fn=global_evaluate,
    )
    out = Path(str(context.run_config["out-file"]))
    seconds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    out.with_suffix(".tmp").write_text(json.dumps({"round-seconds": seconds, "accuracy": accuracy}))
    out.with_suffix(".tmp").replace(out)
