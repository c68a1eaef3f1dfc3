"""teacher.py: the feature-cache key of a run's teacher (what changes it, and what must not), and
how long the teacher stays loaded."""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import weakref

import numpy as np
import pytest
import torch
from conftest import make_config

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.diffusion.family import vae_dtype
from feddifrc_app.diffusion.pipeline import teacher_identity
from feddifrc_app.diffusion.shards import key_fields, key_from_fields
from feddifrc_app.diffusion.tiny import build_tiny_pipeline
from feddifrc_app.methods.feddifrc import teacher
from feddifrc_app.methods.feddifrc.projection import client_stats, fit_federated_basis, fuse
from feddifrc_app.methods.feddifrc.teacher import (
    feature_set,
    featurizer,
    pooled_features,
    teacher_prompts,
    teacher_spec,
)


def test_cache_key_names_the_weights_never_their_folder(tmp_path):
    """The same weights moved or copied elsewhere hit the same cache; other weights or dtype do not."""
    a = build_tiny_pipeline(tmp_path / "here" / "teacher", seed=0)
    b = tmp_path / "moved" / "elsewhere"
    shutil.copytree(a, b)
    other = build_tiny_pipeline(tmp_path / "other", seed=1)

    def key(model, **over):
        cfg = make_config(**{"diffusion.model": str(model), "diffusion.device": "cpu", **over})
        data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
        prompts = teacher_prompts(cfg, data.class_names)
        features = feature_set(teacher_spec(cfg, tmp_path / "cache"), data, prompts)
        return features.key, features.fields

    (ka, fields), (kb, _) = key(a), key(b)
    assert ka == kb and str(tmp_path) not in str(fields) and "model_id" not in fields
    assert key(other)[0] != ka  # other weights
    assert key(a, **{"diffusion.dtype": "bfloat16"})[0] != ka  # the dtype is part of the key
    assert fields["dtype"] == "float32" and len(fields["weights_hash"]) == 64


def test_vae_dtype_is_the_sdxl_rule_of_diffusers_not_the_flag_alone(teacher_cache):
    """float32 only for SDXL under float16 with force_upcast set; SD 2.1's, PixArt's and SD3's VAE
    configs set the flag too (the tiny ones as well: diffusers' default), and stay in the dtype."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    got = {}
    for model in ("tiny", "tiny-sdxl", "tiny-pixart", "tiny-sd3"):
        ident = teacher_identity(model, teacher_cache)
        assert json.loads((ident.folder / "vae" / "config.json").read_text())["force_upcast"] is True
        got.update({(ident.family, d): vae_dtype(ident.folder, ident.family, d) for d in (f32, f16, bf16)})
    assert got == {(fam, d): f32 if (fam, d) == ("sdxl", f16) else d for fam, d in got}
    fixed = teacher_cache / "sdxl-fp16-fix"  # an SDXL folder whose VAE says it needs no upcast
    shutil.copytree(teacher_identity("tiny-sdxl", teacher_cache).folder, fixed, dirs_exist_ok=True)
    cfg = json.loads((fixed / "vae" / "config.json").read_text())
    (fixed / "vae" / "config.json").write_text(json.dumps({**cfg, "force_upcast": False}))
    assert vae_dtype(fixed, "sdxl", f16) == f16


def test_only_an_upcast_vae_adds_a_key_field(teacher_cache):
    """SDXL under float16 gets vae_dtype in its key; every other (family, dtype) key is the one
    made before the field existed (the SD keys are pinned in test_teacher_families.py)."""
    base = dict(
        weights_hash="ab" * 32,
        resolution=224,
        timestep=300,
        blocks=(1, 2, 3),
        prompts=("a", ""),
        seed=0,
        ensemble=1,
        dataset_fingerprint="cd" * 32,
    )
    for family in ("sd", "sdxl", "pixart", "sd3"):
        for dtype in ("float32", "float16", "bfloat16"):
            before = key_fields(**base, dtype=dtype, family=family)
            same = key_fields(**base, dtype=dtype, vae_dtype=f"torch.{dtype}", family=family)
            assert same == before and "vae_dtype" not in same
    up = key_fields(**base, dtype="float16", vae_dtype="torch.float32", family="sdxl")
    plain = key_fields(**base, dtype="float16", family="sdxl")
    assert up == {**plain, "vae_dtype": "float32"} and key_from_fields(up) != key_from_fields(plain)
    # through the spec: what the run's key records
    sdxl = {"diffusion.model": "tiny-sdxl", "diffusion.blocks": "0,1,2", "diffusion.channels": "64,32,32"}
    cfg = make_config(**sdxl, **{"model.width": 16, "diffusion.device": "cpu"})
    spec = teacher_spec(cfg, teacher_cache)
    assert (spec.dtype, spec.vae_dtype, spec.where) == (torch.float32, torch.float32, "cpu float32")
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    prompts = teacher_prompts(cfg, data.class_names)
    f16 = dataclasses.replace(spec, dtype=torch.float16)  # what a GPU resolves for diffusion.dtype = float16
    assert f16.vae_dtype == torch.float32
    fields = feature_set(f16, data, prompts).fields
    assert (fields["dtype"], fields["vae_dtype"], f16.where) == (
        "float16",
        "float32",
        "cpu float16 (vae float32)",
    )


def test_grid_pooling_is_a_spec_field_a_key_field_and_widens_the_features(teacher_cache):
    """pooling = "grid": the spec's pool_grid (0 under mean, whatever pool-grid says), a key field
    only then, features g^2 times wider, and a federated basis to the same fused width."""
    base = dict(weights_hash="ab" * 32, resolution=16, timestep=300, blocks=(1, 2, 3), prompts=("a", ""))
    base.update(seed=0, ensemble=1, dataset_fingerprint="cd" * 32, dtype="float32")
    assert key_fields(**base, pool_grid=0) == key_fields(**base)
    assert key_fields(**base, pool_grid=2) == {**key_fields(**base), "pool_grid": 2}
    opts = {"model.width": 16, "diffusion.device": "cpu", "diffusion.channels": "64,32,32"}
    mean = teacher_spec(make_config(**opts, **{"diffusion.pool-grid": 3}), teacher_cache)
    cfg = make_config(**opts, **{"diffusion.pooling": "grid", "diffusion.pool-grid": 2})
    grid = teacher_spec(cfg, teacher_cache)
    assert (mean.pool_grid, grid.pool_grid) == (0, 2)
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    prompts = teacher_prompts(cfg, data.class_names)
    ids = np.arange(6)
    wide, _ = pooled_features(feature_set(grid, data, prompts), ids)
    narrow, _ = pooled_features(feature_set(dataclasses.replace(mean, pool_grid=0), data, prompts), ids)
    for b in (1, 2, 3):
        assert wide[b].shape == (6, len(prompts), 4 * narrow[b].shape[-1])
        # each channel's four cells average to its mean-pooled feature (float16 storage)
        cells = wide[b].astype(np.float32).reshape(6, len(prompts), -1, 4).mean(-1)
        np.testing.assert_allclose(cells, narrow[b].astype(np.float32), rtol=2e-3, atol=2e-3)
    basis, _ = fit_federated_basis([client_stats(wide)], cfg.diffusion.channels, (1, 2, 3), cfg.embedding_dim)
    assert fuse(wide, basis).shape == (6, len(prompts), cfg.embedding_dim)


def test_the_mid_block_passes_the_config_rules_and_minus_two_does_not():
    from feddifrc_app.casting import ConfigError

    opts = {"model.width": 16, "diffusion.channels": "64,32,32"}
    assert make_config(**opts, **{"diffusion.blocks": "-1,2,3"}).diffusion.blocks == (-1, 2, 3)
    with pytest.raises(ConfigError, match="'diffusion.blocks' = '-2,2,3'.*-1: their mid-block"):
        make_config(**opts, **{"diffusion.blocks": "-2,2,3"})
    with pytest.raises(ConfigError, match="diffusion.pooling"):
        make_config(**{"diffusion.pooling": "max"})
    with pytest.raises(ConfigError, match="diffusion.pool-grid"):
        make_config(**{"diffusion.pool-grid": 0})


@pytest.mark.parametrize("condition", ["none", "global-model"])
def test_the_teacher_is_released_after_a_cold_extraction_unless_conditioned(tmp_path, condition):
    """After the cache is filled nothing references the denoiser or the text encoders (their
    memory is free), unless diffusion.condition = "global-model" needs the denoiser and VAE
    every round; the text encoders are released either way once the prompts are encoded."""
    cfg = make_config(
        **{"diffusion.device": "cpu", "diffusion.condition": condition, "dataset.train-limit": 8}
    )
    spec = teacher_spec(cfg, tmp_path)
    assert spec.resident is (condition == "global-model")
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    features = feature_set(spec, data, teacher_prompts(cfg, data.class_names))
    held = teacher.loaded()
    t = featurizer(spec).teacher  # what the extraction below uses (loaded once per spec)
    parts = [weakref.ref(m) for m in (t.unet, t.vae)]
    texts = [weakref.ref(m) for m in (*t.text_encoders, t.tokenizer)]
    del t
    _, stats = pooled_features(features, np.arange(4))
    assert stats.misses == 4
    gc.collect()
    assert len(texts) == 2 and [r() for r in texts] == [None, None]  # freed, not parked
    if condition == "none":
        assert [r() for r in parts] == [None] * len(parts) and teacher.loaded() == held
    else:
        assert all(r() is not None for r in parts) and featurizer(spec).teacher.unet is parts[0]()
        assert featurizer(spec).teacher.text_encoders == ()
        _, warm = pooled_features(features, np.arange(4))
        assert warm.hits == 4 and featurizer(spec).teacher.unet is parts[0]()
        teacher.release(spec)
        gc.collect()
        assert [r() for r in parts] == [None] * len(parts) and teacher.loaded() == held
