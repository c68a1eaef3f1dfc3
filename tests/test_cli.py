"""The `feddifrc` command: parser table, one-line errors, and `extract` end to end."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT
from fakes import fake_run

from feddifrc_app.tools import cli
from feddifrc_app.tools.run_config import load_app_config


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
    from feddifrc_app.data.registry import load_dataset
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
    from feddifrc_app.methods.feddifrc import teacher

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
    # Other noise, another key (the run seed's noise with -1; seed 7 and noise-seed 0 differ here).
    for noise in ("diffusion.noise-seed=-1", "diffusion.noise-seed=3"):
        assert cli.main([*argv[:-1], f"{argv[-1]} {noise}", "--check"]) == 0
        assert "0 of 10 images cached (0.0%), 10 to extract" in capsys.readouterr().out

    key_dir = shards[0].parent
    assert sum(len(np.load(p)["ids"]) for p in shards) == 10
    assert (key_dir / "key.json").is_file()


def test_report_prints_table_summary_and_random_teacher_label(tmp_path, capsys):
    fake_run(tmp_path / "r")
    assert cli.main(["report", str(tmp_path / "r"), "--plots"]) == 0
    out = capsys.readouterr().out
    assert "final 30.00%  best (max over rounds, the paper's endpoint) 40.00%  mean of last 5 35.00%" in out
    assert "RANDOM-weight teacher" in out and "2.2000" in out
    assert (
        "platforms: server torch 2.14.1 AVX512 x86_64; nodes torch 2.14.1 AVX2 x86_64 (partitions 0, 2), "
        "torch 2.14.1 AVX512 x86_64 (partition 1)\n" in out
    )
    assert (tmp_path / "r" / "accuracy.png").is_file()
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'} does not exist; give a run folder" in capsys.readouterr().err


def test_status_lists_runs_with_progress_and_failures(tmp_path, capsys):
    fake_run(tmp_path / "a")
    assert cli.main(["status", "--outputs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a: feddifrc/fedavg digits  round 2/3  latest 30.00%  best 40.00%  failures 1" in out


def test_fetch_with_a_truncated_mnist5k_cache_rebuilds_it_without_a_traceback(tmp_path, capsys, caplog):
    from feddifrc_app.data.sources.digits import _mnist5k_arrays

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

    fake_run(tmp_path / "a")
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


def test_a_sweep_refuses_a_lock_file_that_links_elsewhere_and_leaves_its_target_intact(tmp_path, capsys):
    """Issue 33 case 3 for ``sweep --out``: refused in one line before any run, the target untouched."""
    (tmp_path / "sw").mkdir()
    (tmp_path / "precious.txt").write_text("precious\n")
    (tmp_path / "sw" / ".lock").symlink_to(tmp_path / "precious.txt")
    assert cli.main(["sweep", "--app", str(ROOT), "--out", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"feddifrc sweep: error: --out {tmp_path / 'sw'}: cannot create or lock it (")
    assert f"{tmp_path / 'sw' / '.lock'} is a symbolic link, not a lock file" in err and err.count("\n") == 1
    assert (tmp_path / "precious.txt").read_text() == "precious\n"
    assert sorted(p.name for p in (tmp_path / "sw").iterdir()) == [".lock"]  # no run started


APP = ["--app", str(ROOT)]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["report", "{loop}"], "RUN_DIR = '{loop}'"),
        (["report", "{loop}/sub"], "RUN_DIR = '{loop}/sub'"),
        (["status", "--outputs-dir", "{loop}"], "--outputs-dir = '{loop}'"),
        (["table", "{loop}"], "SWEEP_DIR = '{loop}'"),
        (["sweep", *APP, "--out", "{loop}"], "--out = '{loop}'"),
        (["sweep", "--out", "{tmp}/sw", "--app", "{loop}"], "--app = '{loop}'"),
        (["make-tiny", "--cache-dir", "{loop}"], "--cache-dir = '{loop}'"),
        (["extract", *APP, "--check", "--cache-dir", "{loop}"], "--cache-dir = '{loop}'"),
        (["fetch", *APP, "--cache-dir", "{loop}"], "--cache-dir = '{loop}'"),
        (["pretrain-teacher", *APP, "--out", "{loop}"], "--out = '{loop}'"),
        (["pretrain-teacher", "--out", "{tmp}/t", "--app", "{loop}"], "--app = '{loop}'"),
        (
            ["fetch", *APP, "--run-config", "outputs-dir='{loop}'"],
            "config key 'outputs-dir' = '{loop}' is invalid:",
        ),
        (
            ["fetch", *APP, "--run-config", "diffusion.model='{loop}'"],
            "config key 'diffusion.model' = '{loop}' is invalid:",
        ),
    ],
)
def test_a_symlink_loop_in_a_path_argument_is_one_line_naming_it(tmp_path, capsys, argv, named):
    """Issue 33 case 9: ``ln -s loop loop`` given to any command was a RuntimeError traceback."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert cli.main([a.format(loop=loop, tmp=tmp_path) for a in argv]) == 2
    assert capsys.readouterr().err == (
        f"feddifrc {argv[0]}: error: {named.format(loop=loop)} "
        "cannot be resolved (a symlink loop); pass a path to a real folder or file\n"
    )


def test_status_lists_every_run_when_one_results_json_is_a_folder(tmp_path, capsys):
    """Issue 33 case 5: a results.json that is a folder raised IsADirectoryError before any run."""
    fake_run(tmp_path / "a")
    (tmp_path / "b" / "results.json").mkdir(parents=True)
    fake_run(tmp_path / "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "results.json").symlink_to(tmp_path / "d" / "results.json")  # a loop
    assert cli.main(["status", "--outputs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"b: {tmp_path / 'b' / 'results.json'} is unreadable (Is a directory); restore it" in out
    assert f"d: {tmp_path / 'd' / 'results.json'} is unreadable (Too many levels of symbolic links)" in out
    assert out.count("feddifrc/fedavg digits  round 2/3  latest 30.00%  best 40.00%  failures 1") == 2


def test_table_skips_and_names_a_run_whose_round_lacks_test_accuracy(tmp_path, capsys):
    """Issue 33 case 5: a round row without test-accuracy made `feddifrc table` raise KeyError and
    write no table; the run is now skipped, named with its round, and the others are tabled."""
    import json

    out, cells = tmp_path / "sw", {}
    for name, rows in {
        "good": [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.5}],
        "torn": [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-loss": 1.0}],
        "nulled": [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": None}],
    }.items():
        (out / "runs" / name).mkdir(parents=True)
        summary = {"final-accuracy": 0.5, "best-accuracy": 0.5, "mean-last-5-accuracy": 0.5}
        results = {"rounds": rows, "summary": summary, "status": "completed"}
        (out / "runs" / name / "results.json").write_text(json.dumps(results))
        config = {"dataset.name": "digits", "partition.name": "iid", "num-server-rounds": 1}
        (out / "runs" / name / "config.json").write_text(json.dumps(config))
        cells[name] = {"conf": "conf/digits-fedavg.toml", "grid": {}, "paper": None, "status": "completed"}
    (out / "sweep.json").write_text(json.dumps({"cells": cells}))
    assert cli.main(["table", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 50.00 ± 0.00 / 50.00 ± 0.00 / 50.00 ± 0.00 (n=1) |" in text  # "good" alone
    torn, nulled = (out / "runs" / n / "results.json" for n in ("torn", "nulled"))
    assert f"skipped torn: {torn} round 1 has no finite test-accuracy (None)" in text
    assert f"skipped nulled: {nulled} round 1 has no finite test-accuracy (None)" in text
    assert (out / "table.md").is_file() and (out / "curves.png").is_file()


def test_damaged_results_and_sweep_files_are_named_in_one_line_or_marked(tmp_path, capsys):
    """Issue 45 case 9: a string summary value was a TypeError traceback in `report`; a malformed
    sweep.json entry skipped a completed run as "status None"; a NaN summary printed as "nan"."""
    import json

    out, cells = tmp_path / "sw", {}
    rows = [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.5}]
    finals = {"good": 0.5, "nan": float("nan"), "text": "0.5", "listed": 0.5, "nostatus": 0.5}
    for name, final in finals.items():
        (out / "runs" / name).mkdir(parents=True)
        summary = {"final-accuracy": final, "best-accuracy": 0.5, "mean-last-5-accuracy": 0.5}
        (out / "runs" / name / "results.json").write_text(
            json.dumps({"rounds": rows, "summary": summary, "status": "completed"})
        )
        config = {"dataset.name": "digits", "partition.name": "iid", "num-server-rounds": 1}
        (out / "runs" / name / "config.json").write_text(json.dumps(config))
        conf = f"conf/digits-{'nan' if name == 'nan' else 'fedavg'}.toml"
        cells[name] = {"conf": conf, "grid": {}, "paper": None, "status": "completed"}
    cells["listed"]["grid"] = ["partition.alpha", 0.5]
    del cells["nostatus"]["status"]
    (out / "sweep.json").write_text(json.dumps({"cells": cells}))

    text_results = out / "runs" / "text" / "results.json"
    assert cli.main(["report", str(text_results.parent)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"feddifrc report: error: {text_results} has an unexpected layout (TypeError: results.json "
        "summary key 'final-accuracy' is a str ('0.5'), expected a number or null)\n"
    )
    assert cli.main(["table", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| fedavg | 50.00 ± 0.00 / 50.00 ± 0.00 / 50.00 ± 0.00 (n=1) |" in table  # "good" alone
    assert "| nan | NOT FINITE (nan) / 50.00 ± 0.00 / 50.00 ± 0.00 (n=1) |" in table
    assert (
        "skipped listed: sweep.json's entry is malformed ('grid' is a list (['partition.alpha', 0.5]))"
        in table
    )
    assert "skipped nostatus: sweep.json's entry is malformed (no 'status'): rerun the same" in table
    assert f"skipped text: {text_results} has an unexpected layout (results.json summary key" in table


def test_report_says_how_the_run_ended_and_marks_non_finite_values(tmp_path, capsys):
    """Issue 33 case 8: a failed or dead run printed its table like a finished one, NaN as 'nan%'."""
    import json

    fake_run(tmp_path / "r")
    path = tmp_path / "r" / "results.json"
    r = json.loads(path.read_text())
    assert cli.main(["report", str(tmp_path / "r")]) == 0
    assert "\nstatus: unknown (results.json has none)\n" in capsys.readouterr().out
    path.write_text(json.dumps({**r, "status": "completed"}))
    assert cli.main(["report", str(tmp_path / "r")]) == 0
    assert "\nstatus: completed\n" in capsys.readouterr().out
    r.update(status="failed", error="NoUpdateError: round 2: no node returned a usable update\nTraceback ...")
    r["rounds"][2]["test-loss"] = float("inf")
    r["summary"]["best-accuracy"] = float("nan")
    path.write_text(json.dumps(r))  # NaN / Infinity: not strict JSON, as a hand edit leaves it
    assert cli.main(["report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "\nstatus: failed: NoUpdateError: round 2: no node returned a usable update\n" in out
    assert "Traceback" not in out
    assert "\nNOT FINITE (nan/inf below are not measurements): summary best-accuracy = nan; " in out
    assert "round 2 test-loss = inf\n" in out
    r.update(status="running", process={"pid": 999999999, "host": "elsewhere"})
    del r["error"]
    path.write_text(json.dumps(r))
    assert cli.main(["report", str(tmp_path / "r")]) == 0
    assert (
        "\nstatus: DEAD: results.json says running but no process holds the folder (last pid 999999999 "
        f"on elsewhere); resume with resume-from='{tmp_path / 'r'}'\n"
    ) in capsys.readouterr().out


def test_ctrl_c_says_what_each_command_keeps(monkeypatch, capsys) -> None:
    def interrupt(args):
        raise KeyboardInterrupt

    for command, kept in [
        ("extract", "the features extracted so far are cached; rerun to resume"),
        ("pretrain-teacher", "no partial teacher is kept; a rerun starts over"),
        ("report", "nothing half-written is left"),
    ]:
        spec = cli.COMMANDS[command]
        monkeypatch.setitem(cli.COMMANDS, command, (spec[0], spec[1], interrupt))
        args = {"extract": [], "pretrain-teacher": ["--out", "/tmp/t"], "report": ["/tmp"]}[command]
        assert cli.main([command, *args]) == 130
        assert capsys.readouterr().err.strip().endswith(f"interrupted ({kept})")


def test_fetch_and_extract_refuse_a_teacher_they_could_not_use_in_one_line(tmp_path, capsys) -> None:
    """Issue 33 case 6: fetch reported a folder without unet/ as present (exit 0), and extract
    --check raised FamilyError's traceback for a layer the model lacks."""
    import shutil

    from feddifrc_app.diffusion.pipeline import teacher_identity

    cut = tmp_path / "cut"
    shutil.copytree(teacher_identity("tiny-mnist", tmp_path).folder, cut)
    shutil.rmtree(cut / "unet")
    (cut / "feddifrc.json").unlink()  # a plain diffusers folder (no marker of files to verify)
    argv = ["--app", str(ROOT), "--cache-dir", str(tmp_path), "--run-config", f"diffusion.model='{cut}'"]
    assert cli.main(["fetch", *argv, "--split", "test"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"feddifrc fetch: error: teacher folder {cut} is incomplete: unet/")
        and err.count("\n") == 1
    )
    layers = "diffusion.model='tiny-sdxl' diffusion.blocks='3' diffusion.channels='128'"
    assert (
        cli.main(
            ["extract", "--check", "--app", str(ROOT), "--cache-dir", str(tmp_path), "--run-config", layers]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("feddifrc extract: error: ") and "diffusion.blocks" in err and err.count("\n") == 1


def test_an_unknown_key_says_which_known_key_was_meant(capsys):
    argv = ["extract", "--app", str(ROOT), "--run-config"]
    assert cli.main([*argv, "diffusion.timesteps=300 trian.lr=0.1 lr=0.1 tau=1 zzz=1"]) == 2
    assert capsys.readouterr().err == (
        "feddifrc extract: error: unknown config key(s) 'diffusion.timesteps' (did you mean "
        "'diffusion.timestep'?), 'lr' (did you mean 'train.lr'?), 'tau' (did you mean 'strategy.tau' "
        "or 'moon.tau'?), 'trian.lr' (did you mean 'train.lr'?), 'zzz'; valid keys are listed in "
        "[tool.flwr.app.config] of pyproject.toml\n"
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--set", "num-server-rounds=3 train.lrr=0.1"], "'train.lrr' (did you mean 'train.lr'?)"),
        (["--grid", "partition.alpha=0.5,-1"], "config key 'partition.alpha' = -1.0 is invalid"),
        (["--set", "seed=3"], "--set: key 'seed' is set by the sweep"),
        (["--set", "min-nodes=3", "--federation-config", "num-supernodes=2"], "min-nodes = 3 but"),
        (["--seeds", "0"], "--seeds 0: expected >= 1"),
    ],
)
def test_a_refused_command_writes_nothing(tmp_path, capsys, argv, said):
    """Validation comes before any folder: a refused sweep leaves no --out (nor its .lock), a
    refused pretrain-teacher or extract no --out or cache folder."""
    out = tmp_path / "a" / "sweep"
    assert cli.main(["sweep", "--app", str(ROOT), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("feddifrc sweep: error: ") and said in err and err.count("\n") == 1
    bad = ["--run-config", "diffusion.timesteps=3"]
    assert cli.main(["pretrain-teacher", "--app", str(ROOT), "--out", str(tmp_path / "a" / "t"), *bad]) == 2
    assert cli.main(["extract", "--app", str(ROOT), "--cache-dir", str(tmp_path / "a" / "c"), *bad]) == 2
    assert cli.main(["fetch", "--app", str(ROOT), "--cache-dir", str(tmp_path / "a" / "c"), *bad]) == 2
    assert list(tmp_path.iterdir()) == []


def test_a_completed_run_with_warnings_is_marked_by_report_status_and_the_table(tmp_path, capsys):
    """Issue 45 case 1: a run that learned nothing ended plainly "completed"; its recorded warnings
    (results.json's "warnings": the DP noise at setup, the no-learning verdict) are now shown."""
    import json

    dp = "strategy.dp = 'server-adaptive': DP noise ... expect no learning"
    verdict = "no learning: test accuracy 10.00%, 10.00%, 10.00% in rounds 1-3, at most chance"
    out, cells = tmp_path / "sw", {}
    rows = [{"round": r, "test-accuracy": 0.1, "test-loss": 2.3 + r} for r in range(4)]
    summary = {"final-accuracy": 0.1, "best-accuracy": 0.1, "mean-last-5-accuracy": 0.1}
    for name, warnings in {"warned-s0": [dp, verdict], "plain-s0": None}.items():
        (out / "runs" / name).mkdir(parents=True)
        results = {"rounds": rows, "summary": summary, "status": "completed"}
        (out / "runs" / name / "results.json").write_text(json.dumps(results | {"warnings": warnings or []}))
        if warnings is None:  # a run without warnings has no key
            (out / "runs" / name / "results.json").write_text(json.dumps(results))
        config = {"dataset.name": "digits", "partition.name": "iid", "num-server-rounds": 3}
        (out / "runs" / name / "config.json").write_text(json.dumps(config))
        conf = f"conf/digits-{name.split('-')[0]}.toml"
        cells[name] = {"conf": conf, "grid": {}, "paper": None, "status": "completed"}
    (out / "sweep.json").write_text(json.dumps({"cells": cells}))

    assert cli.main(["report", str(out / "runs" / "warned-s0")]) == 0
    text = capsys.readouterr().out
    assert f"status: completed, WARNED: {verdict} (+1 more: feddifrc report)\n" in text
    assert f"WARNING: {dp}\nWARNING: {verdict}\n" in text
    assert cli.main(["status", "--outputs-dir", str(out / "runs")]) == 0
    text = capsys.readouterr().out
    line = "None/None None  round 3/3  latest 10.00%  best 10.00%  failures 0"
    assert f"warned-s0: {line}  completed, WARNED: {verdict}" in text
    assert f"plain-s0: {line}\n" in text
    assert cli.main(["table", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| warned | 10.00 ± 0.00 / 10.00 ± 0.00 / 10.00 ± 0.00 (n=1) WARNED 1 of 1 |" in text
    assert "| plain | 10.00 ± 0.00 / 10.00 ± 0.00 / 10.00 ± 0.00 (n=1) |" in text
    assert f"warned warned-s0: {dp}\nwarned warned-s0: {verdict}\n" in text
    assert "warned plain-s0" not in text and (out / "table.md").read_text() in text
