"""``feddifrc sweep`` and ``feddifrc table``: conf files x grid values x seeds as real runs, and
their table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from feddifrc_app.casting import resolve_path
from feddifrc_app.config import Config, ConfigError
from feddifrc_app.tools.cmd_common import CLIError, examples, exit_on_termination, termination_held
from feddifrc_app.tools.run_config import RunConfigError, app_defaults, parse_run_config, quoted


def add_sweep(p: argparse.ArgumentParser) -> None:
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
    examples(
        p,
        "feddifrc sweep conf/mnist5k-fedavg.toml conf/mnist5k-feddifrc.toml --seeds 3 --out sweeps/mnist",
        "feddifrc sweep conf/mnist5k-feddifrc.toml --out sweeps/alpha --grid partition.alpha=0.05,0.5 "
        '--set "num-server-rounds=20"',
    )


def _grid(values: list[str]) -> dict[str, list[Any]]:
    """``["partition.alpha=0.05,0.5"]`` -> ``{"partition.alpha": [0.05, 0.5]}`` (values are TOML)."""
    grid = {}
    for item in values:
        key, sep, vals = item.partition("=")
        if not sep or not vals:
            raise CLIError(f"--grid {item!r}: expected KEY=V1,V2 with TOML values")
        words = vals.split(",")
        if words != (fixed := [quoted(v) for v in words]):  # method=fedavg,feddifrc: bare words
            raise CLIError(
                f"--grid {item!r}: quote string values (TOML: a number, true/false, or a quoted "
                f'string), inside the shell\'s quotes: --grid "{key}={",".join(fixed)}"'
            )
        try:
            grid[key] = [parse_run_config([f"{key}={v}"], "--grid")[key] for v in words]
        except RunConfigError:
            raise CLIError(
                f"--grid {item!r}: each value must be TOML (a number, true/false, or a quoted string): "
                f"""e.g. --grid "{key}='a','b'" """.rstrip()
            ) from None
    return grid


def _check_supernodes(federation_config: str, configs: dict[str, Config]) -> None:
    """A simulation with fewer SuperNodes than a cell's min-nodes would wait strategy.setup-timeout
    (a day by default) for nodes that never come: refuse it before the first run."""
    n = (
        parse_run_config([federation_config], "--federation-config").get("num-supernodes")
        if federation_config
        else None
    )
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
    from feddifrc_app.tools.sweep import (
        Flower,
        Sweep,
        SweepError,
        check_out,
        make_cells,
        run_sweep,
        validate_cells,
    )

    if args.seeds < 1:
        raise CLIError(f"--seeds {args.seeds}: expected >= 1")
    missing = [c for c in args.confs if not Path(c).is_file()]
    if missing:
        raise CLIError(f"no such override file(s): {', '.join(missing)}")
    app, out = resolve_path(args.app, "--app"), resolve_path(args.out, "--out")
    try:  # every check before --out is created: a refused sweep leaves nothing behind
        defaults, overrides = app_defaults(app), parse_run_config(args.set, "--set")
        confs = [str(resolve_path(c, "override file")) for c in args.confs]
        cells = make_cells(confs, list(range(args.seeds)), _grid(args.grid))
        check_out(out)  # before the cells' configs, whose outputs-dir is under it
        _check_supernodes(args.federation_config, validate_cells(cells, defaults, overrides, out / "runs"))
        sweep = Sweep(out, app, defaults, overrides)
    except (ConfigError, SweepError) as e:
        raise CLIError(str(e)) from None
    flower = Flower(app, out / "flwr-home", args.federation, args.federation_config)
    with exit_on_termination():  # a SIGTERM'd sweep stops its run and its local SuperLink too
        try:
            failures = run_sweep(sweep, cells, flower, args.cell_timeout)
        finally:
            with termination_held():  # a signal now waits for close() to end
                flower.close()
    print(write_sweep_table(out))
    for name, why in failures.items():
        print(f"FAILED {name}: {why.splitlines()[0] if why else ''}")
    return 1 if failures else 0


def add_table(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir", help="a `feddifrc sweep` folder")
    examples(p, "feddifrc table sweeps/mnist")


def cmd_table(args: argparse.Namespace) -> int:
    """table.md, table.csv and curves.png of a sweep folder; prints the markdown."""
    from feddifrc_app.tools.report import write_sweep_table

    out = resolve_path(args.sweep_dir, "SWEEP_DIR")
    if (out / "sweep.json").exists() and not (out / "sweep.json").is_file():
        raise CLIError(f"{out / 'sweep.json'} is not a file (a folder?); move it aside and rerun the sweep")
    if not (out / "sweep.json").is_file():
        raise CLIError(f"{out} has no sweep.json (is it a `feddifrc sweep --out` folder?)")
    try:
        print(write_sweep_table(out))
    except ValueError as e:  # an unreadable sweep.json, named
        raise CLIError(str(e)) from None
    return 0
