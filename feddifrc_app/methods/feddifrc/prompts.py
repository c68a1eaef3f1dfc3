"""The prompts the teacher is run with; their order is part of the feature-cache key."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from feddifrc_app.config import Config
from feddifrc_app.methods.feddifrc.rules import self_supervised


def teacher_prompts(
    cfg: Config, class_names: Sequence[str], negative_pool: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The prompt list of the run's method; the NDCR prompt is always LAST.

    - ``feddifrc`` (and ``fedavg``): ``prompt_template.format(name)`` for every class in LABEL
      order (prompt y is the TDCL positive of a sample with label y, the others its
      negatives), then ``diffusion.ndcr_prompt`` ("" = unconditional).
    - ``feddifrc-ssl`` (``self_supervised(cfg)``): ``ssl.positive_prompt``, then the template
      over ``ssl.negatives`` or, when that is empty, over ``ssl.num_negatives`` names drawn
      without replacement by ``numpy.random.default_rng(cfg.seed)`` from ``negative_pool`` (default: the 200
      Tiny-ImageNet class names) and kept in pool order, then ``ssl.ndcr_prompt``.
    """
    d = cfg.diffusion
    if self_supervised(cfg):
        negatives = tuple(cfg.ssl.negatives)
        if not negatives:
            if negative_pool is None:
                from feddifrc_app.data.tiny_imagenet_names import TINY_IMAGENET_CLASS_NAMES as negative_pool
            pool = tuple(negative_pool)
            if not pool:
                raise ValueError("teacher_prompts: empty negative_pool for method 'feddifrc-ssl'")
            rng = np.random.default_rng(int(cfg.seed))
            pick = rng.choice(len(pool), size=min(int(cfg.ssl.num_negatives), len(pool)), replace=False)
            negatives = tuple(pool[i] for i in sorted(pick))
        return (
            cfg.ssl.positive_prompt,
            *(d.prompt_template.format(n) for n in negatives),
            cfg.ssl.ndcr_prompt,
        )
    if not class_names:
        raise ValueError("teacher_prompts: no class names")
    return (*(d.prompt_template.format(c) for c in class_names), d.ndcr_prompt)
