"""Optional experiment tracking (``tracking.backend``): the run's config and every round's row of
results.json, streamed to TensorBoard (event files), MLflow (a local SQLite store) or Weights &
Biases (offline mode only: nothing leaves the machine; ``wandb sync`` uploads later, by hand).

Each backend is an optional extra (``pip install 'feddifrc-app[tensorboard]'``, ``[mlflow]``,
``[wandb]``), checked when the ServerApp starts (``check``), before any work; nodes never need one.
Where it writes (``tracking.dir``, "" = the run folder)::

    <dir>/tensorboard/<run-name>/   event files         tensorboard --logdir <dir>/tensorboard
                                    (a shared tracking.dir: <run-name>-<8 hex digits of the run's path>)
    <dir>/mlflow/mlflow.db          MLflow's store      mlflow ui --backend-store-uri sqlite:///<dir>/mlflow/mlflow.db
    <dir>/wandb/offline-run-*/      W&B offline runs    wandb sync <dir>/wandb/offline-run-*

What is logged is the row results.json holds (``scalars``) at step = its round. The round loop logs
a row once it is committed (round 0 once saved, a trained round once its checkpoint is written), so
a resumed run, which starts after its checkpoint's round, continues the same tracked run without
repeating a step (TensorBoard also purges any later step an earlier process left behind).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from feddifrc_app.casting import ConfigError, invalid
from feddifrc_app.results import RoundRow, finite_or_none, json_key

if TYPE_CHECKING:
    from feddifrc_app.config import Config
    from feddifrc_app.results import Results

# The backends and the module each one imports (its extra in pyproject.toml has the backend's name).
MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
MAX_TAG = 64  # W&B's limit on a tag's length
_TAG_NAME = re.compile(r"^[A-Za-z0-9_.\- /]+$")  # what MLflow accepts in a tag's key
# The scores the TensorBoard HParams table shows beside each run's config (their last values).
_HPARAM_METRICS = tuple(json_key(n) for n in ("val_accuracy", "test_accuracy", "federated_accuracy"))


class Tracker(Protocol):
    def log(self, row: RoundRow) -> None:
        """One committed row of results.json, at step ``row.round``."""

    def close(self, status: str) -> None:
        """The run ended (``completed``, ``diverged``, ``stopped`` or ``failed``)."""


class NoTracker:
    """``tracking.backend = "none"``: nothing is written."""

    def log(self, row: RoundRow) -> None:
        pass

    def close(self, status: str) -> None:
        pass


def check(cfg: Config) -> None:
    """The chosen backend is installed and the tags are ones every backend takes: a ConfigError
    naming the key (and the pip install) otherwise. Server-side only: the nodes never track."""
    backend = cfg.tracking.backend
    if backend != "none" and importlib.util.find_spec(MODULES[backend]) is None:
        raise ConfigError(
            f"config key 'tracking.backend' = {backend!r} needs the {MODULES[backend]} package, which "
            f"is not installed: pip install 'feddifrc-app[{backend}]' (or set tracking.backend = 'none')"
        )
    _check_dir(cfg)
    for tag in cfg.tracking.tags:
        if len(tag) > MAX_TAG or not _TAG_NAME.match(tag.partition(":")[0]):
            raise invalid(
                "tracking.tags",
                ",".join(cfg.tracking.tags),
                f"tag {tag!r}: expected 'name' or 'name:value', at most {MAX_TAG} characters, the "
                "name of letters, digits, '_', '-', '.', ' ' and '/'",
            )


def _check_dir(cfg: Config) -> None:
    """A tracking.dir the tracker can write: created here (as the tracker would), so one that cannot
    be (``/proc/nope``, a read-only disk) is a ConfigError naming the key before any work. A file
    above it is refused at load (casting.as_folder); "" is the run folder, checked with it."""
    if cfg.tracking.backend == "none" or not cfg.tracking.dir:
        return
    where = Path(cfg.tracking.dir)
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise ConfigError(
            f"config key 'tracking.dir' = {cfg.tracking.dir!r} cannot be used ({e.strerror}: "
            f"{str(e.filename or where)!r}); set it to a folder this user can create "
            "and write, or to '' (the run folder)"
        ) from None


def scalars(row: RoundRow) -> dict[str, float]:
    """The numbers of ``row`` as results.json holds them: a number under its key, an object's
    numbers as ``key/name`` (``train-metrics/train-ce``, ``dp-release/sampled``), a list as its
    length (``nodes`` sampled, ``failures``, ``evaluate-nodes``); ``round`` is the step, and a null
    (no validation split, a non-finite loss, an infinite epsilon) is not logged."""
    out: dict[str, float] = {}
    for key, value in finite_or_none(row.to_json()).items():
        if key == "round":
            continue
        if isinstance(value, dict):
            out |= {f"{key}/{k}": float(v) for k, v in value.items() if _number(v)}
        elif isinstance(value, list):
            out[key] = float(len(value))
        elif _number(value):
            out[key] = float(value)
    return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def cell_tags(conf: str, seed: int, grid: dict[str, Any]) -> list[str]:
    """A sweep cell's tags: its conf file, seed and grid values (``conf:cifar10-feddifrc``,
    ``seed:0``, ``diffusion.timestep:300``), each cut to ``MAX_TAG`` characters (the config that
    every backend also logs holds the full values); a comma in a value becomes a space."""
    tags = [f"conf:{Path(conf).stem if conf else 'defaults'}", f"seed:{seed}"]
    tags += [f"{k}:{str(v).replace(',', ' ')}" for k, v in sorted(grid.items())]
    return [t[:MAX_TAG] for t in tags]


def start(cfg: Config, run_dir: Path, results: Results) -> Tracker:
    """The run's tracker, its config logged; a resumed run (``results.resumed``) continues the
    tracked run of its folder after the last round it kept."""
    backend = cfg.tracking.backend
    if backend == "none":
        return NoTracker()
    where = Path(cfg.tracking.dir) if cfg.tracking.dir else run_dir
    resumed = bool(results.resumed)
    first = max((r.round for r in results.rounds), default=-1) + 1 if resumed else 0
    opened = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}[backend]
    return opened(cfg, where, run_dir, first)


def _digest(run_dir: Path) -> str:
    """The run folder's identity: the sha256 of its absolute path (W&B's run id, ``run_key``)."""
    return hashlib.sha256(str(run_dir).encode()).hexdigest()


def run_key(run_dir: Path) -> str:
    """A tracked run's folder name in a shared tracking.dir: the run folder's name and 8 hex digits
    of its path, so two sweeps' ``defaults-s0`` cells are two runs, never one interleaved run."""
    return f"{run_dir.name}-{_digest(run_dir)[:8]}"


def _tags(cfg: Config) -> dict[str, str]:
    return {name: value for name, _, value in (t.partition(":") for t in cfg.tracking.tags)}


class TensorBoardTracker:
    """Event files under ``<run folder>/tensorboard/<run-name>/``, or ``<tracking.dir>/tensorboard/
    <run_key>/``: one scalar per number of the row, as float32 (TensorBoard's default reader, its
    Rust data server, shows no float64 scalar), the config in the HParams dashboard."""

    def __init__(self, cfg: Config, where: Path, run_dir: Path, first: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # purge_step: a session start at this step (0 for a new run: TensorBoard takes the first start
        # as the run's); a later one drops the steps at or after it that an earlier process wrote.
        name = run_dir.name if where == run_dir else run_key(run_dir)  # a shared tracking.dir
        self.writer = SummaryWriter(str(where / "tensorboard" / name), purge_step=first)
        for summary in hparams(cfg.to_flat(), dict.fromkeys(_HPARAM_METRICS, 0.0)):
            self.writer.file_writer.add_summary(summary)
        if cfg.tracking.tags:
            self.writer.add_text("tags", ", ".join(cfg.tracking.tags), first)
        self.writer.flush()

    def log(self, row: RoundRow) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, row.round, new_style=True)
        self.writer.flush()  # on disk before the next round: a killed server loses no logged row

    def close(self, status: str) -> None:
        self.writer.add_text("status", status)
        self.writer.close()


class MLflowTracker:
    """A run in the SQLite store ``<dir>/mlflow/mlflow.db``, experiment ``tracking.project``: the
    config as params, the row's numbers as metrics, the run folder as the tag ``feddifrc.run-dir``
    (by which a resumed run finds its MLflow run again)."""

    RUN_DIR = "feddifrc.run-dir"

    def __init__(self, cfg: Config, where: Path, run_dir: Path, first: int) -> None:
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # no network, ever
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        folder = where / "mlflow"
        folder.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
        exp = self.client.get_experiment_by_name(cfg.tracking.project)
        if exp is None:
            where_to = (folder / "artifacts").as_uri()  # not ./mlruns in the server's cwd
            eid = self.client.create_experiment(cfg.tracking.project, artifact_location=where_to)
        else:
            eid = exp.experiment_id
        found = self._newest_run(eid, run_dir) if first else None
        if found:  # a resumed run: the same MLflow run, whose params (the first start's) stay
            self.run_id = found
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "feddifrc.resumed-at-round", str(first))
            return
        tags = {self.RUN_DIR: str(run_dir), **_tags(cfg)}
        self.run_id = self.client.create_run(eid, run_name=run_dir.name, tags=tags).info.run_id
        params = [Param(k, str(v)) for k, v in cfg.to_flat().items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def _newest_run(self, eid: str, run_dir: Path) -> str | None:
        """The id of the newest MLflow run of ``run_dir`` (a sweep cell started over left an older one)."""
        quote = '"' if "'" in str(run_dir) else "'"
        by_folder = f"tags.`{self.RUN_DIR}` = {quote}{run_dir}{quote}"
        runs = self.client.search_runs([eid], by_folder, max_results=1, order_by=["start_time DESC"])
        return runs[0].info.run_id if runs else None

    def log(self, row: RoundRow) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, row.round) for k, v in scalars(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str) -> None:
        self.client.set_tag(self.run_id, "feddifrc.status", status)
        ended = {"completed": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=ended)


class WandbTracker:
    """A W&B run in offline mode under ``<dir>/wandb/``, project ``tracking.project``, named after
    the run folder, its id derived from the folder (a resumed run continues it), the config as
    its config, ``tracking.tags`` as its tags; ``wandb sync`` uploads it when the user chooses."""

    def __init__(self, cfg: Config, where: Path, run_dir: Path, first: int) -> None:
        # No network, ever, also for what wandb starts: offline runs, no error reports to Sentry.
        os.environ.update(WANDB_MODE="offline", WANDB_ERROR_REPORTING="false")
        import wandb

        where.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            mode="offline",
            dir=str(where),
            project=cfg.tracking.project,
            name=run_dir.name,
            id=_digest(run_dir)[:16],
            resume="allow",
            tags=list(cfg.tracking.tags),
            config=cfg.to_flat(),
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )

    def log(self, row: RoundRow) -> None:
        self.run.log(scalars(row), step=row.round)

    def close(self, status: str) -> None:
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status == "completed" else 1)
