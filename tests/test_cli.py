"""The `feddifrc` command: parser table, one-line errors, and `extract` end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from feddifrc_app import cli
from feddifrc_app.run_config import load_app_config


def test_parser_has_subcommand_table():
    assert {"extract", "make-tiny"} <= set(cli.COMMANDS)
    p = cli.build_parser()
    a = p.parse_args(
        [
            "extract",
            "--app",
            ".",
            "--run-config",
            "seed=3",
            "--partitions",
            "0,3",
            "--split",
            "train,test",
            "--cache-dir",
            "/tmp/x",
            "--num-partitions",
            "4",
        ]
    )
    assert a.func is cli.cmd_extract and a.run_config == ["seed=3"] and a.num_partitions == 4
    assert a.partitions == "0,3" and a.split == "train,test" and a.cache_dir == "/tmp/x"
    d = p.parse_args(["extract"])
    assert (d.app, d.num_partitions, d.partitions, d.split, d.run_config) == (".", 10, None, "train", None)
    assert p.parse_args(["make-tiny"]).func is cli.cmd_make_tiny
    with pytest.raises(SystemExit):
        p.parse_args([])


def test_cli_errors_are_one_line_exit_2(capsys):
    assert cli.main(["extract", "--app", str(ROOT), "--run-config", "diffusion.timestep=5000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("feddifrc extract: error: config key 'diffusion.timestep'") and err.count("\n") == 1
    assert cli.main(["extract", "--app", str(ROOT), "--partitions", "0,12"]) == 2
    assert "--partitions" in capsys.readouterr().err
    assert cli.main(["extract", "--app", str(ROOT), "--split", "val"]) == 2


def test_extract_fedavg_needs_no_teacher(capsys):
    assert cli.main(["extract", "--app", str(ROOT), "--run-config", 'method="fedavg"']) == 0
    assert "nothing to extract" in capsys.readouterr().out


def test_fetch_names_the_teacher_weights_and_dataset_splits_and_fails_offline_in_one_line(
    tmp_path, capsys, monkeypatch
):
    from feddifrc_app.dataset import load_dataset
    from feddifrc_app.diffusion.pipeline import teacher_identity

    assert cli.main(["fetch", "--app", str(ROOT), "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    cfg = load_app_config(str(ROOT), None)
    ident = teacher_identity("tiny-mnist", tmp_path)
    assert f"teacher tiny-mnist: weights sha256 {ident.weights_hash} in {ident.folder}" in out
    for split in ("train", "test"):
        n = len(load_dataset(cfg.dataset, split, seed=cfg.seed))
        assert f"dataset mnist-5k/{split}: {n} images, 10 classes" in out
    assert f"copy {cfg.dataset.data_dir} (datasets)" in out

    # Offline, a hub id that is not in the cache: one line saying how to seed it, exit 2.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["fetch", "--app", str(ROOT), "--cache-dir", str(tmp_path), "--split", "test"]
    assert cli.main([*argv, "--run-config", "diffusion.model='nobody/no-such-model'"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("feddifrc fetch: error: diffusion model 'nobody/no-such-model' is not in")
    assert "hf download nobody/no-such-model" in err and err.count("\n") == 1
    # FedAvg needs no teacher: only the dataset.
    assert cli.main([*argv, "--run-config", "method='fedavg'"]) == 0
    out = capsys.readouterr().out
    assert "teacher" not in out.splitlines()[0] and "dataset mnist-5k/test" in out


def test_extract_end_to_end_twice_second_run_computes_nothing(tmp_cache, capsys):
    from feddifrc_app import teacher

    built, held = teacher.built(), teacher.loaded()
    argv = [
        "extract",
        "--app",
        str(ROOT),
        "--cache-dir",
        str(tmp_cache),
        "--num-partitions",
        "2",
        "--no-progress",
        "--chunk",
        "4",
        "--run-config",
        'dataset.name="digits" dataset.train-limit=10 partition.name="iid" diffusion.model="tiny"',
    ]
    assert cli.main([*argv, "--check"]) == 0
    check = capsys.readouterr().out
    assert "0 of 10 images cached (0.0%), 10 to extract" in check, check
    assert "'dtype': 'float32'" in check and "model" not in check  # the key: weights hash, no name
    assert not (tmp_cache / "features").exists() or not any((tmp_cache / "features").rglob("*.npz"))
    assert cli.main(argv) == 0
    out1 = capsys.readouterr()
    assert "computed 10" in out1.out, out1
    assert teacher.built() == built + 1  # the teacher was built for the misses ...
    assert teacher.loaded() == held  # ... and released after them
    shards = sorted((tmp_cache / "features").glob("*/shard-*.npz"))
    assert shards
    before = {p: p.read_bytes() for p in shards}

    assert cli.main(argv) == 0
    out2 = capsys.readouterr()
    assert "already cached 10, computed 0" in out2.out, out2
    assert teacher.built() == built + 1  # warm cache: the teacher was never built
    assert {p: p.read_bytes() for p in sorted((tmp_cache / "features").glob("*/shard-*.npz"))} == before
    assert cli.main([*argv, "--check"]) == 0
    assert "10 of 10 images cached (100.0%), 0 to extract" in capsys.readouterr().out

    key_dir = shards[0].parent
    assert sum(len(np.load(p)["ids"]) for p in shards) == 10
    assert (key_dir / "key.json").is_file()


def _fake_run(run_dir: Path) -> None:
    from feddifrc_app.files import write_json
    from feddifrc_app.outputs import RunDir
    from feddifrc_app.results import Results

    run = RunDir(run_dir)
    run_dir.mkdir(parents=True)
    write_json(run_dir / "config.json", {"num-server-rounds": 3})
    run.save_results(
        Results.from_json(
            {
                "method": "feddifrc",
                "strategy": "fedavg",
                "dataset": "digits",
                "partition": "dirichlet",
                "teacher": {"model": "tiny-seed0", "random-weights": True},
                "rounds": [
                    {"round": 0, "test-accuracy": 0.1, "test-loss": 2.3},
                    {
                        "round": 1,
                        "test-accuracy": 0.4,
                        "test-loss": 1.9,
                        "failures": [],
                        "train-metrics": {"train-tdcl": 2.2},
                    },
                    {
                        "round": 2,
                        "test-accuracy": 0.3,
                        "test-loss": 1.7,
                        "failures": [{"node": 5, "partition-id": 1, "reason": "lost"}],
                    },
                ],
            }
        )
    )


def test_report_prints_table_summary_and_random_teacher_label(tmp_path, capsys):
    _fake_run(tmp_path / "r")
    assert cli.main(["report", str(tmp_path / "r"), "--plots"]) == 0
    out = capsys.readouterr().out
    assert "final 30.00%  best 40.00%  mean of last 5 35.00%" in out
    assert "RANDOM-weight teacher" in out and "2.2000" in out
    assert (tmp_path / "r" / "accuracy.png").is_file()
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "results.json does not exist" in capsys.readouterr().err


def test_status_lists_runs_with_progress_and_failures(tmp_path, capsys):
    _fake_run(tmp_path / "a")
    assert cli.main(["status", "--outputs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a: feddifrc/fedavg digits  round 2/3  latest 30.00%  best 40.00%  failures 1" in out


def test_fetch_with_a_truncated_mnist5k_cache_rebuilds_it_without_a_traceback(tmp_path, capsys, caplog):
    from feddifrc_app.dataset import _mnist5k_arrays

    argv = ["fetch", "--app", str(ROOT), "--split", "test"]
    argv += ["--run-config", f"method='fedavg' dataset.data-dir='{tmp_path}'"]
    _mnist5k_arrays.cache_clear()
    assert cli.main(argv) == 0
    (path,) = (tmp_path / "feddifrc-decoded").glob("mnist-5k-*.npz")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])  # an interrupted copy onto an offline node
    _mnist5k_arrays.cache_clear()
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert "dataset mnist-5k/test: 1000 images, 10 classes" in out.out, out
    assert "Traceback" not in out.err and f"decoded cache {path} unreadable (BadZipFile" in caplog.text
    with np.load(path, allow_pickle=False) as z:  # rebuilt whole
        assert len(z["test"]) == 1000
    _mnist5k_arrays.cache_clear()


def test_status_names_a_failed_run_and_an_unreadable_file_without_a_traceback(tmp_path, capsys):
    import json

    _fake_run(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text('{"num-server-rounds": ')  # truncated
    r = json.loads((tmp_path / "a" / "results.json").read_text())
    r.update(status="failed", error="NoUpdateError: round 1: no node returned a usable update\nmore")
    (tmp_path / "a" / "results.json").write_text(json.dumps(r))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text("[1, 2]")  # valid JSON, not a run's
    assert cli.main(["status", "--outputs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"round 2/? ({tmp_path / 'a' / 'config.json'} unreadable: JSONDecodeError)" in out
    assert out.count("  failed: NoUpdateError: round 1: no node returned a usable update\n") == 1
    assert f"b: {tmp_path / 'b' / 'results.json'} has an unexpected layout (AttributeError" in out
