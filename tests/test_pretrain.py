"""pretrain_teacher: a real (tiny, few-step) training run written as a loadable, verified SD folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from feddifrc_app.diffusion.featurizer import Featurizer
from feddifrc_app.diffusion.pipeline import TeacherLoadError, load_teacher, teacher_identity
from feddifrc_app.diffusion.pretrain import PretrainRecipe, pretrain_teacher

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

    from feddifrc_app.diffusion import pretrain

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
    from feddifrc_app.targets import _featurizer

    assert teacher_resolution(str(few_steps), tmp_path) == 32
    assert teacher_resolution("tiny", tmp_path) == 16
    with caplog.at_level("WARNING", logger="flwr.feddifrc"):
        _featurizer(str(few_steps), str(tmp_path), "cpu", "float32", 16, 100, (1, 2, 3), 1, 0)
    assert "trained at 32 px but diffusion.resolution = 16" in caplog.text
