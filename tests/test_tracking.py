"""Experiment tracking (tracking.py): what a tracker is given is results.json's row, value by value,
once per round, also across a resume; a missing extra is a one-line error before any work.

The trackers are the real libraries, read back with their own readers: TensorBoard's event files
(tensorboard, in the test extra), MLflow's SQLite store and W&B's offline run file (mlflow and wandb
are not in the test extra, so those cases run only where they are installed; CI skips them), in
tracking_stores.py. The rows come from the real round loop without Flower (fakes.EchoingFederation's
two nodes); the Flower run with tracking on is the stop / resume simulation (test_simulation_resume.py).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from conftest import ROOT, make_config
from fakes import EchoingFederation, RecordingGrid, central_scores, round_loop, server_context, shifted
from flwr.app import Error, Message, MetricRecord
from flwr.common.constant import ErrorCode
from tracking_stores import READERS, expected, f32

from feddifrc_app import server_app, tracking
from feddifrc_app.casting import ConfigError
from feddifrc_app.outputs import RunDir
from feddifrc_app.results import RoundRow
from feddifrc_app.rounds import RoundLoop
from feddifrc_app.tools.run_config import app_defaults
from feddifrc_app.tools.sweep import Cell, Sweep


def test_the_tracked_scalars_are_the_numbers_of_the_results_json_row() -> None:
    row = RoundRow(
        3,
        nodes=[0, 2, 5],
        failures=[{"node": 11, "partition-id": 2, "reason": "timeout"}],
        train_metrics={"train-ce": 1.25, "num-examples": 40},
        dp_release={"population": 6, "sampled": 3, "count-stddev": None},
        epsilon=math.inf,  # results.json: null, so not logged
        epsilon_if_sample_secret=2.5,
        test_accuracy=0.75,
        test_loss=math.nan,  # null too
        seconds=4.0,
    )
    assert tracking.scalars(row) == {
        "nodes": 3.0,
        "failures": 1.0,
        "train-metrics/train-ce": 1.25,
        "train-metrics/num-examples": 40.0,
        "dp-release/population": 6.0,
        "dp-release/sampled": 3.0,
        "epsilon-if-sample-secret": 2.5,
        "test-accuracy": 0.75,
        "seconds": 4.0,
    }


def _moving(loop: RoundLoop) -> None:
    """Each round's aggregate moves the model a little (a run that learns, never frozen)."""
    loop.strategy.aggregate_train = lambda rnd, replies: (
        shifted(loop.arrays, 1e-3),
        MetricRecord({"train-total": 2.0 + rnd}),
    )


@pytest.mark.parametrize("backend", ["tensorboard", "mlflow", "wandb"])
def test_a_tracked_run_and_its_resume_log_every_row_of_results_json_once(tmp_path, backend) -> None:
    """Two rounds, then a resume to three (as `resume-from` continues a run): the store holds
    results.json's rows exactly, each (number, round) once, in one tracked run."""
    pytest.importorskip(backend)
    scores = iter([0.1, 0.2, 0.3, 0.4])
    loop = round_loop(tmp_path, lambda m: central_scores(2.0 + next(scores)), tracking__backend=backend)
    _moving(loop)
    read, stored = READERS[backend]
    loop.run_all(tracking.start(loop.cfg, loop.run.path, loop.results))
    first = expected(loop.run.path, stored)
    assert read(loop.run.path) == first and {s for _, s in first} == {0, 1, 2}

    run = loop.run.path
    cfg = make_config(method="fedavg", num_server_rounds=3, resume_from=str(run), tracking__backend=backend)
    results, checkpoint = RunDir(run).begin(cfg, run_id=2)
    resumed = RoundLoop(
        cfg, EchoingFederation(), RunDir(run), results, loop.evaluator, 10, checkpoint=checkpoint
    )
    _moving(resumed)
    resumed.run_all(tracking.start(cfg, run, results))
    both = expected(run, stored)
    assert {s for _, s in both} == {0, 1, 2, 3} and both[("test-loss", 3)] == [stored(2.4)]
    assert read(run) == both
    assert both[("train-metrics/train-total", 3)] == [5.0]  # MetricRecord of round 3


def test_tensorboard_drops_steps_an_earlier_process_wrote_after_the_checkpoint(tmp_path) -> None:
    """A process killed after logging a round whose checkpoint it never wrote: the resumed run
    writes that round again, and TensorBoard reads the new value only (purge_step)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    (tmp_path / "run").mkdir()
    cfg = make_config(method="fedavg", tracking__backend="tensorboard")
    early = tracking.start(cfg, tmp_path / "run", RunDir(tmp_path / "run").begin(cfg, 1)[0])
    for rnd, acc in [(0, 0.1), (1, 0.2), (2, 0.3)]:
        early.log(RoundRow(rnd, test_accuracy=acc))
    early.close("failed")
    kept = RunDir(tmp_path / "run").begin(cfg, 1)[0]
    kept.rounds, kept.resumed = [RoundRow(0), RoundRow(1)], [{"after-round": 1, "run-id": 2}]
    later = tracking.start(cfg, tmp_path / "run", kept)  # continues after round 1
    later.log(RoundRow(2, test_accuracy=0.5))
    later.close("completed")
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "run"))
    events = acc.Reload().Tensors("test-accuracy")
    assert [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in events] == [
        (0, f32(0.1)),
        (1, f32(0.2)),
        (2, f32(0.5)),
    ]


def test_a_shared_tracking_dir_keeps_runs_whose_folders_share_a_name_apart(tmp_path) -> None:
    """Two sweeps' `defaults-s0` cells tracked into one tracking.dir: two TensorBoard runs, each
    with its own rows, never one interleaved run; each run keeps its folder on a resume."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    shared = tmp_path / "tracking"
    cfg = make_config(method="fedavg", tracking__backend="tensorboard", tracking__dir=str(shared))
    for sweep, acc in [("a", 0.25), ("b", 0.75)]:
        run = tmp_path / sweep / "runs" / "defaults-s0"
        run.mkdir(parents=True)
        tracker = tracking.start(cfg, run, RunDir(run).begin(cfg, 1)[0])
        tracker.log(RoundRow(0, test_accuracy=acc))
        tracker.close("completed")
    folders = sorted((shared / "tensorboard").iterdir())
    assert len(folders) == 2 and all(f.name.startswith("defaults-s0-") for f in folders)
    got = {
        tuple(
            tensor_util.make_ndarray(e.tensor_proto).item()
            for e in EventAccumulator(str(f)).Reload().Tensors("test-accuracy")
        )
        for f in folders
    }
    assert got == {(0.25,), (0.75,)}
    assert tracking.run_key(tmp_path / "a" / "runs" / "defaults-s0") in {f.name for f in folders}


def test_the_tracked_run_is_named_after_the_run_folder_and_carries_config_and_tags(tmp_path) -> None:
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    (tmp_path / "run").mkdir()
    cfg = make_config(method="fedavg", tracking__backend="tensorboard", tracking__tags="conf:a,seed:3")
    tracker = tracking.start(cfg, tmp_path / "run", RunDir(tmp_path / "run").begin(cfg, 1)[0])
    tracker.close("completed")
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "run")).Reload()
    raw = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(raw).session_start_info.hparams
    assert {k: v.WhichOneof("kind") for k, v in hparams.items()}.keys() == cfg.to_flat().keys()
    assert hparams["strategy.name"].string_value == "fedavg" and hparams["seed"].number_value == 7
    assert hparams["tracking.tags"].string_value == "conf:a,seed:3"


# ------------------------------------------------------------------ refused before any work


def test_a_missing_extra_is_one_line_naming_the_install_before_the_run_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how Python hides an installed package
    grid = RecordingGrid(node_ids=[11, 12])
    with pytest.raises(ConfigError) as e:
        server_app.main(grid, server_context(tmp_path, tracking__backend="mlflow"))
    assert str(e.value) == (
        "config key 'tracking.backend' = 'mlflow' needs the mlflow package, which is not installed: "
        "pip install 'feddifrc-app[mlflow]' (or set tracking.backend = 'none')"
    )
    assert grid.calls == [] and not (tmp_path / "runs").exists()
    sweep = Sweep(tmp_path / "sweep", ROOT, app_defaults(ROOT), {"tracking.backend": "mlflow"})
    with pytest.raises(ConfigError, match=r"pip install 'feddifrc-app\[mlflow\]'"):
        sweep.validate([Cell("", 0)])  # before the sweep's first cell
    tracking.check(make_config(tracking__backend="none"))  # none needs nothing


def test_an_unusable_tracking_dir_is_one_line_naming_it_before_any_work(tmp_path) -> None:
    """A tracking.dir under a file fails at load; one that cannot be created (/proc/nope) when the
    ServerApp starts, before the run folder or any node: never a bare errno."""
    (tmp_path / "file").write_text("x")
    under = tmp_path / "file" / "tracking"
    with pytest.raises(ConfigError) as e:
        make_config(tracking__backend="tensorboard", tracking__dir=str(under))
    assert str(e.value) == (
        f"config key 'tracking.dir' = '{under}' is invalid: {tmp_path / 'file'} is a file, so no folder "
        "can be created under it; expected a folder path"
    )
    if Path("/proc/self").is_dir() and not Path("/proc/nope").exists():  # Linux: /proc takes no folder
        grid = RecordingGrid(node_ids=[11, 12])
        with pytest.raises(ConfigError) as e:
            server_app.main(
                grid, server_context(tmp_path, tracking__backend="tensorboard", tracking__dir="/proc/nope")
            )
        assert str(e.value) == (
            "config key 'tracking.dir' = '/proc/nope' cannot be used (No such file or directory: "
            "'/proc/nope'); set it to a folder this user can create and "
            "write, or to '' (the run folder)"
        )
        assert grid.calls == [] and not (tmp_path / "runs").exists()
    tracking.check(make_config(tracking__backend="tensorboard", tracking__dir=str(tmp_path / "t")))
    assert (tmp_path / "t").is_dir()  # created, as the tracker would


@pytest.mark.parametrize(
    "tags, bad",
    [("conf:a,x", None), ("a" * 65, "a" * 65), ("conf:a,café:x", "café:x"), ("a=b", "a=b")],
)
def test_tags_are_checked_against_what_every_backend_takes(tags, bad) -> None:
    cfg = make_config(tracking__tags=tags)
    if bad is None:
        tracking.check(cfg)
        return
    with pytest.raises(ConfigError, match=r"^config key 'tracking.tags' = .* is invalid: tag ") as e:
        tracking.check(cfg)
    assert repr(bad) in str(e.value)


def test_unknown_backend_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"'tracking.backend' = 'comet' is invalid: expected one of"):
        make_config(tracking__backend="comet")
    assert make_config().tracking.backend == "none"  # off by default
    choices = dict(make_config().tracking.__dataclass_fields__)["backend"].metadata["choices"]
    assert set(choices) == {"none", *tracking.MODULES}  # one tracker per choice


def test_a_failed_setup_closes_the_tracked_run_as_failed(tmp_path) -> None:
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    def fail(m: Message) -> Message:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="no data"), reply_to=m)

    with pytest.raises(RuntimeError, match=r"^setup: no node answered"):
        server_app.main(
            RecordingGrid([11, 12], reply=fail), server_context(tmp_path, tracking__backend="tensorboard")
        )
    acc = EventAccumulator(str(tmp_path / "runs" / "r" / "tensorboard" / "r"))
    (status,) = acc.Reload().Tensors("status/text_summary")
    assert tensor_util.make_ndarray(status.tensor_proto).item() == b"failed"


# ------------------------------------------------------------------ the sweep's cells


def test_a_sweep_tags_each_cell_with_its_conf_seed_and_grid_values(tmp_path) -> None:
    conf = tmp_path / "cifar10-x.toml"
    conf.write_text('method = "fedavg"\n')
    sweep = Sweep(tmp_path / "out", tmp_path, {}, {"tracking.tags": "study:a"})
    assert "tracking.tags" not in Sweep(tmp_path / "off", tmp_path, {}, {}).cell_config(Cell("", 0))
    sweep.overrides["tracking.backend"] = "tensorboard"  # tagged only when tracked
    flat = sweep.cell_config(Cell(str(conf), 2, {"train.lr": 0.1, "diffusion.timestep": 300}))
    assert flat["tracking.tags"] == "study:a,conf:cifar10-x,seed:2,diffusion.timestep:300,train.lr:0.1"
    cfg = make_config(**{k.replace(".", "__").replace("-", "_"): v for k, v in flat.items()})
    assert cfg.tracking.tags[1:3] == ("conf:cifar10-x", "seed:2") and len(cfg.tracking.tags) == 5
    tracking.check(cfg)
    # A comma would split the tag (tracking.tags is a list); past 64 characters W&B refuses it.
    long = {"diffusion.blocks": "1,2", "k": "x" * 80}
    assert tracking.cell_tags("", 0, long) == [
        "conf:defaults",
        "seed:0",
        "diffusion.blocks:1 2",
        "k:" + "x" * 62,
    ]
