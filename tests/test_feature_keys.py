"""The feature-cache key of every tiny teacher family, pinned: a refactor of the teacher runtime
(families, pipeline, cache) must leave every key as it was, or every filled cache is lost.

The keys were computed on commit 113fb0d (before the runtime was split); the inputs are fixed
(the plumbing digits data, three prompts, each family's default layers, the run seed 7). They
predate ``diffusion.noise-seed``: their noise came from the run seed, which ``-1`` keeps
(``OLD_NOISE``); caches filled then still serve with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import make_config

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.device import auto_dtype
from feddifrc_app.diffusion.family import family_module
from feddifrc_app.methods.feddifrc.teacher import feature_set, teacher_spec

PROMPTS = ("a photo of a zero", "a photo of a one", "")
OLD_NOISE = {"diffusion.noise-seed": -1}  # the noise of the run seed, as before the key existed
MODELS = {"sd": ("tiny", "1,2,3"), "sdxl": ("tiny-sdxl", "0,1,2"), "pixart": ("tiny-pixart", "1,2,3")}
MODELS["sd3"] = ("tiny-sd3", "1,2,3")
KEYS = {
    ("sd", "float32"): "82f7aaf03dae5724d3d0091e40d9714ef7bd66792e7fe2fbbec1aae0e7b5b413",
    ("sd", "float16"): "7eb5e993c34d1791219ed3d6b67f0aea8716a9ce2c668a88341b8ec4394782ea",
    ("sd", "bfloat16"): "53ec7d02cd62d5003a5a059001203c2aaff39a0ed760473f043acc401e57776a",
    ("sdxl", "float32"): "930efb0cd98c7706dd2a966b1444f07a8cdcb683d66ddd41d9b300c7a6879f27",
    ("sdxl", "float16"): "601c701efc3cc945a50afc794b5422faada6a9c9b147647766b3d3ff4a88306b",  # + vae float32
    ("sdxl", "bfloat16"): "f861182be69db92b48962a4c51435153f2ccd5fb737fc99707973cee89f0cd83",
    ("pixart", "float32"): "837fd5d9693c06ebe2dfd2f6b18e99c20dacac64735ea9a1d3a148899ad7049a",
    ("pixart", "float16"): "b6fa4b4bdd2910f0c801ec2811039c62c55473fe37bdda0af5b04654bfddd742",
    ("pixart", "bfloat16"): "e32918c1bf8cf75795a5e9eb0ecac0bc5a9a0ab743890a7b3d33c7f4196d631f",
    ("sd3", "float32"): "e73a7953edfb36627b52bcabc0730d5df2f832e0cf49945225308386dad0b144",
    ("sd3", "float16"): "e7e942c82b8e7673f8ed96c6483b3158987680e24210b809694e9d9a9818a0c3",
    ("sd3", "bfloat16"): "60829b2e882bd498428a77164cb5ebb6bc8297afdfc59447e8eeaa3272da91c4",
}
# diffusion.dtype = "auto" on a GPU that computes bfloat16: which of the pinned keys a family gets
AUTO_ON_CUDA = {"sd": "float16", "sdxl": "bfloat16", "pixart": "float16", "sd3": "bfloat16"}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_feature_key_of_each_family_is_pinned(family: str, dtype: str, teacher_cache: Path) -> None:
    model, blocks = MODELS[family]
    cfg = make_config(
        **{"diffusion.model": model, "diffusion.blocks": blocks, "diffusion.device": "cpu"}, **OLD_NOISE
    )
    spec = teacher_spec(cfg, teacher_cache)
    # float16 / bfloat16 are what CUDA runs (refused on the CPU as a setting): the key is known without a GPU
    spec = dataclasses.replace(spec, dtype=getattr(torch, dtype))
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    fs = feature_set(spec, data, PROMPTS)
    assert spec.identity.family == family
    assert fs.key == KEYS[family, dtype], fs.key
    assert ("vae_dtype" in fs.fields) is ((family, dtype) == ("sdxl", "float16"))
    assert ("family" in fs.fields) is (family != "sd")  # SD's keys predate the field


@pytest.mark.parametrize("family", sorted(MODELS))
def test_auto_dtype_on_a_gpu_per_family(family: str) -> None:
    auto = auto_dtype("cuda", family_module(family).AUTO_BF16, bf16_supported=True)
    assert auto == getattr(torch, AUTO_ON_CUDA[family])


# diffusion.pooling / the mid-block on the tiny SD teacher (float32): a field only off the default
OPTION_KEYS = {
    ("mean", 2, "1,2,3"): KEYS["sd", "float32"],  # pool-grid is unread under mean pooling
    ("mean", 3, "1,2,3"): KEYS["sd", "float32"],
    ("grid", 2, "1,2,3"): "dfbd35b2427a2d1ad1075aa59258d5f7922175f494105cfb39f2c220b0abfff2",
    ("grid", 3, "1,2,3"): "6a9dd68be2ac95383095f8d3e23a625815b5116181e1b5a5acd7c0a73de644c4",
    ("mean", 2, "-1,1,2"): "392e25c6cdd3894d3b2945ffa875d60896d2058e67bd0888b46a551832dada69",
}


@pytest.mark.parametrize(("pooling", "grid", "blocks"), sorted(OPTION_KEYS))
def test_pooling_and_mid_block_keys_are_pinned(
    pooling: str, grid: int, blocks: str, teacher_cache: Path
) -> None:
    cfg = make_config(
        **{"diffusion.model": "tiny", "diffusion.blocks": blocks, "diffusion.device": "cpu"},
        **{"diffusion.pooling": pooling, "diffusion.pool-grid": grid},
        **OLD_NOISE,
    )
    spec = teacher_spec(cfg, teacher_cache)
    fs = feature_set(spec, load_dataset(cfg.dataset, "train", seed=cfg.seed), PROMPTS)
    assert fs.key == OPTION_KEYS[pooling, grid, blocks], fs.key
    assert fs.fields.get("pool_grid") == (grid if pooling == "grid" else None)
    assert fs.fields["blocks"] == [int(b) for b in blocks.split(",")]
    # nothing else moves: the fields are the default's but for pool_grid and the blocks
    default = make_config(
        **{"diffusion.model": "tiny", "diffusion.blocks": "1,2,3", "diffusion.device": "cpu"}, **OLD_NOISE
    )
    base = feature_set(teacher_spec(default, teacher_cache), fs.data, PROMPTS).fields
    rest = {k: v for k, v in fs.fields.items() if k not in ("pool_grid", "blocks")}
    assert rest == {k: v for k, v in base.items() if k != "blocks"}
