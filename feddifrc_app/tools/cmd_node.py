"""Commands that prepare a node: ``extract`` (the teacher-feature cache), ``fetch`` (weights and
datasets, or their offline check) and ``make-tiny`` (the embedded random-weight teacher)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from feddifrc_app.casting import resolve_path
from feddifrc_app.config import DEFAULT_CACHE_DIR, Config
from feddifrc_app.tools.cmd_common import CLIError, add_run_config_args, examples, int_list, split_names
from feddifrc_app.tools.run_config import load_app_config

if TYPE_CHECKING:  # torch-free at import: `feddifrc --help` stays fast
    from feddifrc_app.methods.feddifrc.teacher import FeatureSet, TeacherSpec

EXTRACT_CHUNK = 256  # images per cache write (one shard's worth): the resume granularity


def add_extract(p: argparse.ArgumentParser) -> None:
    add_run_config_args(p)
    p.add_argument("--num-partitions", type=int, default=10, help="clients the training set is split into")
    p.add_argument("--partitions", default=None, help="only these partition ids, e.g. 0,3 (default: all)")
    p.add_argument("--split", default="train", help="train, test or train,test (test = the whole test set)")
    p.add_argument("--chunk", type=int, default=EXTRACT_CHUNK, help="images computed between cache writes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--check",
        action="store_true",
        help="report the cache hit ratio and the key; extract nothing",
    )
    examples(
        p,
        "feddifrc extract --run-config conf/mnist5k-feddifrc.toml",
        'feddifrc extract --run-config "diffusion.timestep=300" --partitions 0,3 --split train,test',
        "feddifrc extract --run-config conf/cifar10-nid1-a0.5-feddifrc.toml --check",
    )


def _split_ids(cfg: Config, data: Any, split: str, num_partitions: int, wanted: list[int] | None):
    """Dataset ids to extract: the union of the chosen partitions (train) or everything (test)."""
    import numpy as np

    n = len(data.labels)
    if split == "test":
        return np.arange(n, dtype=np.int64), "all"
    from feddifrc_app.data.partition import partition_by_config

    parts = partition_by_config(np.asarray(data.labels), num_partitions, cfg.partition, cfg.seed)
    chosen = list(range(num_partitions)) if wanted is None else wanted
    ids = np.unique(np.concatenate([np.asarray(parts[i], dtype=np.int64) for i in chosen]))
    return ids, ",".join(map(str, chosen)) if wanted is not None else f"all {num_partitions}"


def _extract_partitions(args: argparse.Namespace) -> list[int] | None:
    """The validated ``--num-partitions`` / ``--partitions`` / ``--chunk`` choice (None = all)."""
    if args.num_partitions < 1:
        raise CLIError(f"--num-partitions {args.num_partitions}: expected >= 1")
    wanted = int_list("--partitions", args.partitions)
    if wanted is not None and any(not 0 <= i < args.num_partitions for i in wanted):
        raise CLIError(f"--partitions {args.partitions}: ids must be in 0..{args.num_partitions - 1}")
    if args.chunk < 1:
        raise CLIError("--chunk: expected >= 1")
    return wanted


def cmd_extract(args: argparse.Namespace) -> int:
    # FedDifRC's config (the teacher's cache folder): imported per command, so that the CLI
    # starts without torch.
    from feddifrc_app.methods.feddifrc.rules import resolve_cache_dir, uses_diffusion

    cfg = load_app_config(args.app, args.run_config)
    if not uses_diffusion(cfg):
        print(f"method '{cfg.method}' uses no diffusion teacher: nothing to extract")
        return 0
    wanted, splits = _extract_partitions(args), split_names(args.split)
    cache_dir = resolve_cache_dir(cfg, args.cache_dir)
    d = cfg.diffusion
    if d.condition != "none":
        print(
            f"note: diffusion.condition = '{d.condition}' conditions features on the global model each "
            "round; extracting the static (unconditioned) features only"
        )

    from feddifrc_app.data.registry import load_dataset
    from feddifrc_app.methods.feddifrc.teacher import feature_set, teacher_prompts

    spec = resolve_teacher(cfg, cache_dir)
    for split in splits:
        data = load_dataset(cfg.dataset, split, seed=cfg.seed)
        features = feature_set(spec, data, teacher_prompts(cfg, data.class_names))
        ids, which = _split_ids(cfg, data, split, args.num_partitions, wanted)
        if args.check:
            _check(features, split, ids, which)
        else:
            _fill(features, split, ids, which, args)
    return 0


def resolve_teacher(cfg: Config, cache_dir: Path) -> TeacherSpec:
    """The run config's teacher, said in one line (no network is built for this); a teacher it
    cannot have (missing, damaged, a key its folder refuses, no such device) is a CLIError."""
    from feddifrc_app.device import DeviceError
    from feddifrc_app.diffusion.family import FamilyError
    from feddifrc_app.diffusion.pipeline import TeacherLoadError
    from feddifrc_app.methods.feddifrc.teacher import teacher_spec

    try:
        spec = teacher_spec(cfg, cache_dir)
    except (DeviceError, TeacherLoadError, FamilyError) as e:  # FamilyError: a layer it lacks
        raise CLIError(str(e)) from None
    ident = spec.identity
    print(
        f"teacher {ident.model_id} (weights {ident.weights_hash[:12]})"
        f"{' RANDOM weights: plumbing only' if ident.random_weights else ''}"
        f" on {spec.device} / {str(spec.dtype).removeprefix('torch.')}; cache {cache_dir / 'features'}"
    )
    return spec


def _fill(features: FeatureSet, split: str, ids: Any, which: str, args: argparse.Namespace) -> None:
    """``extract``: the features of ``ids`` not cached yet, computed and cached; what it did."""
    from feddifrc_app.diffusion.pipeline import TeacherLoadError
    from feddifrc_app.methods.feddifrc.teacher import pooled_features

    try:
        # The same keyed, lazily-loading path the ClientApp uses: identical cache keys.
        progress = not args.no_progress
        _, st = pooled_features(features, ids, keep=False, progress=progress, chunk=args.chunk)
    except TeacherLoadError as e:
        raise CLIError(str(e)) from None
    data, prompts, key = features.data, features.prompts, features.key
    rate = st.misses / st.extract_seconds if st.extract_seconds > 0 else float("nan")
    print(
        f"{data.name}/{split} partitions {which}: {len(ids)} images x {len(prompts)} prompts; "
        f"already cached {st.hits}, computed {st.misses}"
        + (f" ({rate:.1f} images/s)" if st.misses else "")
        + (f", {st.corrupt} invalid shard(s) rebuilt" if st.corrupt else "")
        + f"; key {key[:16]}"
    )


def _check(features: FeatureSet, split: str, ids: Any, which: str) -> None:
    """``extract --check``: the hit ratio of this config's key, and what the key is made of."""
    from feddifrc_app.diffusion.shards import FeatureStore

    data, key, fields = features.data, features.key, features.fields
    missing = FeatureStore(features.spec.cache_dir / "features").missing(key, ids)
    hits = len(ids) - len(missing)
    print(
        f"{data.name}/{split} partitions {which}: {hits} of {len(ids)} images cached "
        f"({100 * hits / max(len(ids), 1):.1f}%), {len(missing)} to extract; key {key[:16]}"
    )
    shown = {k: v for k, v in fields.items() if k not in ("format", "version", "prompts")}
    print(f"  the key is made of: {shown}, {len(fields['prompts'])} prompts")


# --------------------------------------------------------------------------- fetch


def add_fetch(p: argparse.ArgumentParser) -> None:
    add_run_config_args(p)
    p.add_argument("--split", default="train,test", help="dataset splits to fetch: train, test or train,test")
    examples(
        p,
        "feddifrc fetch --run-config conf/cifar10-nid1-a0.5-feddifrc.toml",
        "HF_HUB_OFFLINE=1 feddifrc fetch --run-config conf/cifar10-nid1-a0.5-feddifrc.toml  # verify offline",
    )


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download (online) or verify (offline) what a run config needs on a node, and say where it is.

    The teacher's weights go to the Hugging Face cache (HF_HOME) and the dataset splits to
    dataset.data-dir: run this where there is internet, then copy those folders to an offline
    node (or run it on the node itself, offline, to check that they are complete)."""
    # FedDifRC's config (the teacher's cache folder): imported per command, so that the CLI
    # starts without torch.
    from feddifrc_app.methods.feddifrc.rules import resolve_cache_dir, uses_diffusion

    cfg = load_app_config(args.app, args.run_config)
    cache_dir = resolve_cache_dir(cfg, args.cache_dir)

    from huggingface_hub.constants import HF_HUB_CACHE

    from feddifrc_app.data.images import DatasetUnavailableError
    from feddifrc_app.data.registry import load_dataset
    from feddifrc_app.diffusion.family import FamilyError
    from feddifrc_app.diffusion.pipeline import TeacherLoadError, teacher_identity
    from feddifrc_app.methods.feddifrc.teacher import check_folder

    try:
        if uses_diffusion(cfg):
            ident = teacher_identity(cfg.diffusion.model, cache_dir)
            check_folder(cfg.diffusion, ident)  # the keys its folder decides: a node would refuse them
            print(
                f"teacher {ident.model_id}: weights sha256 {ident.weights_hash} in {ident.folder}"
                + (" (RANDOM weights: plumbing only)" if ident.random_weights else "")
            )
        for split in split_names(args.split):
            data = load_dataset(cfg.dataset, split, seed=cfg.seed)
            print(f"dataset {data.name}/{split}: {len(data)} images, {data.num_classes} classes")
    except (TeacherLoadError, FamilyError, DatasetUnavailableError) as e:
        raise CLIError(str(e)) from None
    print(
        f"to seed an offline node, copy {cfg.dataset.data_dir} (datasets)"
        + (f" and {HF_HUB_CACHE} (hub teacher weights)" if uses_diffusion(cfg) else "")
        + " to the same paths there (in the images: under /app/.cache, the node's cache volume)"
    )
    return 0


# --------------------------------------------------------------------------- make-tiny


def add_make_tiny(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None, help=f"cache folder (default {DEFAULT_CACHE_DIR})")
    p.add_argument("--seed", type=int, default=0, help="weight seed (diffusion.model = tiny-seedN)")
    examples(p, "feddifrc make-tiny", 'feddifrc make-tiny --seed 1  # then diffusion.model = "tiny-seed1"')


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from feddifrc_app.diffusion.pipeline import weights_hash
    from feddifrc_app.diffusion.tiny import build_tiny_pipeline

    cache_dir = resolve_path(args.cache_dir or DEFAULT_CACHE_DIR, "--cache-dir")
    name = "tiny" if args.seed == 0 else f"tiny-seed{args.seed}"
    path = build_tiny_pipeline(cache_dir / "models" / f"tiny-seed{args.seed}", seed=args.seed)
    print(path)
    print(
        f"embedded tiny teacher (RANDOM weights, plumbing only), weights {weights_hash(path)[:12]}; "
        f'used by diffusion.model = "{name}" with cache-dir {cache_dir}',
        file=sys.stderr,
    )
    return 0
