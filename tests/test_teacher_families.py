"""Teacher families (SDXL, PixArt, SD3 beside SD): tiny random models of each, built offline,
through the same featurizer, identity and feature cache as the SD teacher (issue 24)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_config

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.diffusion import family as families
from feddifrc_app.diffusion import pixart, sd, sd3, sdxl
from feddifrc_app.diffusion.family import FamilyError, encode_image, read_family, vae_dtype
from feddifrc_app.diffusion.featurizer import Featurizer, to_unit_range
from feddifrc_app.diffusion.pipeline import (
    TeacherLoadError,
    load_teacher,
    release_teacher,
    teacher_identity,
    weights_hash,
)
from feddifrc_app.diffusion.tiny import build_tiny_pipeline
from feddifrc_app.diffusion.tiny_zoo import build_tiny_zoo
from feddifrc_app.methods.feddifrc.teacher import feature_set, pooled_features, teacher_prompts, teacher_spec

CPU = torch.device("cpu")
PROMPTS = ("a photo of a zero", "a photo of a one", "")
LAYERS = {"sdxl": (0, 1, 2), "pixart": (1, 2, 3), "sd3": (1, 2, 3)}  # each family's default here
WIDTHS = {"sdxl": (128, 64, 32), "pixart": (64, 64, 64, 64), "sd3": (64, 64, 64, 64)}
PIPELINES = {
    "sdxl": "StableDiffusionXLPipeline",
    "pixart": "PixArtAlphaPipeline",
    "sd3": "StableDiffusion3Pipeline",
}
FAMILY_CONFIG = {"model.width": 16, "diffusion.channels": "64,32,32", "diffusion.device": "cpu"}


@pytest.fixture(scope="module", params=sorted(LAYERS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (3, 3, 12, 12), generator=g, dtype=torch.uint8)


def _load(family: str, cache: Path):
    return load_teacher(f"tiny-{family}", cache, CPU, torch.float32)


def _make(teacher, **kw) -> Featurizer:
    args = dict(resolution=16, timestep=300, blocks=LAYERS[teacher.family], ensemble=1, seed=0)
    return Featurizer(teacher, **{**args, **kw})


def test_default_sd_feature_keys_are_unchanged(teacher_cache: Path) -> None:
    """The SD path's keys are the ones measured on the commit before the families (8e1e06f):
    every feature cache filled before this change still serves, with the noise those runs drew
    (``diffusion.noise-seed = -1``: the run seed); the default fixed noise is another key."""
    expected = {
        False: "97f0750da359ab4dcf994a51c18811d77a56f1daf060850ae5b3e1f473156f8a",  # tiny-mnist, mnist-5k
        True: "c1d80559a9bea461927183e00980af76191a89788898fa79059f4441f9d25d07",  # tiny, digits
    }
    for plumbing, key in expected.items():
        cfg = make_config(plumbing, **{"diffusion.device": "cpu", "diffusion.noise-seed": -1})
        data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
        prompts = teacher_prompts(cfg, data.class_names)
        fs = feature_set(teacher_spec(cfg, teacher_cache), data, prompts)
        assert fs.key == key and "family" not in fs.fields and fs.fields["seed"] == cfg.seed
        fixed = make_config(plumbing, **{"diffusion.device": "cpu"})  # diffusion.noise-seed = 0
        key = feature_set(teacher_spec(fixed, teacher_cache), data, prompts)
        assert key.fields["seed"] == 0 and key.key != fs.key
        # Another run seed, the same images: the same key, so a second seed extracts 0 images.
        other = make_config(plumbing, **{"diffusion.device": "cpu", "seed": cfg.seed + 1})
        assert feature_set(teacher_spec(other, teacher_cache), data, prompts).key == key.key
        assert fs.spec.identity.family == "sd"


def test_default_layers_per_family() -> None:
    assert sd.default_layers(4) == (1, 2, 3)  # SD 1.x/2.x: the paper's decoder blocks 2, 3, 4
    assert sdxl.default_layers(3) == (0, 1, 2)
    assert pixart.default_layers(28) == (13, 20, 27)  # PixArt-XL-2
    assert sd3.default_layers(24) == (11, 17, 23)  # SD3 / SD3.5 medium
    assert sd3.default_layers(38) == (18, 27, 37)  # SD3.5 large
    assert pixart.default_layers(4) == (1, 2, 3)  # the tiny DiTs


def test_tiny_family_folder_is_its_own_pipeline_and_deterministic(family: str, tmp_path: Path) -> None:
    a = build_tiny_zoo(family, tmp_path / "a", seed=0)
    b = build_tiny_zoo(family, tmp_path / "b", seed=0)
    c = build_tiny_zoo(family, tmp_path / "c", seed=1)
    assert json.loads((a / "model_index.json").read_text())["_class_name"] == PIPELINES[family]
    assert read_family(a) == family
    assert weights_hash(a) == weights_hash(b) != weights_hash(c)  # seeded, byte-identical on rebuild
    marker = json.loads((a / "feddifrc.json").read_text())
    assert marker["random_weights"] is True and marker["seed"] == 0
    assert build_tiny_zoo(family, a, seed=0) == a  # a complete folder is kept, not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_tiny_family_loads_frozen_with_declared_widths(family: str, teacher_cache: Path) -> None:
    t = _load(family, teacher_cache)
    assert t.family == family and t.random_weights and t.model_id == f"tiny-{family}-seed0"
    assert t.block_channels == WIDTHS[family]
    assert teacher_identity(f"tiny-{family}", teacher_cache).family == family
    assert t.vae.decoder is None and all(not p.requires_grad for p in t.unet.parameters())
    assert t.num_timesteps == 1000


def test_features_are_deterministic_and_match_the_declared_widths(
    family: str, teacher_cache: Path, images: torch.Tensor
) -> None:
    t = _load(family, teacher_cache)
    f = _make(t)
    ids = torch.tensor([4, 5, 6])
    out = f(images, ids, PROMPTS)
    assert sorted(out) == list(LAYERS[family])
    for b, v in out.items():
        assert v.shape == (3, len(PROMPTS), t.block_channels[b]) and v.dtype == torch.float32
        assert torch.isfinite(v).all()
    again = _make(t)(images, ids, PROMPTS)  # a fresh featurizer: the same numbers
    one = f(images[1:2], ids[1:2], PROMPTS)  # a feature never depends on its batch
    for b in out:
        torch.testing.assert_close(again[b], out[b], atol=0, rtol=0)
        torch.testing.assert_close(one[b][0], out[b][1], atol=2e-5, rtol=1e-4)
        assert not torch.allclose(out[b][:, 0], out[b][:, 1])  # the prompt reaches the layer
    off = f(images, ids, PROMPTS, token_offsets=torch.ones(3, t.text_width))
    assert any(not torch.allclose(off[b], out[b]) for b in out)  # model-conditioned tokens


def test_shortcuts_agree_with_the_stock_modules(
    family: str, teacher_cache: Path, images: torch.Tensor
) -> None:
    """SDXL's UNet takes the shared-prompt cross-attention and oneDNN shortcuts; the DiTs none."""
    t = _load(family, teacher_cache)
    ids = torch.arange(3)
    f = _make(t)
    assert f.shortcuts["shared-prompt-cross-attention"] is (family == "sdxl")
    fast, stock = f(images, ids, PROMPTS), _make(t, fast=False)(images, ids, PROMPTS)
    for b in fast:
        torch.testing.assert_close(fast[b], stock[b], atol=2e-4, rtol=1e-3)


def test_sd3_noise_is_the_flow_matching_schedulers(teacher_cache: Path) -> None:
    """x_t = (1 - sigma) x0 + sigma eps with the model timestep sigma * T, as the scheduler's scale_noise."""
    t = _load("sd3", teacher_cache)
    sched = t.parts["pipe"].scheduler
    for step in (0, 300, 999):
        a, b, model_t = sd3.noise_coeffs(t, step)
        assert a == pytest.approx(1.0 - b)
        x0, eps = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
        ref = sched.scale_noise(x0, model_t.reshape(1), eps)
        torch.testing.assert_close((a * x0 + b * eps).float(), ref, atol=1e-5, rtol=1e-5)
    assert sd3.noise_coeffs(t, 999)[1] == pytest.approx(1.0)  # the last step is pure noise
    assert sd3.noise_coeffs(t, 0)[1] < sd3.noise_coeffs(t, 300)[1] < 1.0


def test_a_layer_the_model_does_not_have_is_a_clear_error(family: str, teacher_cache: Path) -> None:
    t = _load(family, teacher_cache)
    n = len(WIDTHS[family])
    with pytest.raises(FamilyError, match=rf"indices in 0\.\.{n - 1} for this {family} teacher"):
        _make(t, blocks=(0, n))
    cfg = make_config(
        **FAMILY_CONFIG, **{"diffusion.model": f"tiny-{family}", "diffusion.blocks": f"0,1,{n + 5}"}
    )
    default = ",".join(map(str, LAYERS[family]))
    with pytest.raises(FamilyError, match=rf"0\.\.{n - 1}.*its default is '{default}'"):
        teacher_spec(cfg, teacher_cache)  # before any network is built


def test_family_is_in_the_key_and_the_cache_hits_on_the_second_call(family: str, teacher_cache: Path) -> None:
    blocks = ",".join(map(str, LAYERS[family]))
    cfg = make_config(**FAMILY_CONFIG, **{"diffusion.model": f"tiny-{family}", "diffusion.blocks": blocks})
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    fs = feature_set(teacher_spec(cfg, teacher_cache), data, teacher_prompts(cfg, data.class_names))
    assert fs.fields["family"] == family and fs.fields["blocks"] == list(LAYERS[family])
    ids = np.arange(6)
    first, st1 = pooled_features(fs, ids)
    second, st2 = pooled_features(fs, ids)
    assert (st1.misses, st2.hits, st2.misses) == (6, 6, 0)
    for b in LAYERS[family]:
        assert first[b].shape == (6, len(fs.prompts), WIDTHS[family][b])
        np.testing.assert_array_equal(first[b], second[b])


def test_an_unsupported_pipeline_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(FamilyError, match="FluxPipeline pipeline; supported teachers are"):
        read_family(tmp_path)
    with pytest.raises(TeacherLoadError, match="FluxPipeline"):
        teacher_identity(str(tmp_path), tmp_path / "cache")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reduced_precision_runs_and_stays_close(
    family: str, dtype: torch.dtype, teacher_cache: Path, images: torch.Tensor
) -> None:
    """bfloat16 and float16 (what CUDA runs) through every family's path: the model timestep,
    masks and pooled embeddings survive the cast; pooled features stay float32 and close."""
    ref = _make(_load(family, teacher_cache))(images, torch.arange(3), PROMPTS)
    low = _make(load_teacher(f"tiny-{family}", teacher_cache, CPU, dtype))(images, torch.arange(3), PROMPTS)
    for b in ref:
        assert low[b].dtype == torch.float32 and torch.isfinite(low[b]).all()
        cos = torch.nn.functional.cosine_similarity(low[b].flatten(1), ref[b].flatten(1), dim=-1)
        assert float(cos.min()) > 0.98, (b, cos)


MODELS = {"sd": "tiny", "sdxl": "tiny-sdxl", "pixart": "tiny-pixart", "sd3": "tiny-sd3"}


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("fam", sorted(MODELS))
def test_which_part_runs_in_which_dtype(
    fam: str, dtype: torch.dtype, teacher_cache: Path, images: torch.Tensor
) -> None:
    """The dtype audit: the denoiser runs in the teacher's dtype; the VAE too, except SDXL's
    under float16 (float32, as diffusers' SDXL pipelines); text encoders in the teacher's dtype
    (T5 keeps its float32 ``wo`` under float16, as transformers loads it) and on the CPU once
    the prompts are encoded."""
    t = load_teacher(MODELS[fam], teacher_cache, CPU, dtype)
    ran: dict[str, torch.dtype] = {}

    def seen(name):
        def hook(_module, args, kwargs) -> None:
            ran.setdefault(name, (args or (kwargs.get("hidden_states"),))[0].dtype)

        return hook

    hooks = [
        t.vae.encoder.register_forward_pre_hook(seen("vae"), with_kwargs=True),
        t.unet.register_forward_pre_hook(seen("denoiser"), with_kwargs=True),
    ]
    try:
        blocks = (1, 2, 3) if fam == "sd" else LAYERS[fam]
        feat = Featurizer(t, resolution=16, timestep=300, blocks=blocks, ensemble=1, seed=0)
        out = feat(images, torch.arange(3), PROMPTS)
    finally:
        for h in hooks:
            h.remove()
    vae = torch.float32 if (fam, dtype) == ("sdxl", torch.float16) else dtype
    assert ran == {"vae": vae, "denoiser": dtype}
    assert {p.dtype for p in t.vae.parameters()} == {vae} and {p.dtype for p in t.unet.parameters()} == {
        dtype
    }
    assert vae_dtype(teacher_identity(MODELS[fam], teacher_cache).folder, fam, dtype) == vae
    for enc in t.text_encoders:
        kept = {n for n, p in enc.named_parameters() if p.dtype != dtype}
        t5 = type(enc).__name__ == "T5EncoderModel" and dtype == torch.float16
        assert kept == ({n for n, _ in enc.named_parameters() if ".wo." in n} if t5 else set()), kept
        assert kept or not t5
        assert {p.device for p in enc.parameters()} == {CPU}
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in out.values())


def test_sdxl_encodes_in_float32_where_float16_overflows(tmp_path: Path, images: torch.Tensor) -> None:
    """A VAE whose first convolution leaves float16's range (x 1e5): in float16 its latents are
    not finite (the premise); the SDXL teacher under float16 encodes in float32, so its
    features are finite and close to the float32 teacher's."""
    folder = str(build_tiny_zoo("sdxl", tmp_path / "sdxl", seed=0))
    x = to_unit_range(images, 16)
    feats = {}
    for dtype in (torch.float32, torch.float16):
        t = load_teacher(folder, tmp_path, CPU, dtype)
        with torch.no_grad():
            for p in t.vae.encoder.conv_in.parameters():
                p.mul_(1e5)
        assert torch.isfinite(encode_image(t.vae, x.to(t.vae.dtype))).all()
        if dtype == torch.float16:
            assert t.vae.dtype == torch.float32
            assert not torch.isfinite(encode_image(copy.deepcopy(t.vae).half(), x.half())).all()
        feats[dtype] = _make(t)(images, torch.arange(3), PROMPTS)
        release_teacher(folder, tmp_path, CPU, dtype)
    for b, ref in feats[torch.float32].items():
        low = feats[torch.float16][b]
        assert torch.isfinite(low).all()
        cos = torch.nn.functional.cosine_similarity(low.flatten(1), ref.flatten(1), dim=-1)
        assert float(cos.min()) > 0.98, (b, cos)


# A family added through its two files alone: an adapter module (here SD's functions under another
# diffusers pipeline class of the same layout) and its line in family.ADAPTERS (set at test time).
DUMMY_ADAPTER = """from feddifrc_app.diffusion import sd

PIPELINES = ("StableDiffusionImg2ImgPipeline",)
LOAD_KWARGS = sd.LOAD_KWARGS
DENOISER, LAYER_COUNT_KEY, LAYER_ATTR, LAYER_NAME = "unet", "up_block_types", "up_blocks", "unet.up_blocks"
TEXT_PARTS = ("text_encoder",)
AUTO_BF16, VAE_FORCE_UPCAST, SHORTCUTS = False, False, True
default_layers, layer_widths, token_width = sd.default_layers, sd.layer_widths, sd.token_width
parts = sd.parts
encode_prompts, noise_coeffs, denoise, pool = sd.encode_prompts, sd.noise_coeffs, sd.denoise, sd.pool
"""


def test_a_new_family_is_its_adapter_module_and_its_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, images: torch.Tensor
) -> None:
    (tmp_path / "dummy_family.py").write_text(DUMMY_ADAPTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(families.ADAPTERS, "dummy", "dummy_family")
    sd_folder = build_tiny_pipeline(tmp_path / "sd", seed=0)
    folder = tmp_path / "dummy"
    shutil.copytree(sd_folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "StableDiffusionImg2ImgPipeline"})
    )
    assert (read_family(folder), read_family(sd_folder)) == ("dummy", "sd")

    cache = tmp_path / "cache"
    t, ref = (load_teacher(str(f), cache, CPU, torch.float32) for f in (folder, sd_folder))
    try:
        assert (t.family, ref.family, type(t.unet)) == ("dummy", "sd", type(ref.unet))
        assert (t.block_channels, t.text_width) == (ref.block_channels, ref.text_width)
        ids = torch.arange(3)
        args = dict(resolution=16, timestep=300, blocks=(1, 2, 3), ensemble=1, seed=0)
        out = Featurizer(t, **args)(images, ids, PROMPTS)
        expect = Featurizer(ref, **args)(images, ids, PROMPTS)
        assert sorted(out) == [1, 2, 3]
        for b in out:  # the same weights through the same functions: the same numbers
            torch.testing.assert_close(out[b], expect[b], atol=0, rtol=0)

        cfg = make_config(**FAMILY_CONFIG, **{"diffusion.model": str(folder), "diffusion.blocks": "1,2,3"})
        data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
        fs = feature_set(teacher_spec(cfg, cache), data, PROMPTS)
        assert fs.fields["family"] == "dummy" and fs.spec.identity.family == "dummy"
        pooled, stats = pooled_features(fs, np.arange(4))
        assert stats.misses == 4 and pooled[3].shape == (4, len(PROMPTS), t.block_channels[3])
        assert np.isfinite(pooled[3]).all()
    finally:
        for f in (folder, sd_folder):
            release_teacher(str(f), cache, CPU, torch.float32)
