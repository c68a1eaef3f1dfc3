"""pretrain_teacher: a real (tiny, few-step) training run written as a loadable, verified SD folder."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from feddifrc_app.diffusion.featurizer import Featurizer
from feddifrc_app.diffusion.pipeline import TeacherLoadError, load_teacher, teacher_identity
from feddifrc_app.tools.pretrain import PretrainRecipe, pretrain_teacher

PROMPTS = ("a photo of a digit zero", "a photo of a digit one", "a photo of a digit two")


def _data(n: int = 24) -> tuple[torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(0)
    labels = np.arange(n) % 3
    images = torch.randint(0, 256, (n, 3, 16, 16), generator=g, dtype=torch.uint8)
    return images, labels


@pytest.fixture(scope="module")
def few_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    images, labels = _data()
    out = tmp_path_factory.mktemp("pretrain") / "teacher"
    return pretrain_teacher(
        images,
        labels,
        PROMPTS,
        out,
        PretrainRecipe(batch_size=8, vae_steps=2, unet_steps=3, unet_warmup=1),
        name="t",
        progress=False,
    )


def test_writes_a_standard_sd_folder_that_the_app_loads(few_steps: Path, tmp_path: Path) -> None:
    marker = json.loads((few_steps / "feddifrc.json").read_text())
    assert marker["kind"] == "feddifrc-pretrained-tiny-sd" and marker["random_weights"] is False
    assert marker["prompts"] == [*PROMPTS, ""] and marker["data"]["per_class"] == [8, 8, 8]
    assert (
        marker["recipe"]["unet_steps"] == 3 and "unet/diffusion_pytorch_model.safetensors" in marker["files"]
    )
    assert not [p for p in few_steps.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    ident = teacher_identity(str(few_steps), tmp_path)
    assert (ident.model_id, ident.random_weights) == (str(few_steps), False)
    t = load_teacher(str(few_steps), tmp_path, torch.device("cpu"), torch.float32)
    assert t.vae_scale_factor == 4 and t.block_channels == (64, 64, 64, 32)
    # The scaling factor makes the posterior-mean latents unit-variance (SD's convention).
    f = Featurizer(t, resolution=32, timestep=300, blocks=(1, 2, 3), ensemble=1, seed=0)
    images, _ = _data()
    assert float(f.encode(images).std()) == pytest.approx(1.0, rel=0.05)
    out = f(images[:4], torch.arange(4), PROMPTS)
    assert {b: tuple(v.shape) for b, v in out.items()} == {1: (4, 3, 64), 2: (4, 3, 64), 3: (4, 3, 32)}


def test_scheduler_is_v_prediction_ddim(few_steps: Path) -> None:
    cfg = json.loads((few_steps / "scheduler" / "scheduler_config.json").read_text())
    assert cfg["_class_name"] == "DDIMScheduler" and cfg["prediction_type"] == "v_prediction"
    assert (cfg["beta_schedule"], cfg["beta_start"], cfg["beta_end"]) == ("scaled_linear", 0.00085, 0.012)


def test_same_seed_same_teacher(few_steps: Path, tmp_path: Path) -> None:
    images, labels = _data()
    again = pretrain_teacher(
        images,
        labels,
        PROMPTS,
        tmp_path / "again",
        PretrainRecipe(batch_size=8, vae_steps=2, unet_steps=3, unet_warmup=1),
        name="t",
        progress=False,
    )
    a, b = (json.loads((p / "feddifrc.json").read_text())["files"] for p in (few_steps, again))
    assert a == b


def test_zero_steps_is_the_random_control(tmp_path: Path) -> None:
    images, labels = _data()
    ctrl = pretrain_teacher(
        images, labels, PROMPTS, tmp_path / "ctrl", PretrainRecipe(vae_steps=0, unet_steps=0), progress=False
    )
    assert teacher_identity(str(ctrl), tmp_path).random_weights is True
    assert "UNTRAINED" in (ctrl / "README.md").read_text()


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_corrupt_or_missing_weight_file_is_refused_with_one_line(
    few_steps: Path, tmp_path: Path, damage: str
) -> None:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(few_steps, folder)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    if damage == "flip":
        raw = bytearray(weights.read_bytes())
        raw[-10] ^= 0xFF
        weights.write_bytes(bytes(raw))
    else:
        weights.unlink()
    with pytest.raises(TeacherLoadError) as e:
        teacher_identity(str(folder), tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and str(weights) in msg
    assert ("corrupt" if damage == "flip" else "missing") in msg
    assert f"feddifrc pretrain-teacher --out {folder}" in msg


def test_bad_inputs_are_rejected_before_training(tmp_path: Path) -> None:
    images, labels = _data()
    with pytest.raises(ValueError, match="labels must lie in 0..1"):
        pretrain_teacher(images, labels, PROMPTS[:2], tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match="uint8"):
        pretrain_teacher(images.float(), labels, PROMPTS, tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match="multiple of 4"):
        PretrainRecipe(resolution=30)


def test_a_failed_save_keeps_the_previous_teacher_and_leaves_no_partial_folder(
    few_steps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from feddifrc_app.tools import pretrain

    out = tmp_path / "teacher"
    shutil.copytree(few_steps, out)
    before = json.loads((out / "feddifrc.json").read_text())["files"]

    def broken_save(pipe, folder: Path) -> None:
        (folder / "unet").mkdir(parents=True)
        (folder / "unet" / "half-written").write_bytes(b"x")
        raise OSError("disk full")

    monkeypatch.setattr(pretrain, "save_tiny_pipeline", broken_save)
    images, labels = _data()
    with pytest.raises(OSError, match="disk full"):
        pretrain_teacher(
            images,
            labels,
            PROMPTS,
            out,
            PretrainRecipe(batch_size=8, vae_steps=1, unet_steps=0),
            progress=False,
        )
    assert json.loads((out / "feddifrc.json").read_text())["files"] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"]


def test_an_unreadable_marker_or_unlisted_weights_are_refused(few_steps: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(few_steps, folder)
    marker = json.loads((folder / "feddifrc.json").read_text())
    del marker["files"]["unet/diffusion_pytorch_model.safetensors"]
    (folder / "feddifrc.json").write_text(json.dumps(marker))
    with pytest.raises(TeacherLoadError, match="unet/diffusion_pytorch_model.safetensors is not covered"):
        teacher_identity(str(folder), tmp_path / "cache")
    (folder / "feddifrc.json").write_text('{"kind": "feddifrc-pretr')  # truncated
    with pytest.raises(TeacherLoadError, match="feddifrc.json is unreadable"):
        teacher_identity(str(folder), tmp_path / "cache")


def test_the_training_resolution_is_recorded_and_checked_against_the_config(
    few_steps: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from feddifrc_app.diffusion.pipeline import teacher_resolution
    from feddifrc_app.methods.feddifrc.teacher import TeacherSpec, featurizer

    assert teacher_resolution(str(few_steps), tmp_path) == 32
    assert teacher_resolution("tiny", tmp_path) == 16
    spec = TeacherSpec(
        model=str(few_steps),
        cache_dir=tmp_path,
        identity=teacher_identity(str(few_steps), tmp_path),
        device=torch.device("cpu"),
        dtype=torch.float32,
        resolution=16,
        timestep=100,
        blocks=(1, 2, 3),
        ensemble=1,
        seed=0,
        batch_size=16,
    )
    with caplog.at_level("WARNING", logger="flwr.feddifrc"):
        featurizer(spec)
    assert "trained at 32 px but diffusion.resolution = 16" in caplog.text


# --------------------------------------------------------------------------- the output folder


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_out_folder_is_missing_empty_or_its_own_unless_force(
    few_steps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from feddifrc_app.tools.pretrain import OutFolderError, check_out_folder

    check_out_folder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    check_out_folder(tmp_path / "empty")
    own = tmp_path / "own"
    shutil.copytree(few_steps, own)
    check_out_folder(own)  # written by pretrain-teacher: every file is in its feddifrc.json
    (own / "notes.txt").write_text("mine")
    with pytest.raises(OutFolderError, match=r"did not write \(notes.txt\)"):
        check_out_folder(own)
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("years of work")
    with pytest.raises(OutFolderError) as e:
        check_out_folder(thesis)
    msg = str(e.value)
    assert "\n" not in msg and str(thesis) in msg and "thesis.tex" in msg and "--force" in msg
    check_out_folder(thesis, force=True)
    # A file, the working directory, an ancestor of it or of the app: refused even with force.
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutFolderError, match="is a file, not a folder"):
        check_out_folder(tmp_path / "file", force=True)
    with pytest.raises(OutFolderError, match="is the current working directory"):
        check_out_folder(Path.cwd(), force=True)
    with pytest.raises(OutFolderError, match="holds the current working directory"):
        check_out_folder(Path.cwd().parent, force=True)
    app = tmp_path / "work" / "app"
    app.mkdir(parents=True)
    with pytest.raises(OutFolderError, match=f"holds the app folder \\({app}\\)"):
        check_out_folder(tmp_path / "work", force=True, protected=[app])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutFolderError, match="holds the feddifrc_app package"):
        check_out_folder(Path(__file__).resolve().parents[1], force=True)


def test_pretrain_into_a_foreign_folder_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from feddifrc_app.tools import pretrain

    def no_training(*a, **k):
        raise AssertionError("trained although the folder is refused")

    monkeypatch.setattr(pretrain, "train_teacher", no_training)
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    images, labels = _data()
    with pytest.raises(pretrain.OutFolderError, match="thesis.tex"):
        pretrain_teacher(images, labels, PROMPTS, out, progress=False)
    assert (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis"]


def test_folder_edited_during_training_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from feddifrc_app.tools import pretrain

    out = tmp_path / "t"
    out.mkdir()  # empty when the run starts
    real = pretrain.train_teacher

    def train_then_someone_writes(*a, **k):
        result = real(*a, **k)
        (out / "draft.md").write_text("written meanwhile")
        return result

    monkeypatch.setattr(pretrain, "train_teacher", train_then_someone_writes)
    images, labels = _data()
    with pytest.raises(pretrain.OutFolderError, match="draft.md"):
        pretrain_teacher(
            images, labels, PROMPTS, out, PretrainRecipe(vae_steps=0, unet_steps=0), progress=False
        )
    assert [p.name for p in out.iterdir()] == ["draft.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # its temp folder removed


def test_leftovers_of_a_killed_pretraining_are_removed_and_only_those(tmp_path: Path) -> None:
    from feddifrc_app.tools.pretrain import remove_stale_temp

    dead, live = _dead_pid(), os.getpid()
    out = tmp_path / "teacher"
    names = {
        "dead_tmp": f".teacher.pretrain-tmp-{dead}-0123abcd",
        "dead_old": f".teacher.pretrain-old-{dead}-0123abce",
        "live_tmp": f".teacher.pretrain-tmp-{live}-0123abcf",  # a pretraining still running
        "other_writer": f".teacher.tmp-{dead}-0123abd0",  # not pretrain's
        "other_folder": f".other.pretrain-tmp-{dead}-0123abd1",
    }
    for n in names.values():
        (tmp_path / n).mkdir()
        (tmp_path / n / "x").write_text(n)
    remove_stale_temp(out)  # out missing: the moved-aside previous teacher is put back
    assert (out / "x").read_text() == names["dead_old"]
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"teacher", names["live_tmp"], names["other_writer"], names["other_folder"]}
    (tmp_path / names["dead_old"]).mkdir()
    remove_stale_temp(out)  # out present: the old copy is the replaced teacher, removed
    assert not (tmp_path / names["dead_old"]).exists() and (out / "x").is_file()


def test_cli_pretrain_refuses_in_one_line_and_rewrites_its_own_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from conftest import ROOT

    from feddifrc_app.tools import cli

    base = ["pretrain-teacher", "--app", str(ROOT), "--vae-steps", "0", "--unet-steps", "0", "--no-progress"]
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "thesis.tex").write_text("x")
    (tmp_path / "f").write_text("x")
    for out, why in [
        (tmp_path / "thesis", "did not write (thesis.tex)"),
        (tmp_path / "f", "is a file"),
        (tmp_path / "f" / "t", "is under"),
        (ROOT, "is the current working directory" if Path.cwd() == ROOT else "is the app folder"),
        (ROOT.parent, "holds"),
    ]:
        force = [] if out == tmp_path / "thesis" else ["--force"]  # no --force for the foreign folder
        assert cli.main([*base, "--out", str(out), *force]) == 2
        err = capsys.readouterr().err
        assert err.startswith("feddifrc pretrain-teacher: error: output folder") and why in err, err
        assert err.count("\n") == 1
    assert (tmp_path / "thesis" / "thesis.tex").read_text() == "x" and (tmp_path / "f").read_text() == "x"
    ctrl = tmp_path / "ctrl"
    for _ in range(2):  # the second run replaces the folder the first one made
        assert cli.main([*base, "--out", str(ctrl)]) == 0
        assert capsys.readouterr().out.strip() == str(ctrl)
    assert json.loads((ctrl / "feddifrc.json").read_text())["random_weights"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctrl", "f", "thesis"]


def test_pixart_family_trains_a_dit_teacher_the_app_loads(tmp_path: Path) -> None:
    """--family pixart: the same recipe and data, a PixArt DiT + tiny T5, a verified PixArtAlphaPipeline."""
    images, labels = _data()
    recipe = PretrainRecipe(family="pixart", batch_size=8, vae_steps=2, unet_steps=3, unet_warmup=1)
    out = pretrain_teacher(images, labels, PROMPTS, tmp_path / "dit", recipe, name="d", progress=False)
    marker = json.loads((out / "feddifrc.json").read_text())
    assert marker["recipe"]["family"] == "pixart" and "transformer/config.json" in marker["files"]
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "PixArtAlphaPipeline"
    t = load_teacher(str(out), tmp_path / "cache", torch.device("cpu"), torch.float32)
    assert t.family == "pixart" and t.block_channels == (128,) * 8 and t.vae_scale_factor == 4
    f = Featurizer(t, resolution=32, timestep=300, blocks=(3, 5, 7), ensemble=1, seed=0)
    feats = f(images[:2], torch.arange(2), PROMPTS)
    assert {b: tuple(v.shape) for b, v in feats.items()} == {3: (2, 3, 128), 5: (2, 3, 128), 7: (2, 3, 128)}
    with pytest.raises(ValueError, match="family"):
        PretrainRecipe(family="sd3")


def test_a_teacher_that_never_left_its_warm_up_is_labelled_random_weights() -> None:
    from feddifrc_app.tools.pretrain import untrained

    assert untrained(PretrainRecipe(unet_steps=0)) and untrained(PretrainRecipe(unet_steps=1))  # warm-up 100
    assert untrained(PretrainRecipe(unet_steps=100)) and not untrained(PretrainRecipe(unet_steps=101))
    assert not untrained(PretrainRecipe())  # the packaged recipe: 1,200 steps


def test_pretrain_data_is_exactly_the_chosen_pool_images(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--exclude-val / --limit: the teacher trains on exactly the chosen pool images (recorded by
    fingerprint), never a client, validation or test image; bad choices fail in one line."""
    from conftest import ROOT, make_config

    from feddifrc_app.data.holdouts import stratified_subset
    from feddifrc_app.data.images import PUBLIC_SPLIT, fingerprint_of
    from feddifrc_app.data.registry import load_dataset
    from feddifrc_app.data.sources.digits import mnist5k_positions
    from feddifrc_app.tools import cli
    from feddifrc_app.tools.cmd_pretrain import pretrain_data

    cfg = dataclasses.replace(make_config(plumbing=False).dataset, name="mnist-5k-pool")
    labels, ids = mnist5k_positions(cfg.name, Path(cfg.data_dir))
    pool = load_dataset(cfg, PUBLIC_SPLIT)
    everything, _ = pretrain_data(cfg)
    assert torch.equal(everything.images, pool.images) and np.array_equal(everything.labels, pool.labels)
    small, note = pretrain_data(cfg, limit=500, exclude_val=True)
    rest = np.setdiff1d(ids[PUBLIC_SPLIT], ids["val"])  # ids: positions in the 5,000 digits
    want = np.searchsorted(ids[PUBLIC_SPLIT], rest[stratified_subset(labels[rest], 500, 0)])
    assert torch.equal(small.images, pool.images[want]) and np.array_equal(small.labels, pool.labels[want])
    chosen = set(ids[PUBLIC_SPLIT][want])
    assert not chosen & (set(ids["val"]) | set(ids["train"]) | set(ids["test"]))
    assert np.bincount(small.labels).tolist() == [50] * 10
    fp = fingerprint_of(pool.name, "pretrain", pool.class_names, small.labels, small.images)
    assert small.fingerprint == fp and "500 of mnist-5k-pool" in note and fp in note
    base = ["pretrain-teacher", "--app", str(ROOT), "--vae-steps", "0", "--unet-steps", "0", "--no-progress"]
    pool_rc = ["--run-config", "dataset.name='mnist-5k-pool'"]
    out = tmp_path / "t"
    assert cli.main([*base, "--out", str(out), "--exclude-val", "--limit", "500", *pool_rc]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    data = json.loads((out / "feddifrc.json").read_text())["data"]
    assert data["images"] == 500 and fp in data["note"]
    for extra, why in [
        (["--limit", "4000", *pool_rc], "--limit 4000: only 3500 images"),
        (["--limit", "-1", *pool_rc], "--limit -1"),
        (["--exclude-val", "--run-config", "dataset.name='mnist-5k'"], "--exclude-val"),
        (["--run-config", "dataset.name='digits'"], "has no public split"),
    ]:
        assert cli.main([*base, "--out", str(tmp_path / "u"), *extra]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
    assert not (tmp_path / "u").exists()
