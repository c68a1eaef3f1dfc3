"""The ``feddifrc`` command (console script): work done outside ``flwr run``.

    extract           fill the teacher-feature cache for a run config (resumable, per image)
    pretrain-teacher  train the tiny text-to-image teacher on the public split (``tiny-mnist``)
    make-tiny         build the embedded tiny RANDOM-weight teacher and print its folder
    fetch             download (or, offline, verify) what a run config needs on a node
    report            a run's per-round table and summary
    status            the newest runs under outputs-dir and how far they got
    sweep             conf files x grid values x seeds as real ``flwr run``s (resumable)
    table             a sweep's markdown/CSV table and accuracy curves

``feddifrc COMMAND --help`` gives each one's flags. Subcommands live in :data:`COMMANDS`
(name -> help, argument adder, runner); add a row to add one. The run config is read by
``run_config`` (the app's defaults plus ``--run-config``, as ``flwr run`` reads them). Heavy
modules (torch, diffusers, datasets) are imported inside the runners, so ``feddifrc --help``
is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from feddifrc_app.casting import PathError, resolve_path
from feddifrc_app.config import DEFAULT_CACHE_DIR, DEFAULT_OUTPUTS_DIR, Config, ConfigError, resolve_cache_dir
from feddifrc_app.results import Results
from feddifrc_app.tools.run_config import RunConfigError, app_defaults, load_app_config, parse_run_config

if TYPE_CHECKING:  # torch-free at import: `feddifrc --help` stays fast
    from feddifrc_app.methods.feddifrc.teacher import FeatureSet

EXTRACT_CHUNK = 256  # images per cache write (one shard's worth): the resume granularity


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


# --------------------------------------------------------------------------- run config


def _int_list(flag: str, s: str | None) -> list[int] | None:
    if s is None or not s.strip():
        return None
    try:
        return [int(p) for p in s.split(",") if p.strip()]
    except ValueError:
        raise CLIError(f"{flag} {s!r}: expected comma-separated integers, e.g. 0,3") from None


def _splits(s: str) -> list[str]:
    out = [p.strip() for p in s.split(",") if p.strip()]
    bad = [p for p in out if p not in ("train", "test")]
    if not out or bad:
        raise CLIError(f"--split {s!r}: expected train, test or train,test")
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------- extract


def _add_run_config_args(p: argparse.ArgumentParser) -> None:
    """--app, --run-config and --cache-dir: the run config and node cache a command works on."""
    p.add_argument("--app", default=".", help="Flower app folder (its pyproject.toml holds the defaults)")
    p.add_argument(
        "--run-config",
        action="append",
        metavar="FILE_OR_PAIRS",
        help='overrides, like flwr run: conf/X.toml or "key=value key2=value2" (repeatable)',
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="node cache folder (default: diffusion.cache-dir or ~/.cache/feddifrc)",
    )


def _add_extract(p: argparse.ArgumentParser) -> None:
    _add_run_config_args(p)
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
    wanted = _int_list("--partitions", args.partitions)
    if wanted is not None and any(not 0 <= i < args.num_partitions for i in wanted):
        raise CLIError(f"--partitions {args.partitions}: ids must be in 0..{args.num_partitions - 1}")
    if args.chunk < 1:
        raise CLIError("--chunk: expected >= 1")
    return wanted


def cmd_extract(args: argparse.Namespace) -> int:
    cfg = load_app_config(args.app, args.run_config)
    if not cfg.uses_diffusion:
        print(f"method '{cfg.method}' uses no diffusion teacher: nothing to extract")
        return 0
    wanted, splits = _extract_partitions(args), _splits(args.split)
    cache_dir = resolve_cache_dir(cfg, args.cache_dir)
    d = cfg.diffusion
    if d.condition != "none":
        print(
            f"note: diffusion.condition = '{d.condition}' conditions features on the global model each "
            "round; extracting the static (unconditioned) features only"
        )

    from feddifrc_app.data.dataset import load_dataset
    from feddifrc_app.device import DeviceError
    from feddifrc_app.diffusion.family import FamilyError
    from feddifrc_app.diffusion.pipeline import TeacherLoadError
    from feddifrc_app.methods.feddifrc.prompts import teacher_prompts
    from feddifrc_app.methods.feddifrc.teacher import feature_set, pooled_features, teacher_spec

    try:
        spec = teacher_spec(cfg, cache_dir)  # no network is built for this
    except (DeviceError, TeacherLoadError, FamilyError) as e:  # FamilyError: a layer it lacks
        raise CLIError(str(e)) from None
    ident = spec.identity
    print(
        f"teacher {ident.model_id} (weights {ident.weights_hash[:12]})"
        f"{' RANDOM weights: plumbing only' if ident.random_weights else ''}"
        f" on {spec.device} / {str(spec.dtype).removeprefix('torch.')}; cache {cache_dir / 'features'}"
    )
    for split in splits:
        data = load_dataset(cfg.dataset, split, seed=cfg.seed)
        features = feature_set(spec, data, teacher_prompts(cfg, data.class_names))
        ids, which = _split_ids(cfg, data, split, args.num_partitions, wanted)
        if args.check:
            _check(features, split, ids, which)
            continue
        try:
            # The same keyed, lazily-loading path the ClientApp uses: identical cache keys.
            progress = not args.no_progress
            _, st = pooled_features(features, ids, keep=False, progress=progress, chunk=args.chunk)
        except TeacherLoadError as e:
            raise CLIError(str(e)) from None
        prompts, key = features.prompts, features.key
        rate = st.misses / st.extract_seconds if st.extract_seconds > 0 else float("nan")
        print(
            f"{data.name}/{split} partitions {which}: {len(ids)} images x {len(prompts)} prompts; "
            f"already cached {st.hits}, computed {st.misses}"
            + (f" ({rate:.1f} images/s)" if st.misses else "")
            + (f", {st.corrupt} invalid shard(s) rebuilt" if st.corrupt else "")
            + f"; key {key[:16]}"
        )
    return 0


def _check(features: FeatureSet, split: str, ids: Any, which: str) -> None:
    """``extract --check``: the hit ratio of this config's key, and what the key is made of."""
    from feddifrc_app.diffusion.cache import FeatureStore

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


def _add_fetch(p: argparse.ArgumentParser) -> None:
    _add_run_config_args(p)
    p.add_argument("--split", default="train,test", help="dataset splits to fetch: train, test or train,test")


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download (online) or verify (offline) what a run config needs on a node, and say where it is.

    The teacher's weights go to the Hugging Face cache (HF_HOME) and the dataset splits to
    dataset.data-dir: run this where there is internet, then copy those folders to an offline
    node (or run it on the node itself, offline, to check that they are complete)."""
    cfg = load_app_config(args.app, args.run_config)
    cache_dir = resolve_cache_dir(cfg, args.cache_dir)

    from huggingface_hub.constants import HF_HUB_CACHE

    from feddifrc_app.data.dataset import DatasetUnavailableError, load_dataset
    from feddifrc_app.diffusion.pipeline import TeacherLoadError, teacher_identity

    try:
        if cfg.uses_diffusion:
            ident = teacher_identity(cfg.diffusion.model, cache_dir)
            print(
                f"teacher {ident.model_id}: weights sha256 {ident.weights_hash} in {ident.folder}"
                + (" (RANDOM weights: plumbing only)" if ident.random_weights else "")
            )
        for split in _splits(args.split):
            data = load_dataset(cfg.dataset, split, seed=cfg.seed)
            print(f"dataset {data.name}/{split}: {len(data)} images, {data.num_classes} classes")
    except (TeacherLoadError, DatasetUnavailableError) as e:
        raise CLIError(str(e)) from None
    print(
        f"to seed an offline node, copy {cfg.dataset.data_dir} (datasets)"
        + (f" and {HF_HUB_CACHE} (hub teacher weights)" if cfg.uses_diffusion else "")
        + " to the same paths there (in the images: under /app/.cache, the node's cache volume)"
    )
    return 0


# --------------------------------------------------------------------------- make-tiny


def _add_make_tiny(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None, help=f"cache folder (default {DEFAULT_CACHE_DIR})")
    p.add_argument("--seed", type=int, default=0, help="weight seed (diffusion.model = tiny-seedN)")


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


# --------------------------------------------------------------------------- pretrain-teacher


def _add_pretrain(p: argparse.ArgumentParser) -> None:
    from feddifrc_app.diffusion.pretrain import FAMILIES, PretrainRecipe

    d = PretrainRecipe()
    p.add_argument(
        "--out",
        required=True,
        help="folder to write the diffusers pipeline to (replaced atomically): missing, empty, or an "
        "earlier pretrain-teacher output",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an --out folder holding other files (never the working directory or the app)",
    )
    p.add_argument("--app", default=".", help="Flower app folder (its pyproject.toml holds the defaults)")
    p.add_argument(
        "--run-config",
        action="append",
        metavar="FILE_OR_PAIRS",
        help="overrides as for `flwr run --run-config` (dataset, prompt template, resolution)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="weights, batches and noise")
    p.add_argument(
        "--family",
        choices=FAMILIES,
        default=d.family,
        help="sd: UNet + CLIP (tiny-mnist); pixart: a PixArt DiT of the same size + T5, same recipe",
    )
    p.add_argument("--vae-steps", type=int, default=d.vae_steps)
    p.add_argument(
        "--unet-steps",
        type=int,
        default=d.unet_steps,
        help="denoiser (UNet or DiT) steps; 0 with --vae-steps 0: the untrained control",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--name", default="tiny-mnist", help="model id recorded in the folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def cmd_pretrain(args: argparse.Namespace) -> int:
    from feddifrc_app.data.dataset import PUBLIC_SPLIT, load_dataset
    from feddifrc_app.diffusion.pretrain import (
        OutFolderError,
        PretrainRecipe,
        check_out_folder,
        pretrain_teacher,
    )
    from feddifrc_app.methods.feddifrc.prompts import teacher_prompts

    protected, out = [resolve_path(args.app, "--app")], resolve_path(args.out, "--out")
    try:  # before anything is loaded or trained
        check_out_folder(out, args.force, protected)
    except OutFolderError as e:
        raise CLIError(str(e)) from None
    cfg = load_app_config(args.app, args.run_config)
    if cfg.dataset.name != "mnist-5k":
        raise CLIError(
            f"dataset.name = {cfg.dataset.name!r} has no public split to pretrain on: the teacher "
            "must never see the federated data; use dataset.name = 'mnist-5k'"
        )
    try:
        recipe = PretrainRecipe(
            seed=args.seed,
            family=args.family,
            resolution=cfg.diffusion.resolution,
            batch_size=args.batch_size,
            vae_steps=args.vae_steps,
            unet_steps=args.unet_steps,
        )
    except ValueError as e:
        raise CLIError(str(e)) from None
    data = load_dataset(cfg.dataset, PUBLIC_SPLIT)
    prompts = teacher_prompts(dataclasses.replace(cfg, method="feddifrc"), data.class_names)[
        : data.num_classes
    ]
    try:
        out = pretrain_teacher(
            data.images,
            data.labels,
            prompts,
            out,
            recipe,
            name=args.name,
            data_note=f"{data.name} '{PUBLIC_SPLIT}' split at {data.image_size} px: disjoint from "
            "the federated train and test splits.",
            progress=not args.no_progress,
            force=args.force,
            protected=protected,
        )
    except OutFolderError as e:  # the folder changed while the teacher trained
        raise CLIError(str(e)) from None
    print(out)
    return 0


# --------------------------------------------------------------------------- entry point

# --------------------------------------------------------------------------- report / status


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (<outputs-dir>/<run-name>) holding results.json")
    p.add_argument("--plots", action="store_true", help="(re)draw accuracy.png from results.json")


def _read_results(run_dir: Path) -> Results:
    """A run directory's results.json, read as the ServerApp reads it to resume."""
    from feddifrc_app.outputs import RunDir

    run = RunDir(run_dir)
    try:
        results = run.load_results()
    except (AttributeError, TypeError) as e:  # valid JSON, not a results.json
        raise CLIError(f"{run.results_path} has an unexpected layout ({type(e).__name__}: {e})") from None
    except ValueError as e:  # not valid JSON, named
        raise CLIError(str(e)) from None
    if results is None:
        raise CLIError(
            f"{run.results_path} does not exist (is {run_dir} a feddifrc run directory? "
            "has round 0 finished?)"
        )
    return results


def cmd_report(args: argparse.Namespace) -> int:
    """Per-round table, final / best / mean-of-last-5, and where the plots and checkpoints are."""
    from feddifrc_app.tools.report import format_table, plot_accuracy

    run_dir = resolve_path(args.run_dir, "RUN_DIR")
    results = _read_results(run_dir)
    if args.plots:
        plot_accuracy(results, run_dir / "accuracy.png")
    teacher = results.teacher or {}
    print(
        f"{run_dir}: {results.method} / {results.strategy} on {results.dataset} ({results.partition})"
        + (f"; teacher {teacher.get('model')}" if teacher else "")
        + (f" (weights {teacher['weights-sha256'][:12]})" if teacher.get("weights-sha256") else "")
        + (
            "  [RANDOM-weight teacher: not evidence that FedDifRC helps]"
            if teacher.get("random-weights")
            else ""
        )
    )
    print(f"status: {_ending(run_dir, results) or results.status or 'unknown (results.json has none)'}")
    if bad := _non_finite(results):  # printed as nan/inf below: not measurements
        print(f"NOT FINITE (nan/inf below are not measurements): {'; '.join(bad)}")
    print(format_table(results))
    for name in ("accuracy.png", "label_distribution.png", "config.json"):
        if (run_dir / name).is_file():
            print(f"{name}: {run_dir / name}")
    ckpts = sorted((run_dir / "checkpoints").glob("round-*.pt"))
    if ckpts:
        print(
            f"checkpoints: {len(ckpts)} (last {ckpts[-1].name}); "
            f"resume with --run-config \"resume-from='{run_dir}'\""
        )
    return 0


def _add_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--outputs-dir", default=DEFAULT_OUTPUTS_DIR, help="the run config's outputs-dir")
    p.add_argument("--last", type=int, default=10, help="show the newest N runs")


def cmd_status(args: argparse.Namespace) -> int:
    """The newest runs under outputs-dir: rounds done, latest and best accuracy, failures."""
    root = resolve_path(args.outputs_dir, "--outputs-dir")
    # lexists, lstat: a results.json that is a broken link or a symlink loop is listed and named too.
    found = [d / "results.json" for d in (sorted(root.iterdir()) if root.is_dir() else []) if d.is_dir()]
    found = [p for p in found if not p.parent.name.startswith(".") and os.path.lexists(p)]
    runs = sorted(found, key=lambda p: p.lstat().st_mtime)[-args.last :]
    if not runs:
        print(f"no runs under {root}")
        return 0
    for path in runs:
        try:
            r = _read_results(path.parent)
        except CLIError as e:
            print(f"{path.parent.name}: {e}")
            continue
        try:
            print(_status_line(path, r))
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # a hand-edited or foreign file
            print(f"{path.parent.name}: {path} has an unexpected layout ({type(e).__name__}: {e})")
    print("live Flower status: `flwr ls <connection>`; logs: `flwr log <run-id> <connection>`")
    return 0


def _status_line(path: Path, r: Results) -> str:
    """One run of `feddifrc status`: progress, accuracy, failures, and how it ended or if it lives."""
    import json

    rounds = [x for x in r.rounds if x.get("round", 0) >= 1]
    cfg_rounds: Any = "?"
    cfg_path = path.parent / "config.json"
    if cfg_path.is_file():
        try:
            cfg_rounds = json.loads(cfg_path.read_text()).get("num-server-rounds", "?")
        except (OSError, ValueError, AttributeError) as e:
            cfg_rounds = f"? ({cfg_path} unreadable: {type(e).__name__})"
    s = r.summary or {}
    fails = sum(len(x.get("failures", [])) for x in rounds)
    acc = (
        f"latest {100 * rounds[-1]['test-accuracy']:.2f}%  best {100 * s['best-accuracy']:.2f}%"
        if rounds and s.get("best-accuracy") is not None
        else "no round finished yet"
    )
    ending = _ending(path.parent, r)
    return (
        f"{path.parent.name}: {r.method}/{r.strategy} {r.dataset}  "
        f"round {len(rounds)}/{cfg_rounds}  {acc}  failures {fails}" + (f"  {ending}" if ending else "")
    )


def _ending(run_dir: Path, r: Results) -> str:
    """How a run ended, or who runs it ("" when it completed): its status and the first line of
    its error, or, for a "running" one, its live holder or that its process is gone."""
    if r.status == "running":
        from feddifrc_app.files import folder_holder

        who = folder_holder(run_dir)
        proc = r.process or {}
        return (
            f"running ({who})"
            if who
            else f"DEAD: results.json says running but no process holds the folder (last pid "
            f"{proc.get('pid', '?')} on {proc.get('host', '?')}); resume with resume-from='{run_dir}'"
        )
    if r.status in (None, "completed"):
        return ""
    first = r.error.splitlines()[0][:200] if isinstance(r.error, str) and r.error.strip() else ""
    return f"{r.status}" + (f": {first}" if first else "")


def _non_finite(r: Results) -> list[str]:
    """Where results.json holds NaN or inf (strict JSON never does: a hand-edited or foreign file)."""

    def bad(v: Any) -> bool:
        return isinstance(v, float) and not math.isfinite(v)

    out = [f"summary {k} = {v}" for k, v in (r.summary or {}).items() if bad(v)]
    for row in r.rounds:
        values = {**row, **(row.get("train-metrics") or {})} if isinstance(row, dict) else {}
        out += [f"round {row.get('round')} {k} = {v}" for k, v in values.items() if bad(v)]
    return out


# --------------------------------------------------------------------------- sweep / table


def _add_sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("confs", nargs="*", help="override files (conf/*.toml); none = the app's defaults")
    p.add_argument("--out", required=True, help="sweep folder (resumable: run the same command again)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 for every cell")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="vary one key over values (TOML, repeatable), e.g. partition.alpha=0.05,0.5",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PAIRS",
        help='overrides for every cell, as for flwr run: "num-server-rounds=3 train.local-epochs=1"',
    )
    p.add_argument("--app", default=".", help="Flower app folder")
    p.add_argument("--federation", default="local", help="flwr connection (local = Ray simulation)")
    p.add_argument(
        "--federation-config",
        default="num-supernodes=10 client-resources-num-cpus=1",
        help="passed to every flwr run",
    )
    p.add_argument("--cell-timeout", type=float, default=6 * 3600, help="seconds before a cell is stopped")


def _grid(values: list[str]) -> dict[str, list[Any]]:
    """``["partition.alpha=0.05,0.5"]`` -> ``{"partition.alpha": [0.05, 0.5]}`` (values are TOML)."""
    grid = {}
    for item in values:
        key, sep, vals = item.partition("=")
        if not sep or not vals:
            raise CLIError(f"--grid {item!r}: expected KEY=V1,V2 with TOML values")
        try:
            grid[key] = [parse_run_config([f"{key}={v}"])[key] for v in vals.split(",")]
        except RunConfigError:
            raise CLIError(
                f"--grid {item!r}: each value must be TOML (a number, true/false, or a quoted string): "
                f"""e.g. --grid "{key}='a','b'" """.rstrip()
            ) from None
    return grid


def _check_supernodes(federation_config: str, configs: dict[str, Config]) -> None:
    """A simulation with fewer SuperNodes than a cell's min-nodes would wait strategy.setup-timeout
    (a day by default) for nodes that never come: refuse it before the first run."""
    n = parse_run_config([federation_config]).get("num-supernodes") if federation_config else None
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CLIError(f"--federation-config num-supernodes = {n!r}: expected an integer >= 1")
    for name, cfg in configs.items():
        if cfg.min_nodes > n:
            raise CLIError(
                f"cell {name}: min-nodes = {cfg.min_nodes} but --federation-config starts "
                f"num-supernodes = {n}, so the run would wait for nodes that never connect; "
                "lower min-nodes (--set) or start more SuperNodes"
            )


def cmd_sweep(args: argparse.Namespace) -> int:
    from feddifrc_app.tools.report import write_sweep_table
    from feddifrc_app.tools.sweep import Flower, Sweep, SweepError, make_cells, run_sweep

    if args.seeds < 1:
        raise CLIError(f"--seeds {args.seeds}: expected >= 1")
    missing = [c for c in args.confs if not Path(c).is_file()]
    if missing:
        raise CLIError(f"no such override file(s): {', '.join(missing)}")
    app, out = resolve_path(args.app, "--app"), resolve_path(args.out, "--out")
    try:
        sweep = Sweep(out, app, app_defaults(app), parse_run_config(args.set))
        confs = [str(resolve_path(c, "override file")) for c in args.confs]
        cells = make_cells(confs, list(range(args.seeds)), _grid(args.grid))
        configs = sweep.validate(cells)
    except (ConfigError, SweepError) as e:
        raise CLIError(str(e)) from None
    _check_supernodes(args.federation_config, configs)
    flower = Flower(app, out / "flwr-home", args.federation, args.federation_config)
    try:
        failures = run_sweep(sweep, cells, flower, args.cell_timeout)
    finally:
        flower.close()
    print(write_sweep_table(out))
    for name, why in failures.items():
        print(f"FAILED {name}: {why.splitlines()[0] if why else ''}")
    return 1 if failures else 0


def _add_table(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir", help="a `feddifrc sweep` folder")


def cmd_table(args: argparse.Namespace) -> int:
    """table.md, table.csv and curves.png of a sweep folder; prints the markdown."""
    from feddifrc_app.tools.report import write_sweep_table

    out = resolve_path(args.sweep_dir, "SWEEP_DIR")
    if not (out / "sweep.json").is_file():
        raise CLIError(f"{out} has no sweep.json (is it a `feddifrc sweep --out` folder?)")
    try:
        print(write_sweep_table(out))
    except ValueError as e:  # an unreadable sweep.json, named
        raise CLIError(str(e)) from None
    return 0


COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "extract": ("fill the teacher-feature cache for a run config (resumable)", _add_extract, cmd_extract),
    "pretrain-teacher": (
        "train the tiny text-to-image teacher on the public split and write an SD folder",
        _add_pretrain,
        cmd_pretrain,
    ),
    "make-tiny": (
        "build the embedded tiny random-weight teacher and print its folder",
        _add_make_tiny,
        cmd_make_tiny,
    ),
    "fetch": (
        "download (or, offline, verify) the teacher weights and dataset a run config needs on a node",
        _add_fetch,
        cmd_fetch,
    ),
    "report": (
        "print a run's per-round table and summary (final, best, mean of last 5)",
        _add_report,
        cmd_report,
    ),
    "status": ("list the newest runs under outputs-dir with their progress", _add_status, cmd_status),
    "sweep": (
        "run conf files x grid values x seeds as real flwr runs (resumable), then the table",
        _add_sweep,
        cmd_sweep,
    ),
    "table": (
        "write a sweep's markdown/CSV table (mean ± std over seeds) and accuracy curves",
        _add_table,
        cmd_table,
    ),
}


# What Ctrl-C keeps, by command: only these resume; any other leaves no partial output behind.
INTERRUPTED = {
    "extract": "the features extracted so far are cached; rerun to resume",
    "sweep": "finished cells are kept; rerun to resume",
    "fetch": "finished files are kept; rerun to resume",
    "pretrain-teacher": "no partial teacher is kept; a rerun starts over",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="feddifrc", description="FedDifRC tools outside `flwr run`.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add, run) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        add(sp)
        sp.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except (CLIError, RunConfigError, PathError) as e:  # PathError: a path argument, named
        print(f"feddifrc {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = INTERRUPTED.get(args.command, "nothing half-written is left")
        print(f"feddifrc {args.command}: interrupted ({kept})", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
