"""config_changes: which run folder is the run a config asks for, for folders of every age."""

from __future__ import annotations

from feddifrc_app.config_changes import KEYS_ADDED_SINCE, run_changes
from feddifrc_app.config_loader import keys, resume_may_change

# The first commit that wrote a run folder's config.json: its keys are in every run folder.
FIRST = "9ef3e3a"
# Every run-config key and the commit that introduced it (`git log -S'<key> =' --reverse --
# pyproject.toml`); FIRST for the keys of the first run format. A new key goes here, and, unless a
# resumed run may change it, into config_changes.KEYS_ADDED_SINCE with the value older runs used.
INTRODUCED = {
    **dict.fromkeys(("method", "seed", "num-server-rounds", "fraction-train", "fraction-evaluate"), FIRST),
    **dict.fromkeys(("min-nodes", "outputs-dir", "run-name", "resume-from", "keep-checkpoints"), FIRST),
    "evaluate-holdout": "14a654f",
    "min-nodes-timeout": "d7440d0",
    "max-frozen-rounds": "3e75a01",
    "server.device": "2245997",
    "server.evaluate-every": "06e9872",
    "train.max-grad-norm": "48ff688",
    **dict.fromkeys(("train.threads", "train.deterministic"), "a459bf9"),
    **dict.fromkeys(("dataset.name", "dataset.data-dir", "dataset.image-size"), FIRST),
    **dict.fromkeys(("dataset.num-workers", "dataset.train-limit"), FIRST),
    "dataset.eval-limit": "e807f2b",
    "dataset.val-fraction": "2245997",
    "dataset.classes": "0c1fca0",
    **dict.fromkeys(("partition.name", "partition.alpha", "partition.classes-per-client"), FIRST),
    **dict.fromkeys(("partition.imb-factor", "model.name"), FIRST),
    "model.width": "83cc92f",
    **dict.fromkeys(("train.local-epochs", "train.batch-size", "train.lr", "train.momentum"), FIRST),
    **dict.fromkeys(("train.weight-decay", "train.keep-momentum", "train.augment"), FIRST),
    **dict.fromkeys(("train.eval-batch-size", "train.device", "strategy.name"), FIRST),
    **dict.fromkeys(("strategy.proximal-mu", "strategy.server-learning-rate"), FIRST),
    **dict.fromkeys(("strategy.server-momentum", "strategy.eta", "strategy.eta-l"), FIRST),
    **dict.fromkeys(("strategy.beta-1", "strategy.beta-2", "strategy.tau", "strategy.trim-beta"), FIRST),
    **dict.fromkeys(
        ("strategy.num-malicious-nodes", "strategy.num-nodes-to-select", "strategy.q"), "01d437d"
    ),
    **dict.fromkeys(("strategy.dp", "strategy.dp-noise-multiplier", "strategy.dp-clipping-norm"), "32df9ed"),
    **dict.fromkeys(("strategy.dp-initial-clipping-norm", "strategy.dp-target-clipped-quantile"), "32df9ed"),
    **dict.fromkeys(("strategy.dp-clip-norm-lr", "strategy.dp-clipped-count-stddev"), "32df9ed"),
    "strategy.dp-delta": "884d900",
    "strategy.round-timeout": FIRST,
    "strategy.setup-timeout": "0b41959",
    **dict.fromkeys(("diffusion.model", "diffusion.resolution", "diffusion.timestep"), FIRST),
    **dict.fromkeys(("diffusion.blocks", "diffusion.channels", "diffusion.ensemble"), FIRST),
    **dict.fromkeys(("diffusion.pooling", "diffusion.pool-grid"), "fb0df6f"),
    "diffusion.dit-features": "8f255d3",
    **dict.fromkeys(("diffusion.projection", "diffusion.prompt-template", "diffusion.ndcr-prompt"), FIRST),
    **dict.fromkeys(("diffusion.batch-size", "diffusion.device", "diffusion.dtype"), FIRST),
    **dict.fromkeys(("diffusion.cache-dir", "diffusion.condition"), FIRST),
    **dict.fromkeys(("loss.variant", "loss.tdcl-weight", "loss.ndcr-weight", "loss.temperature"), FIRST),
    **dict.fromkeys(("loss.num-negatives", "loss.tdcl-normaliser", "loss.ndcr-space"), FIRST),
    "loss.tdcl-targets": "89dc24f",
    "loss.ndcr-view": "e53e94c",
    **dict.fromkeys(("ssl.positive-prompt", "ssl.ndcr-prompt", "ssl.negatives"), FIRST),
    **dict.fromkeys(("ssl.num-negatives", "ssl.probe-epochs"), FIRST),
    **dict.fromkeys(("moon.mu", "moon.tau", "fednh.rho", "fednh.scale"), "222672e"),
    "fednh.max-grad-norm": "f49764d",
    "diffusion.noise-seed": "44684ef",
    "diffusion.basis-nodes": "a459bf9",
    **dict.fromkeys(("tracking.backend", "tracking.dir", "tracking.project", "tracking.tags"), "2a3060a"),
}


def test_every_key_added_since_the_first_run_format_has_the_value_older_runs_computed_with():
    assert not (new := sorted(set(keys()) - set(INTRODUCED))), f"keys without their commit here: {new}"
    assert not (gone := sorted(set(INTRODUCED) - set(keys()))), (
        f"keys listed here that no longer exist: {gone}"
    )
    added = {k for k, commit in INTRODUCED.items() if commit != FIRST}
    missing = sorted(added - resume_may_change() - set(KEYS_ADDED_SINCE))
    assert not missing, f"keys added since {FIRST} without the value older runs computed with: {missing}"
    assert not (extra := sorted(set(KEYS_ADDED_SINCE) - added)), f"in the first run format already: {extra}"


def test_a_key_a_run_never_read_counts_at_any_value_and_validation_came_with_ndcr_view():
    """Older runs: moon.* / fednh.* only for their method; no validation hold-out before e53e94c
    (loss.ndcr-view), except mnist-5k's public split."""
    new = {
        "method": "feddifrc",
        "dataset.name": "cifar10",
        "dataset.val-fraction": 0.1,
        "fednh.max-grad-norm": 10.0,
    }
    new |= {"moon.mu": 5.0, "loss.ndcr-view": "augmented"}
    old = {"method": "feddifrc", "dataset.name": "cifar10", "loss.ndcr-view": "augmented"}
    assert run_changes(old, new) == []
    assert run_changes({**old, "method": "fednh"}, {**new, "method": "fednh"}) == [
        "fednh.max-grad-norm: 0.0 -> 10.0"
    ]
    before_validation = {"method": "feddifrc", "dataset.name": "cifar10"}
    assert run_changes(before_validation, new) == ["dataset.val-fraction: 0.0 -> 0.1"]
    assert run_changes(before_validation, {**new, "dataset.val-fraction": 0.0}) == []
    mnist = {**new, "dataset.name": "mnist-5k"}
    assert run_changes({**before_validation, "dataset.name": "mnist-5k"}, mnist) == []
