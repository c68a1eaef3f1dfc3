"""Each experiment tracker's store read back with the backend's own reader (test_tracking.py, and
the Flower run with tracking on in test_simulation_resume.py).

Each reader: {(tag, step): [values]} over everything the backend wrote (a repeated step shows).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from feddifrc_app import tracking
from feddifrc_app.results import RoundRow


def read_tensorboard(base: Path) -> dict[tuple[str, int], list[float]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[tuple[str, int], list[float]] = {}
    files = sorted((base / "tensorboard").glob("*/events.out.tfevents.*"))
    assert files, f"no event file under {base / 'tensorboard'}"
    for f in files:
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    out.setdefault((v.tag, event.step), []).append(tensor_util.make_ndarray(v.tensor).item())
    return out


def read_mlflow(base: Path) -> dict[tuple[str, int], list[float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{base / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("feddifrc").experiment_id])
    out: dict[tuple[str, int], list[float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            out.setdefault((key, m.step), []).append(m.value)
    return out


def wandb_records(path: Path) -> list:
    """The records of a W&B offline run file (LevelDB's log format: 32 KiB blocks of chunks with a
    7-byte header, after W&B's own 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, parts, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        parts, pos = parts + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or a record's last chunk
            records.append(pb.Record.FromString(parts))
            parts = b""
    return records


def read_wandb(base: Path) -> dict[tuple[str, int], list[float]]:
    out: dict[tuple[str, int], list[float]] = {}
    files = sorted((base / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no offline run under {base / 'wandb'}"
    for f in files:
        for r in wandb_records(f):
            if r.WhichOneof("record_type") == "history":
                for item in r.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                        out.setdefault((key, r.history.step.num), []).append(json.loads(item.value_json))
    return out


def f32(x: float) -> float:
    """TensorBoard's scalars are float32 (the only float its Rust data server shows)."""
    return float(np.float32(x))


# Each backend's reader, and what it holds of a float of results.json.
READERS = {
    "tensorboard": (read_tensorboard, f32),
    "mlflow": (read_mlflow, float),
    "wandb": (read_wandb, float),
}


def expected(run_dir: Path, stored=float) -> dict[tuple[str, int], list[float]]:
    """What a store must hold: every row of ``run_dir``'s results.json once, as ``stored`` keeps a float."""
    rows = json.loads((run_dir / "results.json").read_text())["rounds"]
    return {
        (k, row["round"]): [stored(v)]
        for row in rows
        for k, v in tracking.scalars(RoundRow.from_json(row)).items()
    }
