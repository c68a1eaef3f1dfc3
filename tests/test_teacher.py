"""teacher.py: the feature-cache key of a run's teacher (what changes it, and what must not)."""

from __future__ import annotations

import shutil

from conftest import make_config

from feddifrc_app.dataset import load_dataset
from feddifrc_app.diffusion.tiny import build_tiny_pipeline
from feddifrc_app.prompts import teacher_prompts
from feddifrc_app.teacher import feature_set, teacher_spec


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
