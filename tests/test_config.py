"""load_config: casting, validation messages, every conf/*.toml loads."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from conftest import ROOT, default_run_config, make_config

from feddifrc_app import config_loader
from feddifrc_app.config import ConfigError, load_node_config
from feddifrc_app.config_loader import load_config
from feddifrc_app.methods.feddifrc.rules import resolve_cache_dir
from feddifrc_app.tools.run_config import load_app_config, parse_run_config


def test_defaults_load_and_round_trip():
    cfg = make_config()
    assert cfg.method == "feddifrc"
    assert cfg.strategy.name == "fedavg"
    assert cfg.diffusion.blocks == (1, 2, 3)
    assert cfg.diffusion.channels == (256, 128, 128)
    assert sum(cfg.diffusion.channels) == 512
    assert Path(cfg.outputs_dir).is_absolute()
    assert load_config(cfg.to_flat()) == cfg


def test_pyproject_defaults_are_the_quickstart():
    # `flwr run .` with no overrides: mnist-5k with the packaged pretrained teacher, and a
    # width-16 ResNet-10 whose 128-d embedding the fused 64+32+32 teacher feature matches.
    cfg = make_config(plumbing=False)
    assert (cfg.dataset.name, cfg.dataset.image_size, cfg.diffusion.model) == ("mnist-5k", 28, "tiny-mnist")
    assert (cfg.model.width, cfg.embedding_dim, cfg.diffusion.channels) == (16, 128, (64, 32, 32))
    assert cfg.diffusion.resolution == 32 and cfg.method == "feddifrc"
    assert load_config(cfg.to_flat()) == cfg


def test_channels_must_match_the_model_width():
    assert make_config(model__width=32, diffusion__channels="128,64,64").embedding_dim == 256
    with pytest.raises(
        ConfigError, match=r"sum to 128, the ResNet-10 embedding width \(8 \* model.width = 8 \* 16\)"
    ):
        make_config(model__width=16)  # the plumbing base keeps the paper's 256,128,128


def test_casts_flower_scalars():
    # Flower does not type-check overrides: 2.0 in an int key, "0.3" in a float key, "true" in a bool.
    cfg = make_config(
        num_server_rounds=2.0,
        partition__alpha="0.3",
        train__keep_momentum="true",
        diffusion__blocks="2, 3",
        diffusion__channels="256,256",
    )
    assert cfg.num_server_rounds == 2 and isinstance(cfg.num_server_rounds, int)
    assert cfg.partition.alpha == pytest.approx(0.3)
    assert cfg.train.keep_momentum is True
    assert cfg.diffusion.blocks == (2, 3)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ({"num-server-rounds": 2.5}, "'num-server-rounds' = 2.5 is invalid: expected an integer"),
        ({"num-server-rounds": 0}, "expected a value in [1, 2147483647]"),
        ({"train.lr": "fast"}, "'train.lr' = 'fast' is invalid: expected a number"),
        ({"train.lr": 0.0}, "expected a value in (0, 1e+09]"),
        ({"fraction-train": 1.5}, "'fraction-train' = 1.5"),
        ({"train.momentum": 1.0}, "[0, 1)"),
        ({"train.augment": "maybe"}, "expected true or false"),
        ({"partition.alpha": float("nan")}, "finite"),
        ({"diffusion.timestep": 1000}, "[0, 999]"),
        ({"diffusion.channels": "256,128"}, "same length"),
        ({"diffusion.channels": "256,128,64"}, "sum to 512"),
        ({"diffusion.blocks": "1,1,3"}, "distinct"),
        ({"diffusion.prompt-template": "a photo"}, "'{}'"),
        ({"dataset.name": "image-folder"}, "dataset.data-dir"),
        ({"loss.variant": "code", "loss.num-negatives": 3}, "loss.num-negatives"),
        (
            {"partition.alpha": 1e308},
            "'partition.alpha' = 1e+308 is invalid: expected a value in [0.001, 1e+06]",
        ),
        ({"partition.alpha": 1e-6}, "[0.001, 1e+06]"),
        ({"strategy.name": "scaffold", "train.keep-momentum": True}, "'train.keep-momentum' = True"),
        (
            {"method": "moon", "resume-from": "/tmp/r"},
            "method = 'moon' keeps per-node state that a new run lacks",
        ),
        ({"strategy.name": "scaffold", "resume-from": "/tmp/r"}, "strategy.name = 'scaffold' keeps per-node"),
        ({"seed": 2**32}, "'seed' = 4294967296 is invalid: expected a value in [0, 4294967295]"),
        ({"run-name": "../x"}, "'run-name' = '../x' is invalid: expected a plain folder name"),
        ({"run-name": "/abs"}, "'run-name' = '/abs'"),
        ({"run-name": "."}, "'run-name' = '.'"),
        ({"run-name": "a\\b"}, "plain folder name"),
        # Each Flower process would resolve a relative path against its own folder (issue 45).
        ({"outputs-dir": "runs"}, "'outputs-dir' = 'runs' is invalid: a relative path resolves against each"),
        ({"diffusion.model": "./teacher"}, "'diffusion.model' = './teacher' is invalid: a relative path"),
        # 1e-300 of any training split is 0 images: no validation, silently (issue 45).
        (
            {"dataset.val-fraction": 1e-300},
            "'dataset.val-fraction' = 1e-300 is invalid: expected 0 (no validation) or 0.01 to 0.5",
        ),
        # A control or bidirectional character disguises the folder in every listing (issue 45).
        ({"run-name": "run\u202egpj.exe"}, "'run-name' = 'run\\u202egpj.exe' is invalid: expected a plain"),
        (
            {"run-name": "a\nb"},
            "'run-name' = 'a\\nb' is invalid: expected a plain folder name (no '/', '\\', control",
        ),
        # Strategy values that only make a non-finite aggregate from finite replies.
        ({"strategy.q": 1000.0}, "'strategy.q' = 1000.0 is invalid: expected a value in [0, 20]"),
        ({"strategy.tau": 1e-39}, "'strategy.tau' = 1e-39 is invalid: expected a value in [1.17549e-38, 10]"),
        ({"strategy.eta": 1e3}, "'strategy.eta' = 1000.0 is invalid: expected a value in (0, 10]"),
        ({"strategy.server-learning-rate": 1e9}, "'strategy.server-learning-rate' = 1000000000.0"),
        (
            {"strategy.dp-clip-norm-lr": 1000.0},
            "'strategy.dp-clip-norm-lr' = 1000.0 is invalid: expected a value in (0, 1]",
        ),
        ({"max-frozen-rounds": -1}, "'max-frozen-rounds' = -1"),
        (
            {"strategy.dp": "server-adaptive", "strategy.dp-clipped-count-stddev": 1e6},
            "'strategy.dp-clipped-count-stddev' = 1000000.0 is invalid: at most 100 x the nodes",
        ),
        ({"min-nodes-timeout": 0.0}, "'min-nodes-timeout' = 0.0"),
    ],
)
def test_bad_values_name_key_value_and_range(override, fragment):
    raw = default_run_config()
    raw.update(override)
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    ("key", "value", "valid"),
    [
        ("strategy.name", "fedsgd", config_loader.strategy_names()),
        ("dataset.name", "mnist", ("digits", "cifar10", "cifar100", "tiny-imagenet", "image-folder")),
        ("partition.name", "quantity", ("iid", "dirichlet", "pathological")),
        ("method", "scaffold", ("fedavg", "feddifrc", "feddifrc-ssl", "moon", "fednh")),
    ],
)
def test_unknown_names_list_valid_choices(key, value, valid):
    raw = default_run_config()
    raw[key] = value
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    msg = str(e.value)
    assert key in msg and value in msg
    for name in valid:
        assert name in msg


def test_unknown_and_missing_keys():
    raw = default_run_config()
    raw["train.lr-schedule"] = "cosine"
    with pytest.raises(ConfigError, match="unknown config key.*train.lr-schedule"):
        load_config(raw)
    raw = default_run_config()
    del raw["seed"]
    with pytest.raises(ConfigError, match="missing config key.*'seed'"):
        load_config(raw)


def test_strings_are_case_insensitive_for_names():
    assert make_config(strategy__name="FedProx").strategy.name == "fedprox"


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("*.toml")), ids=lambda p: p.name)
def test_every_conf_file_loads(path):
    overrides = parse_run_config([str(path)])
    raw = default_run_config(plumbing=False)
    unknown = set(overrides) - set(raw)
    assert not unknown, f"{path.name} overrides unknown keys {unknown}"
    raw.update(overrides)
    load_config(raw)


# The family templates: family -> (README family-table row prefix, layers, the default layers' widths).
FAMILY_TEMPLATES = {
    "sdxl": ("| SDXL (", 3, (1280, 640, 320)),
    "pixart": ("| PixArt-alpha / Sigma (", 28, (1152,) * 3),
    "sd3": ("| SD3 / SD3.5 (", 24, (1536,) * 3),
}


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_family_templates_pin_cuda_and_use_the_family_defaults_and_public_ids(family):
    """What load_config cannot check offline (the layer range needs the model's config) is read
    from the family module and README's family table: the default layers, PCA widths each layer
    can give, a hub id the README names; the nodes' devices pinned to cuda, the server's auto."""
    from feddifrc_app.diffusion.family import family_module

    row, n, widths = FAMILY_TEMPLATES[family]
    path = ROOT / "conf" / f"{family}-cifar10-nid1-a0.5-feddifrc.toml"
    cfg = load_config(default_run_config(plumbing=False) | parse_run_config([str(path)]))
    assert (cfg.train.device, cfg.diffusion.device, cfg.server.device) == ("cuda", "cuda", "auto")
    assert (cfg.dataset.name, cfg.method) == ("cifar10", "feddifrc")
    assert cfg.diffusion.blocks == family_module(family).default_layers(n)
    assert sum(cfg.diffusion.channels) == cfg.embedding_dim == 512
    assert all(c <= w for c, w in zip(cfg.diffusion.channels, widths, strict=True))
    (line,) = [x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith(row)]
    assert f"`{cfg.diffusion.model}`" in line


def test_server_device_is_its_own_key_defaulting_to_auto():
    cfg = make_config(train__device="cuda")
    assert (cfg.server.device, cfg.train.device) == ("auto", "cuda")
    assert make_config(server__device="CPU").server.device == "cpu"
    with pytest.raises(
        ConfigError, match=r"'server.device' = 'gpu' is invalid: expected one of auto, cpu, cuda"
    ):
        make_config(server__device="gpu")


def test_val_fraction_defaults_to_a_tenth_and_is_bounded():
    assert make_config().dataset.val_fraction == 0.1
    assert make_config(dataset__val_fraction=0).dataset.val_fraction == 0.0
    for bad in (-0.1, 0.6):
        with pytest.raises(
            ConfigError, match=r"'dataset.val-fraction' = .* is invalid: expected a value in \[0, 0.5\]"
        ):
            make_config(dataset__val_fraction=bad)


def test_conf_dir_is_not_empty():
    assert len(list((ROOT / "conf").glob("*.toml"))) >= 10


def test_node_config():
    n = load_node_config({"partition-id": 3, "num-partitions": 10})
    assert (n.partition_id, n.num_partitions, n.data_dir) == (3, 10, "")
    assert load_node_config({"data-dir": "/data/site-a", "cache-dir": "/cache"}).data_dir == "/data/site-a"
    with pytest.raises(ConfigError, match="partition-id"):
        load_node_config({"partition-id": 10, "num-partitions": 10})
    with pytest.raises(ConfigError, match="both"):
        load_node_config({"partition-id": 1})
    with pytest.raises(ConfigError, match="data-dir"):
        load_node_config({})


def test_cache_dir_precedence(tmp_path):
    cfg = make_config(diffusion__cache_dir=str(tmp_path / "run"))
    node = load_node_config({"partition-id": 0, "num-partitions": 1, "cache-dir": str(tmp_path / "node")})
    assert resolve_cache_dir(cfg, node.cache_dir, "node cache-dir") == tmp_path / "node"
    node = load_node_config({"partition-id": 0, "num-partitions": 1})
    assert resolve_cache_dir(cfg, node.cache_dir, "node cache-dir") == tmp_path / "run"


def test_a_batch_of_one_that_reaches_a_1x1_batchnorm_is_refused_naming_the_keys():
    with pytest.raises(ConfigError) as e:
        make_config(method="fedavg", dataset__image_size=8, train__batch_size=1)
    msg = str(e.value)
    assert msg.startswith("config keys 'train.batch-size' = 1 and 'dataset.image-size' = 8: ")
    assert "one value per channel" in msg and "train.batch-size >= 2 or dataset.image-size >= 9" in msg
    make_config(method="fedavg", dataset__image_size=8, train__batch_size=2)  # 2 values per channel
    make_config(method="fedavg", dataset__image_size=9, train__batch_size=1)  # last stage 2x2


@pytest.mark.parametrize(
    "k",
    ["outputs-dir", "resume-from", "dataset.data-dir", "diffusion.cache-dir", "diffusion.model", "run-name"],
)
def test_a_nul_byte_in_a_string_key_is_a_config_error_naming_it(k):
    cfg = default_run_config()
    cfg[k] = "/tmp/a\0b"
    with pytest.raises(ConfigError, match=f"config key '{k}' = .* contains a NUL byte"):
        load_config(cfg)


def test_prompt_template_must_format_with_one_class_name():
    for bad, err in [("{}{}", "IndexError"), ("a {} {name}", "KeyError"), ("{} {", "ValueError")]:
        with pytest.raises(ConfigError, match=f"'diffusion.prompt-template' .*fails \\({err}") as e:
            make_config(diffusion__prompt_template=bad)
        assert "use exactly one '{}'" in str(e.value)
    assert make_config(diffusion__prompt_template="a {{photo}} of {}").diffusion.prompt_template


def test_absurd_sizes_and_timeouts_are_refused_and_fedavg_ignores_teacher_widths():
    with pytest.raises(ConfigError, match=r"'model.width' = 1024 is invalid: expected a value in \[1, 256\]"):
        make_config(method="fedavg", model__width=1024)
    for k in ("strategy.round-timeout", "strategy.setup-timeout"):
        cfg = default_run_config()
        cfg[k] = 1e308
        with pytest.raises(
            ConfigError, match=f"'{k}' = 1e\\+308 is invalid: expected a value in \\(0, 2592000\\]"
        ):
            load_config(cfg)
    # FedAvg has no teacher: diffusion.channels (sized for width 64 here) does not constrain it.
    assert make_config(method="fedavg", model__width=32).embedding_dim == 256
    with pytest.raises(ConfigError, match="'diffusion.channels'"):
        make_config(method="feddifrc", model__width=32)


def _fuzz_values(tmp_file: Path) -> list:
    loop = tmp_file.parent / "loop"  # `ln -s loop loop`: resolving it never ends
    loop.symlink_to(loop)
    return [
        *(True, False, 0, -1, 1, 2**63, -(2**63), 1e308, -1e308, 1e-308, 0.5),
        *(float("nan"), float("inf"), float("-inf")),
        *("", " ", "\0", "a\0b", "/dev/null", str(tmp_file), "abc", "1,2", "{}{}", "-1", "1e308", "nan"),
        *(str(loop), str(loop / "sub"), _tilde_path(loop)),
    ]


def _tilde_path(path: Path) -> str:
    """`path` spelled from `~`, for any HOME: depth, symlinks and owner vary by user."""
    real_home = Path.home().resolve()  # `~/..` climbs from where HOME really is
    return "~/" + os.path.relpath(path.parent.resolve() / path.name, real_home)


def test_fuzz_every_key_ends_in_a_config_error_naming_it_or_a_config(tmp_path):
    """Done-when of issue 20: >= 300 values over every run-config key, no traceback; a value
    that loads is within the key's documented range (ints <= MAX_INT, floats <= MAX_FLOAT,
    path keys never a file or device)."""
    from feddifrc_app.casting import MAX_FLOAT, MAX_INT
    from feddifrc_app.config_loader import keys

    tmp_file = tmp_path / "a-file"
    tmp_file.write_text("x")
    values, cases, accepted = _fuzz_values(tmp_file), 0, 0
    loops = [v for v in values if isinstance(v, str) and "loop" in v]
    for k, (typ, rule) in keys().items():
        for v in values:
            cfg = default_run_config()
            cfg[k] = v
            cases += 1
            try:
                got = load_config(cfg).to_flat()[k]
            except ConfigError as e:
                assert k in str(e), (k, v, str(e))  # names the key (or, for a cross-key rule, mentions it)
                if v in loops and (rule["path"] or k == "diffusion.model"):
                    assert f"'{k}' = {v!r} is invalid: cannot be resolved (a symlink loop)" in str(e)
                continue
            accepted += 1
            assert not (v in loops and rule["path"]), (k, v, got)  # a loop is never a path
            if typ is int:
                assert abs(got) <= max(MAX_INT, rule["range"][1] or 0), (k, v)
            elif typ is float:
                assert math.isfinite(got) and abs(got) <= max(MAX_FLOAT, rule["range"][1] or 0), (k, v)
            elif rule["path"] and got:
                assert not Path(got).exists() or Path(got).is_dir(), (k, v)
            if isinstance(got, str):
                assert "\0" not in got, (k, v)
    assert cases >= 300 and accepted < cases / 2, (cases, accepted)
    for k in ("data-dir", "cache-dir"):  # the node's own path keys
        for v in loops:
            with pytest.raises(ConfigError, match=f"'node {k}' = .* cannot be resolved \\(a symlink loop\\)"):
                load_node_config({"partition-id": 0, "num-partitions": 1, k: v})


def test_resolve_cache_dir(tmp_path):
    cfg = load_app_config(ROOT, None)
    assert resolve_cache_dir(cfg, str(tmp_path)) == tmp_path.resolve()
    assert resolve_cache_dir(cfg, None) == Path("~/.cache/feddifrc").expanduser().resolve()
    cfg2 = load_app_config(ROOT, [f'diffusion.cache-dir="{tmp_path}"'])
    assert resolve_cache_dir(cfg2, None) == tmp_path.resolve()


def test_federated_evaluation_and_its_holdout_go_together():
    cfg = make_config(fraction_evaluate=0.5, evaluate_holdout=0.1)
    assert (cfg.fraction_evaluate, cfg.evaluate_holdout) == (0.5, 0.1)
    assert (make_config().fraction_evaluate, make_config().evaluate_holdout) == (0.0, 0.0)  # the default
    with pytest.raises(
        ConfigError, match=r"'evaluate-holdout' = 0.0 is invalid: fraction-evaluate = 1 asks nodes"
    ):
        make_config(fraction_evaluate=1.0)
    with pytest.raises(ConfigError, match=r"'evaluate-holdout' = 0.2 is invalid: holds out training data"):
        make_config(evaluate_holdout=0.2)
    with pytest.raises(ConfigError, match=r"'evaluate-holdout' = 1.0 is invalid: expected a value in"):
        make_config(fraction_evaluate=1.0, evaluate_holdout=1.0)  # nothing left to train on
    with pytest.raises(ConfigError, match=r"'fraction-evaluate' = 1.0 is invalid: method 'feddifrc-ssl'"):
        make_config(method="feddifrc-ssl", fraction_evaluate=1.0, evaluate_holdout=0.1)


@pytest.mark.parametrize("delta", [0.0, 0.999999, 0.011, -1e-5, 1.5])
def test_dp_delta_outside_0_001_is_refused_naming_the_key(delta):
    with pytest.raises(ConfigError, match=r"'strategy\.dp-delta' = .* expected a value in \(0, 0.01\]"):
        make_config(strategy__dp="server-fixed", strategy__dp_delta=delta)
    with pytest.raises(ConfigError, match=r"'strategy\.dp-delta' = 'tiny' is invalid: expected a number"):
        make_config(strategy__dp_delta="tiny")


def test_dp_delta_default_and_fednova_under_dp_is_refused():
    assert make_config().strategy.dp_delta == 1e-5
    with pytest.raises(ConfigError, match=r"strategy\.dp.*fednova.*tau_eff / a_i"):
        make_config(method="fedavg", strategy__name="fednova", strategy__dp="server-fixed")
    assert make_config(method="fedavg", strategy__name="fednova").strategy.name == "fednova"  # no DP: fine
