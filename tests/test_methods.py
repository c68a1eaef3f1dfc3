"""SCAFFOLD, FedNova, MOON and FedNH updates against values computed by hand."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import make_config
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from feddifrc_app import methods
from feddifrc_app.federation import NUM_NODES
from feddifrc_app.halves import Node
from feddifrc_app.methods import fednova, scaffold
from feddifrc_app.methods.fednh import node as fednh_node
from feddifrc_app.methods.fednh import server as fednh_server
from feddifrc_app.methods.fednh.head import PrototypeHead
from feddifrc_app.methods.scaffold import node as scaffold_node
from feddifrc_app.strategy import build_strategy


def reply(arrays: dict[str, list[float]], **metrics: float) -> Message:
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: torch.tensor(v) for k, v in arrays.items()}),
            "metrics": MetricRecord({k.replace("_", "-"): float(v) for k, v in metrics.items()}),
        }
    )
    return Message(content=content, dst_node_id=1, message_type="train")


class Nodes:
    def get_node_ids(self):
        return [1, 2]


# ----------------------------------------------------------------------------- SCAFFOLD


def test_scaffold_client_correction_and_option_ii_update():
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[1.0, 1.0]])
    c, c_i = {"weight": torch.tensor([[0.1, 0.0]])}, {"weight": torch.tensor([[0.05, 0.2]])}
    scaffold_node.correct_gradients(model, scaffold_node.correction(c, c_i, torch.device("cpu")))
    torch.testing.assert_close(model.weight.grad, torch.tensor([[1.05, 0.8]]))  # grad + c - c_i

    x, y = {"weight": torch.tensor([[1.0, 2.0]])}, {"weight": torch.tensor([[0.8, 2.1]])}
    new, delta = scaffold_node.control_update(x, y, c, c_i, steps=2, lr=0.1)
    # c_i+ = c_i - c + (x - y) / (K lr) = [0.05 - 0.1 + 1.0, 0.2 - 0 - 0.5]
    torch.testing.assert_close(new["weight"], torch.tensor([[0.95, -0.3]]))
    torch.testing.assert_close(delta["weight"], torch.tensor([[0.9, -0.5]]))


@pytest.mark.parametrize(("eta_g", "want"), [(1.0, [1.5, 2.5]), (0.5, [1.25, 1.75])])
def test_scaffold_server_update(eta_g, want):
    s = build_strategy(
        make_config(strategy__name="scaffold", strategy__server_learning_rate=eta_g, fraction_train=0.5)
    )
    four = ConfigRecord({NUM_NODES: 4})  # the federation's distinct nodes (round_config): |S| / N = 2 / 4
    msgs = list(s.configure_train(1, ArrayRecord({"w": torch.tensor([1.0, 1.0])}), four, Nodes()))
    assert len(msgs[0].content[scaffold.CONTROL]) == 0  # c = 0 before any update
    r1, r2 = reply({"w": [0.0, 1.0]}, num_examples=1), reply({"w": [2.0, 3.0]}, num_examples=3)
    r1.content[scaffold.DELTA] = ArrayRecord({"w": torch.tensor([0.4, 0.0])})
    r2.content[scaffold.DELTA] = ArrayRecord({"w": torch.tensor([0.0, 0.8])})
    arrays, _ = s.aggregate_train(1, [r1, r2])
    # x + eta_g * (1/4 (y1 - x) + 3/4 (y2 - x)); c += |S|/N * mean(delta c) = 0.5 * [0.2, 0.4]
    np.testing.assert_allclose(arrays["w"].numpy(), want)
    np.testing.assert_allclose(s.control["w"], [0.1, 0.2])
    nxt = list(s.configure_train(2, arrays, four, Nodes()))
    np.testing.assert_allclose(nxt[0].content[scaffold.CONTROL]["w"].numpy(), [0.1, 0.2])


def _scaffold_node_trains(s, rnd: int, state: RecordDict, step: float) -> Message:
    """Node 7 of a one-node federation: receives round ``rnd``'s message, moves its 1-weight
    model (x = 1) by ``step`` in one plain SGD step of lr 0.5, and replies."""
    msg = next(
        iter(s.configure_train(rnd, ArrayRecord({"weight": torch.ones(1, 1)}), ConfigRecord({}), One()))
    )
    node = Node(make_config(train__momentum=0.0, train__lr=0.5), None, None, torch.device("cpu"), 0, state)
    half = scaffold.node_half(msg, node)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    half.start(model)
    with torch.no_grad():
        model.weight += step
    extra = half.finish(model, {"local-steps": 1.0})
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": 1.0})}
    )
    content[scaffold.DELTA] = extra[scaffold.DELTA]
    return Message(content, reply_to=msg)


class One:
    def get_node_ids(self):
        return [7]


def test_scaffold_c_and_c_i_agree_after_a_rejected_round():
    """c = (1/N) sum_i c_i, with one node: c == c_7 after every round, accepted or not."""
    from feddifrc_app.strategy import load_strategy_state, strategy_state

    s = build_strategy(make_config(strategy__name="scaffold"))
    state = RecordDict()
    # Round 1, accepted: c_7+ = 0 - 0 + (x - y) / (K lr) = -0.2 / 0.5 = -0.4; c = 0 + 1/1 * -0.4.
    s.aggregate_train(1, [_scaffold_node_trains(s, 1, state, step=0.2)])
    np.testing.assert_allclose(s.control["weight"], [[-0.4]], rtol=1e-6)
    # Round 2, rejected (what rounds.RoundLoop does with a non-finite aggregate): c is restored.
    before = strategy_state(s)
    s.aggregate_train(2, [_scaffold_node_trains(s, 2, state, step=1.0)])
    assert float(s.control["weight"][0, 0]) != pytest.approx(-0.4)
    load_strategy_state(s, before)
    np.testing.assert_allclose(s.control["weight"], [[-0.4]], rtol=1e-6)
    # Round 3: the node learns that round 2 did not count, and trains from c_7 = -0.4, not round 2's.
    msg3 = next(
        iter(s.configure_train(3, ArrayRecord({"weight": torch.ones(1, 1)}), ConfigRecord({}), One()))
    )
    assert msg3.content["config"][scaffold.ACCEPTED] == 1
    c_i = scaffold_node.confirmed_control(state, 1)
    np.testing.assert_allclose(c_i["weight"].numpy(), s.control["weight"], rtol=1e-6)  # c_7 == c
    assert scaffold.PENDING not in state
    # An accepted round 3 then moves both alike: c_7+ = c_7 - c + (x - y) / (K lr) = -0.1 / 0.5.
    s.aggregate_train(3, [_scaffold_node_trains(s, 3, state, step=0.1)])
    msg4 = next(
        iter(s.configure_train(4, ArrayRecord({"weight": torch.ones(1, 1)}), ConfigRecord({}), One()))
    )
    c_i = scaffold_node.confirmed_control(state, int(msg4.content["config"][scaffold.ACCEPTED]))
    np.testing.assert_allclose(s.control["weight"], [[-0.2]], rtol=1e-6)
    np.testing.assert_allclose(c_i["weight"].numpy(), [[-0.2]], rtol=1e-6)


def test_scaffold_node_drops_a_c_i_whose_reply_never_counted():
    state = RecordDict({scaffold.OWN: ArrayRecord({"w": torch.tensor([1.0])})})
    state[scaffold.PENDING] = ArrayRecord({"w": torch.tensor([5.0])})
    state[scaffold.PENDING_ROUND] = ConfigRecord({"round": 4})
    assert scaffold_node.confirmed_control(state, 3)["w"].tolist() == [1.0]  # round 4's reply was lost
    assert scaffold.PENDING not in state and scaffold.PENDING_ROUND not in state
    state[scaffold.PENDING] = ArrayRecord({"w": torch.tensor([5.0])})
    state[scaffold.PENDING_ROUND] = ConfigRecord({"round": 6})
    assert scaffold_node.confirmed_control(state, 6)["w"].tolist() == [5.0]  # round 6's was added to c
    assert state[scaffold.OWN]["w"].numpy().tolist() == [5.0]


# ----------------------------------------------------------------------------- FedNova


def test_fednova_normalising_factor():
    assert fednova.normalising_factor(3, 0.0) == 3.0
    # (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho) with tau = 3, rho = 0.9
    assert fednova.normalising_factor(3, 0.9) == pytest.approx((3 - 0.9 * (1 - 0.729) / 0.1) / 0.1)


def test_fednova_server_update_normalises_by_local_steps():
    s = build_strategy(make_config(strategy__name="fednova"))
    x = {"w": torch.tensor([1.0]), "bn.running_mean": torch.tensor([0.0])}
    list(s.configure_train(1, ArrayRecord(x), ConfigRecord({}), Nodes()))
    r1 = reply({"w": [0.0], "bn.running_mean": [2.0]}, num_examples=1, **{"fednova_a": 2.0})
    r2 = reply({"w": [0.0], "bn.running_mean": [4.0]}, num_examples=1, **{"fednova_a": 1.0})
    arrays, _ = s.aggregate_train(1, [r1, r2])
    # d = (x - y) / a = [0.5, 1.0]; tau_eff = 1.5; x - tau_eff * mean(d) = 1 - 1.5 * 0.75 (FedAvg: 0.0)
    np.testing.assert_allclose(arrays["w"].numpy(), [-0.125])
    np.testing.assert_allclose(arrays["bn.running_mean"].numpy(), [3.0])  # statistics: plain average


# ----------------------------------------------------------------------------- MOON


def test_moon_contrastive_loss_by_hand():
    from feddifrc_app.methods.moon import moon_contrastive

    z, z_glob, z_prev = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    # cos = 1 (global), 0 (previous); tau = 0.5 -> logits [2, 0]; -log(e^2 / (e^2 + 1)) = log(1 + e^-2)
    assert moon_contrastive(z, z_glob, z_prev, 0.5).item() == pytest.approx(np.log1p(np.exp(-2.0)))
    # Closer to the previous model than to the global one costs more.
    assert moon_contrastive(z, z_prev, z_glob, 0.5).item() == pytest.approx(np.log1p(np.exp(2.0)))


def test_moon_term_is_mu_times_the_loss_of_frozen_reference_models():
    from feddifrc_app.methods import moon
    from feddifrc_app.methods.moon import moon_contrastive
    from feddifrc_app.model import build_model

    torch.manual_seed(0)
    g, prev, local = (build_model("resnet10", 3, width=2) for _ in range(3))
    x = torch.randn(4, 3, 8, 8)
    term = moon.regulariser(g, prev, mu=5.0, tau=0.5, device=torch.device("cpu"))
    local.eval()
    z = local(x)[0]
    want = 5.0 * moon_contrastive(z, g(x)[0], prev(x)[0], 0.5)
    torch.testing.assert_close(term(x, z), want)
    assert not any(p.requires_grad for p in g.parameters())  # the references never train


@pytest.mark.parametrize("key", ["loss.temperature", "moon.tau"])
def test_a_temperature_too_small_to_train_with_is_refused_at_load_naming_it(key):
    from feddifrc_app.casting import ConfigError

    section, name = key.split(".")
    with pytest.raises(
        ConfigError, match=rf"^config key '{key}' = 1e-300 is invalid: expected a value in \[0.001,"
    ):
        make_config(**{f"{section}__{name}": 1e-300})
    assert getattr(getattr(make_config(**{f"{section}__{name}": 1e-3}), section), name) == 1e-3


class _Batches(list):
    """A loader of ready batches (x, y, idx), un-augmented."""

    dataset = type("D", (), {"transform": type("T", (), {"random": False})()})()


def test_a_diverging_contrastive_term_names_its_temperature_besides_train_lr():
    """A node's NaN loss names the keys that can cause it: train.lr, the loss weights, and the
    temperature of the half's contrastive term (MOON's moon.tau, FedDifRC's loss.temperature)."""
    from feddifrc_app.halves import Node
    from feddifrc_app.methods import moon
    from feddifrc_app.methods.feddifrc.node import FedDifRC
    from feddifrc_app.model import build_model
    from feddifrc_app.train import DivergedError, train_local

    cfg = make_config(method="moon")
    half = moon.Moon(mu=1.0, tau=0.002, node=Node(cfg, None, None, None, 0, RecordDict()))
    half.reg = lambda x, z: (z * float("nan")).sum()  # what a tiny tau does to the logits
    torch.manual_seed(0)
    batches = _Batches([(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]), torch.arange(4))])
    with pytest.raises(DivergedError) as e:
        train_local(build_model("resnet10", 3, width=2), batches, cfg, torch.device("cpu"), halves=[half])
    assert str(e.value) == (
        "diverged: the model weights became non-finite; lower train.lr (= 0.05) or the loss weights, "
        "or raise moon.tau (= 0.002)"
    )
    node = Node(make_config(loss__temperature=0.004), None, None, None, 0)
    assert FedDifRC(node).divergence_remedy() == "raise loss.temperature (= 0.004)"


# ----------------------------------------------------------------------------- FedNH


def test_fednh_head_is_a_scaled_cosine_over_frozen_orthogonal_prototypes():
    from feddifrc_app.model import build_model

    model = build_model("resnet10", 4, width=2, head=functools.partial(PrototypeHead, scale=3.0))
    p = model.fc.prototype
    assert not p.requires_grad and p.shape == (4, 16)
    torch.testing.assert_close(p @ p.T, torch.eye(4), atol=1e-5, rtol=0)  # orthonormal rows
    z = torch.randn(2, 16)
    want = 3.0 * torch.nn.functional.normalize(z, dim=1) @ p.T
    torch.testing.assert_close(model.fc(z), want)


class _Identity(torch.nn.Module):
    embedding_dim = 2

    def embed(self, x):
        return x


def test_fednh_client_upload_by_hand():
    batches = [(torch.tensor([[3.0, 4.0], [0.0, 2.0], [1.0, 0.0]]), torch.tensor([0, 0, 1]), torch.arange(3))]
    scaled, counts = fednh_node.class_prototypes(_Identity(), batches, 3, torch.device("cpu"))
    # class 0: mean of [0.6, 0.8] and [0, 1] = [0.3, 0.9] -> normalised, times n = 2
    np.testing.assert_allclose(scaled[0], 2 * np.array([0.3, 0.9]) / np.hypot(0.3, 0.9), rtol=1e-6)
    np.testing.assert_allclose(scaled[1], [1.0, 0.0])
    np.testing.assert_allclose(scaled[2], [0.0, 0.0])
    np.testing.assert_array_equal(counts, [2, 1, 0])


def test_fednh_server_smoothing_by_hand():
    old = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    scaled = [np.array([[0.0, 2.0], [0.0, 0.0]]), np.zeros((2, 2))]
    counts = [np.array([2.0, 0.0]), np.array([0.0, 0.0])]
    new = fednh_server.smooth(old, scaled, counts, rho=0.9)
    # class 0: avg = [0, 1]; 0.9 [1, 0] + 0.1 [0, 1] normalised; class 1: held by no node, kept
    np.testing.assert_allclose(new[0], np.array([0.9, 0.1]) / np.hypot(0.9, 0.1), rtol=1e-6)
    np.testing.assert_allclose(new[1], [0.0, 1.0])


def test_fednh_defaults_follow_fednh_code_for_a_resnet_head():
    """Yutong-Dai/FedNH: ResNetModNH starts ``scaling`` at 20 (its small CNN at 1) and every local
    step runs ``clip_grad_norm_(trainable parameters, max_norm=10)``."""
    from feddifrc_app.methods import model_for

    cfg = make_config(method="fednh", strategy__name="fedavg")
    assert (cfg.fednh.scale, cfg.fednh.max_grad_norm) == (20.0, 10.0)
    assert model_for(cfg, 10).fc.scaling.item() == 20.0


def test_fednh_node_clips_the_gradient_norm_of_trainable_parameters_only():
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    model.weight.grad = torch.full((2, 2), 30.0)  # norm 60
    model.bias.grad = torch.full((2,), 7.0)  # frozen (as the prototypes are): untouched
    node = Node(make_config(method="fednh"), None, None, torch.device("cpu"), 0, RecordDict())
    fednh_node.Prototypes(node).before_step(model)
    assert model.weight.grad.norm().item() == pytest.approx(10.0, rel=1e-5)
    torch.testing.assert_close(model.bias.grad, torch.full((2,), 7.0))
    model.weight.grad = torch.full((2, 2), 1.0)  # norm 2 < 10: unchanged
    fednh_node.Prototypes(node).before_step(model)
    torch.testing.assert_close(model.weight.grad, torch.full((2, 2), 1.0))


# ----------------------------------------------------------------------------- a new method

NEW_METHOD = '''
"""A method that exists only in this file: a weighted mean-square embedding term."""
from dataclasses import dataclass

from flwr.app import ConfigRecord

from feddifrc_app.config import key
from feddifrc_app.halves import NodeHalf

KEY = "demo-weight"
NAMES = ("demo",)


@dataclass(frozen=True)
class DemoConfig:
    weight: float = key(lo=0.0)


SECTIONS = {"demo": DemoConfig}


def train_config(cfg):
    return {KEY: cfg.demo.weight} if cfg.method == "demo" else {}


class Demo(NodeHalf):
    name = "demo"

    def __init__(self, w):
        self.w = w

    def term(self, model, batch):
        return self.w * batch.z.pow(2).mean()

    def finish(self, model, metrics):
        metrics["demo-finished"] = 1.0
        return {"demo-record": ConfigRecord({"seen": True})}


def node_half(msg, node):
    w = msg.content["config"].get(KEY)
    return None if w is None else Demo(float(w))
'''


def _train_on_node(run_config: dict, config: dict) -> Message:
    """One round-1 train message with ``config`` through the real ClientApp of partition 0 of 4."""
    from flwr.app import Context

    from feddifrc_app import client_app
    from feddifrc_app.model import build_model
    from feddifrc_app.records import state_to_record

    content = RecordDict(
        {
            "arrays": state_to_record(build_model("resnet10", 10).state_dict()),
            "config": ConfigRecord({"server-round": 1, **config}),
        }
    )
    ctx = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 4},
        state=RecordDict(),
        run_config=run_config,
    )
    return client_app.app(Message(content=content, message_type="train", dst_node_id=1), ctx)


def test_a_new_method_is_picked_up_from_its_module_alone(tmp_path, monkeypatch):
    """docs/architecture.md, "Add a method": its module in methods/ is all the server and the
    ClientApp need, its config section included (its keys join the run's, its name the method's
    choices); nothing names it."""
    import sys

    from conftest import default_run_config

    from feddifrc_app import config_loader, methods
    from feddifrc_app.casting import ConfigError

    (tmp_path / "demo.py").write_text(NEW_METHOD)
    monkeypatch.setattr(methods, "__path__", [*methods.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "feddifrc_app.methods.demo", raising=False)
    methods.modules.cache_clear()
    config_loader.keys.cache_clear()
    try:
        rc = {**default_run_config(dataset__train_limit=40, train__device="cpu"), "demo.weight": 0.5}
        rc["method"] = "demo"
        cfg = config_loader.load_config(rc)
        assert cfg.demo.weight == 0.5 and cfg.to_flat()["demo.weight"] == 0.5
        assert "demo" in config_loader.keys()["method"][1]["choices"]
        with pytest.raises(ConfigError, match="'demo.weight' = -1"):
            config_loader.load_config({**rc, "demo.weight": -1})
        with pytest.raises(ConfigError, match="missing config key.*'demo.weight'"):
            config_loader.load_config({k: v for k, v in rc.items() if k != "demo.weight"})
        sent = methods.train_config(cfg)  # the server half
        assert sent == {"demo-weight": 0.5}
        reply = _train_on_node(rc, sent)
        assert not reply.has_error(), reply.error.reason
        m = reply.content["metrics"]
        assert m["train-demo"] > 0 and m["demo-finished"] == 1.0  # its term and its reply metric
        assert reply.content["demo-record"]["seen"] is True  # its own record in the reply
    finally:
        methods.modules.cache_clear()
        config_loader.keys.cache_clear()
        sys.modules.pop("feddifrc_app.methods.demo", None)


# ----------------------------------------------------------------------------- the orchestrators

ORCHESTRATORS = ("client_app.py", "server_app.py", "train.py", "rounds.py")
# Config sections and flags only a method reads (the orchestrators read cfg.train, cfg.strategy, ...).
METHOD_CONFIG = {"uses_diffusion", "self_supervised", "diffusion", "loss", "ssl", "moon", "fednh"}
# What names a method in code: its module, its config words, its records and loss parts.
METHOD_WORDS = {"feddifrc", "ssl", "tdcl", "ndcr", "teacher", "basis", "diffusion", "prox", "probe"}


def _code_names(tree) -> list[tuple[int, str]]:
    """(line, text) of every identifier, import path and string constant that is not a docstring."""
    import ast

    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    out = []
    for n in ast.walk(tree):
        texts = {
            ast.Name: lambda n: [n.id],
            ast.Attribute: lambda n: [n.attr],
            ast.arg: lambda n: [n.arg],
            ast.FunctionDef: lambda n: [n.name],
            ast.ClassDef: lambda n: [n.name],
            ast.alias: lambda n: [n.name, n.asname or ""],
            ast.ImportFrom: lambda n: [n.module or ""],
        }.get(type(n), lambda n: [])(n)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            texts = [n.value]
        out += [(getattr(n, "lineno", 0), t) for t in texts if t]
    return out


def test_the_orchestrators_name_no_method_and_read_no_method_flag():
    """client_app, server_app, train and rounds run whatever the methods' halves say: none of them
    names a method (its module, variant, records or loss parts) or reads a method's config."""
    import ast
    import re
    from pathlib import Path

    from feddifrc_app import config_loader

    root = Path(methods.__file__).resolve().parents[1]
    words = METHOD_WORDS | {m.__name__.rsplit(".", 1)[1] for m in methods.modules()}
    words |= {
        w
        for name in config_loader.keys()["method"][1]["choices"]
        if name != "fedavg"
        for w in name.split("-")
    }
    found = []
    for name in ORCHESTRATORS:
        tree = ast.parse((root / name).read_text())
        for line, text in _code_names(tree):
            parts = set(re.split(r"[^a-z0-9]+", text.lower().replace("feddifrc_app", "")))
            if bad := parts & words:
                found.append(f"{name}:{line}: {text!r} ({', '.join(sorted(bad))})")
        for n in ast.walk(tree):  # cfg.<method section> / self.cfg.<method flag>
            if isinstance(n, ast.Attribute) and n.attr in METHOD_CONFIG:
                base = n.value
                if (isinstance(base, ast.Name) and base.id == "cfg") or (
                    isinstance(base, ast.Attribute) and base.attr == "cfg"
                ):
                    found.append(f"{name}:{n.lineno}: cfg.{n.attr}")
    assert not found, "\n".join(found)
    # The check can fail: the ClientApp before FedDifRC became a method read both.
    before = (
        "targets = _targets(...) if cfg.uses_diffusion else None\nfrom feddifrc_app.methods.feddifrc import x"
    )
    assert [t for _, t in _code_names(ast.parse(before)) if "uses_diffusion" in t or "feddifrc." in t]


# ----------------------------------------------------------------------------- a method removed


@pytest.mark.parametrize("removed", ["moon", "fedprox", "scaffold", "fednova", "fednh"])
def test_removing_a_method_module_leaves_the_others_working(removed, tmp_path, monkeypatch):
    """The package without ``methods/<removed>.py`` (or the package ``methods/<removed>/``):
    discovery no longer finds it, the server still builds every other strategy (SCAFFOLD's and
    FedNova's come from their packages' ``strategies``), and a node still trains under the other
    client-side method (MOON's term, FedProx's term), from the message alone."""
    import importlib
    import shutil
    import sys
    from pathlib import Path

    from conftest import default_run_config

    from feddifrc_app import config_loader
    from feddifrc_app.config_loader import load_config

    # Removing a method removes its pyproject defaults too: the loader refuses keys no module declares.
    gone = tuple(
        f"{s}." for s in getattr(importlib.import_module(f"{methods.__name__}.{removed}"), "SECTIONS", {})
    )

    def run_config(**overrides: object) -> dict:
        return {k: v for k, v in default_run_config(**overrides).items() if not k.startswith(gone)}

    copy = tmp_path / "methods"
    shutil.copytree(Path(methods.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    module, package = copy / f"{removed}.py", copy / removed
    if package.is_dir():
        shutil.rmtree(package)
    else:
        module.unlink()
    monkeypatch.setattr(methods, "__path__", [str(copy)])
    for name in [n for n in sys.modules if n.startswith("feddifrc_app.methods.")]:
        monkeypatch.delitem(sys.modules, name)
    methods.modules.cache_clear()
    config_loader.keys.cache_clear()  # the keys of the package as it is now
    try:
        names = [m.__name__.rsplit(".", 1)[1] for m in methods.modules()]
        assert removed not in names and {"feddifrc", "moon", "fedprox"} - {removed} <= set(names)
        from feddifrc_app.config import STRATEGIES
        from feddifrc_app.config_loader import strategy_names
        from feddifrc_app.strategy import build_strategy, factories

        brought = {"scaffold", "fednova"}
        assert set(factories()) == set(strategy_names())  # the removed module's strategy goes with it
        assert set(strategy_names()) == (set(STRATEGIES) | brought) - ({removed} & brought)
        for name in sorted(set(factories()) - {"krum", "multikrum", "bulyan"}):
            assert build_strategy(load_config(run_config(method="fedavg", strategy__name=name))) is not None
        method = "fedavg" if removed == "moon" else "moon"
        rc = run_config(method=method, dataset__train_limit=40, train__device="cpu", train__batch_size=5)
        sent = methods.train_config(load_config(run_config(method=method)))  # the server half
        reply = _train_on_node(rc, {"proximal-mu": 1.0, **sent})
        assert not reply.has_error(), reply.error.reason
        m = reply.content["metrics"]
        kept = "prox" if removed == "moon" else "moon"
        assert f"train-{kept}" in m and f"train-{removed}" not in m and m["train-ce"] > 0
    finally:
        methods.modules.cache_clear()
        config_loader.keys.cache_clear()
