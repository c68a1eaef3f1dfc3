"""Local training (train.py) against real teacher targets from the embedded tiny SD (CPU, offline).

One client of a tiny digits run (40 training images, 4 partitions -> 10 images), the tiny
random-weight teacher at 16 px, 1 local epoch. The teacher features are extracted once per
session into a shared tmp cache (test_client_app.py reuses them).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_config
from flwr.app import ConfigRecord, Message, RecordDict

from feddifrc_app.config import Config, load_node_config
from feddifrc_app.data.loader import clean_batch, make_loader
from feddifrc_app.data.shares import client_split
from feddifrc_app.data.transforms import eval_transform
from feddifrc_app.halves import Node
from feddifrc_app.methods import fedprox
from feddifrc_app.methods.feddifrc import targets as tg
from feddifrc_app.methods.feddifrc.node import FedDifRC
from feddifrc_app.methods.feddifrc.probe import linear_probe
from feddifrc_app.methods.feddifrc.projection import client_basis, fuse
from feddifrc_app.methods.feddifrc.rules import resolve_cache_dir, uses_diffusion
from feddifrc_app.methods.feddifrc.targets import TeacherTargets
from feddifrc_app.methods.feddifrc.teacher import featurizer, pooled_features, teacher_spec
from feddifrc_app.model import build_model
from feddifrc_app.train import train_local

CPU = torch.device("cpu")
NODE = {"partition-id": 0, "num-partitions": 4}
SSL_NEGATIVES = "cat,dog,car"


def cfg_for(teacher_cache: Path, **over) -> Config:
    base = dict(
        dataset__train_limit=40,
        diffusion__cache_dir=str(teacher_cache),
        train__device="cpu",
        diffusion__device="cpu",
        train__batch_size=5,
        diffusion__projection="random",
    )
    base.update(over)
    return make_config(**base)


@dataclasses.dataclass
class Client:
    cfg: Config
    data: object
    ids: np.ndarray
    pooled: dict[int, np.ndarray]
    prompts: tuple[str, ...]


def _client(cfg: Config) -> Client:
    node = load_node_config(NODE)
    data, ids = client_split(cfg, node)
    p = tg.plan(cfg, teacher_spec(cfg, resolve_cache_dir(cfg, node.cache_dir, "node cache-dir")), data, ids)
    pooled, _ = pooled_features(p.features, ids)
    return Client(cfg, data, ids, pooled, p.features.prompts)


@pytest.fixture(scope="module")
def sup(teacher_cache: Path) -> Client:
    """Supervised client: 10 images x (10 class prompts + the NDCR prompt)."""
    return _client(cfg_for(teacher_cache))


@pytest.fixture(scope="module")
def ssl(teacher_cache: Path) -> Client:
    """Self-supervised client: positive prompt, 3 negatives, NDCR prompt."""
    return _client(cfg_for(teacher_cache, method="feddifrc-ssl", ssl__negatives=SSL_NEGATIVES))


def targets_for(c: Client, cfg: Config | None = None) -> TeacherTargets:
    cfg = cfg or c.cfg
    p = tg.plan(cfg, teacher_spec(cfg, Path(cfg.diffusion.cache_dir)), c.data, c.ids)
    assert p.num_prompts_tdcl == (c.data.num_classes if cfg.method == "feddifrc" else len(c.prompts) - 1)
    return tg.build_targets(p, c.pooled, None)[0]


def fresh_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("resnet10", 10)


def loader_for(c: Client, cfg: Config, seed: int = 0, *, augment: bool = True, data=None):
    return make_loader(
        data or c.data, c.ids, train=True, batch_size=cfg.train.batch_size, seed=seed, augment=augment
    )


def run(c: Client, cfg: Config, *, model=None, seed: int = 0, augment: bool = True, data=None, **kw):
    """``train_local`` of ``c`` under ``cfg``: FedDifRC's node half with targets ``targets`` (built
    here when not given) for a FedDifRC method, plus ``halves``."""
    model = model if model is not None else fresh_model()
    t = kw.pop("targets", None)
    halves = list(kw.pop("halves", []))
    if uses_diffusion(cfg):
        node = Node(cfg, c.data, c.ids, CPU, seed, RecordDict())
        halves.insert(0, FedDifRC(node, targets=t if t is not None else targets_for(c, cfg)))
    loader = loader_for(c, cfg, seed, augment=augment, data=data)
    metrics, state = train_local(model, loader, cfg, CPU, halves=halves, **kw)
    return model, metrics, state


def proximal(mu: float) -> list:
    """FedProx's node half for a train message that carries ``proximal-mu = mu``."""
    msg = Message(RecordDict({"config": ConfigRecord({fedprox.MU: mu})}), dst_node_id=1, message_type="train")
    half = fedprox.node_half(msg, None)
    return [] if half is None else [half]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def state_hash(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def all_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


# --------------------------------------------------------------------------- one round


def test_fedavg_round_changes_weights_and_reports_ce_metrics(sup: Client) -> None:
    cfg = dataclasses.replace(sup.cfg, method="fedavg")
    model = fresh_model()
    before = flat(model).clone()
    _, m, state = run(sup, cfg, model=model)
    assert set(m) == {"train-ce", "train-total", "train-accuracy", "train-seconds", "local-steps"}
    assert m["local-steps"] == 2  # 10 images in batches of 5
    assert all_finite(m)
    assert m["train-total"] == m["train-ce"] > 0
    assert 0.0 <= m["train-accuracy"] <= 1.0
    assert m["train-accuracy"] * len(sup.ids) == pytest.approx(round(m["train-accuracy"] * len(sup.ids)))
    assert not torch.equal(flat(model), before)
    # momentum 0.9: one buffer per parameter, by name
    assert set(state) == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("method", ["fedavg", "feddifrc"])
def test_max_grad_norm_bounds_every_methods_step(sup: Client, method: str) -> None:
    """train.max-grad-norm (FedNH's clipping for any method): one plain SGD step moves the
    parameters by exactly lr x the clipped norm; 0 leaves the step as it was."""
    tc = dataclasses.replace(sup.cfg.train, batch_size=64, momentum=0.0, weight_decay=0.0)
    moved = {}
    for norm in (0.0, 1e-3):
        cfg = dataclasses.replace(sup.cfg, method=method, train=dataclasses.replace(tc, max_grad_norm=norm))
        model = fresh_model()
        before = flat(model).clone()
        run(sup, cfg, model=model, augment=False)
        moved[norm] = (flat(model) - before).norm().item()
    assert moved[1e-3] == pytest.approx(tc.lr * 1e-3, rel=1e-3)
    assert moved[0.0] > 100 * moved[1e-3]


def test_feddifrc_round_metrics_are_the_losses_of_the_starting_model(sup: Client) -> None:
    cfg = dataclasses.replace(sup.cfg, train=dataclasses.replace(sup.cfg.train, batch_size=64))
    t = targets_for(sup, cfg)
    model = fresh_model()
    start = copy.deepcopy(model)
    before = flat(model).clone()
    # one batch holding all 10 images, no augmentation: the metrics are the losses of `start`
    _, m, _ = run(sup, cfg, model=model, augment=False, targets=t)
    assert set(m) == {
        "train-ce",
        "train-tdcl",
        "train-ndcr",
        "train-total",
        "train-ndcr-cosine",
        "train-accuracy",
        "train-seconds",
        "local-steps",
    }
    assert all_finite(m)
    assert not torch.equal(flat(model), before)

    # recompute by hand (float64), with the batch in dataset order (BN batch statistics are
    # order-independent)
    tf = eval_transform(sup.data)
    x = torch.stack([tf(sup.data.images[i]) for i in sup.ids])
    y = torch.as_tensor(sup.data.labels[sup.ids])
    start.train()
    with torch.no_grad():
        z, logits = start(x)
    z = z.double()
    reps, h = t.take(torch.as_tensor(sup.ids))
    assert reps.shape == (10, 10, 512) and h.shape == (10, 512)
    tau = cfg.loss.temperature
    s = F.cosine_similarity(z[:, None, :], reps.double(), dim=-1) / tau  # (B, K)
    pos = s.gather(1, y[:, None]).squeeze(1)
    neg = torch.exp(s).masked_fill(F.one_hot(y, 10).bool(), 0.0).sum(1)
    tdcl = torch.log1p(neg / torch.exp(pos)).mean()
    cos_h = F.cosine_similarity(z, h.double(), dim=-1)
    ndcr = (2.0 - 2.0 * cos_h).mean()  # unit-space L2: ||u - v||^2 = 2 - 2 cos
    ce = F.cross_entropy(logits.double(), y)
    assert m["train-tdcl"] == pytest.approx(float(tdcl), rel=1e-4)
    assert m["train-ndcr"] == pytest.approx(float(ndcr), rel=1e-4)
    assert m["train-ndcr-cosine"] == pytest.approx(float(cos_h.mean()), abs=1e-5)
    assert m["train-ce"] == pytest.approx(float(ce), rel=1e-4)
    assert m["train-total"] == pytest.approx(m["train-ce"] + m["train-tdcl"] + m["train-ndcr"], rel=1e-5)
    assert m["train-accuracy"] == pytest.approx(float((logits.argmax(1) == y).double().mean()))


@pytest.mark.parametrize("view", ["clean", "augmented"])
def test_ndcr_aligns_the_view_its_target_was_computed_from(sup: Client, view: str) -> None:
    # One augmented batch of all 10 images. "clean": NDCR on the un-augmented images' embeddings,
    # computed in the same forward pass (BatchNorm over both views); CE and TDCL on the augmented.
    loss = dataclasses.replace(sup.cfg.loss, ndcr_view=view)
    cfg = sup.cfg.replace(loss=loss, train=dataclasses.replace(sup.cfg.train, batch_size=64))
    t = targets_for(sup, cfg)
    start = fresh_model()
    model = copy.deepcopy(start)
    _, m, _ = run(sup, cfg, model=model, targets=t)
    x_aug, y, idx = next(iter(loader_for(sup, cfg)))  # the same seeded batch the run saw
    tf = eval_transform(sup.data)
    clean = torch.stack([tf(sup.data.images[int(i)]) for i in idx])
    start.train()
    with torch.no_grad():
        if view == "clean":
            z_all, logits_all = start(torch.cat([x_aug, clean]))
            z, logits, z_ndcr = z_all[:10], logits_all[:10], z_all[10:]
        else:
            z, logits = start(x_aug)
            z_ndcr = z
    _, h = t.take(idx)
    cos_h = F.cosine_similarity(z_ndcr.double(), h.double(), dim=-1)
    assert not torch.equal(x_aug, clean)  # the views differ
    assert m["train-ndcr"] == pytest.approx(float((2.0 - 2.0 * cos_h).mean()), rel=1e-4)
    assert m["train-ndcr-cosine"] == pytest.approx(float(cos_h.mean()), abs=1e-5)
    assert m["train-ce"] == pytest.approx(float(F.cross_entropy(logits.double(), y)), rel=1e-4)


def test_clean_batch_is_the_eval_transform(sup: Client) -> None:
    idx = torch.as_tensor(sup.ids[[3, 0, 7]])
    tf = eval_transform(sup.data)
    want = torch.stack([tf(sup.data.images[int(i)]) for i in idx])
    assert torch.allclose(clean_batch(sup.data, idx), want, atol=1e-6)


def test_gradients_reach_the_classifier_and_never_the_teacher(sup: Client) -> None:
    t = targets_for(sup)
    teacher = featurizer(teacher_spec(sup.cfg, Path(sup.cfg.diffusion.cache_dir))).teacher
    mods = {"unet": teacher.unet, "vae": teacher.vae, "text_encoder": teacher.text_encoder}
    mods = {k: v for k, v in mods.items() if v is not None}  # text encoders: released once used
    hashes = {k: state_hash(v) for k, v in mods.items()}
    reps0, h0 = t.prompt_reps.clone(), t.ndcr.clone()

    model, m, _ = run(sup, sup.cfg, targets=t)
    assert all_finite(m)
    # every classifier parameter got a (finite) gradient in the last step, and the net a non-zero one
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert all(float(g.abs().sum()) > 0 for g in grads)
    # the teacher: frozen, untouched, never differentiated
    for name, mod in mods.items():
        assert state_hash(mod) == hashes[name], name
        for p in mod.parameters():
            assert not p.requires_grad and p.grad is None, name
    # the targets: constants
    assert not t.prompt_reps.requires_grad and t.prompt_reps.grad is None
    assert not t.ndcr.requires_grad and t.ndcr.grad is None
    assert torch.equal(t.prompt_reps, reps0) and torch.equal(t.ndcr, h0)


# --------------------------------------------------------------------------- ablations


def test_zero_tdcl_weight_reports_exactly_zero_tdcl(sup: Client) -> None:
    cfg = sup.cfg.replace(loss=dataclasses.replace(sup.cfg.loss, tdcl_weight=0.0))
    t = targets_for(sup, cfg)
    assert t.prompt_reps is None and t.ndcr is not None
    _, m, _ = run(sup, cfg, targets=t)
    assert m["train-tdcl"] == 0.0
    assert m["train-ndcr"] > 0 and all_finite(m)
    assert m["train-total"] == pytest.approx(m["train-ce"] + m["train-ndcr"], rel=1e-5)


def test_zero_ndcr_weight_reports_exactly_zero_ndcr(sup: Client) -> None:
    cfg = sup.cfg.replace(loss=dataclasses.replace(sup.cfg.loss, ndcr_weight=0.0))
    t = targets_for(sup, cfg)
    assert t.ndcr is None and t.prompt_reps is not None
    _, m, _ = run(sup, cfg, targets=t)
    assert m["train-ndcr"] == 0.0
    assert "train-ndcr-cosine" not in m
    assert m["train-tdcl"] > 0 and all_finite(m)
    assert m["train-total"] == pytest.approx(m["train-ce"] + m["train-tdcl"], rel=1e-5)


def test_code_variant_with_per_batch_projection_trains(sup: Client) -> None:
    cfg = cfg_for(Path(sup.cfg.diffusion.cache_dir), loss__variant="code", diffusion__projection="per-batch")
    t = targets_for(sup, cfg)
    assert t.per_batch is not None and t.prompt_reps is None
    reps, h = t.take(torch.as_tensor(sup.ids[:5]))
    assert reps.shape == (5, 10, 512) and h.shape == (5, 512)
    model = fresh_model()
    before = flat(model).clone()
    _, m, _ = run(sup, cfg, model=model, targets=t)
    assert all_finite(m)
    assert m["train-tdcl"] > 0
    # the public code's softmax-KL NDCR on unit vectors is at most ~4/(2*512)
    assert 0.0 <= m["train-ndcr"] < 0.01
    assert not torch.equal(flat(model), before)


# --------------------------------------------------------------------------- FedProx, momentum


def test_fedprox_term_is_reported_and_pulls_weights_to_the_start(sup: Client) -> None:
    cfg = dataclasses.replace(sup.cfg, method="fedavg")
    start = fresh_model()
    w0 = flat(start).clone()
    plain, m_plain, _ = run(sup, cfg, model=copy.deepcopy(start))
    zero, m_zero, _ = run(sup, cfg, model=copy.deepcopy(start), halves=proximal(0.0))
    prox, m_prox, _ = run(sup, cfg, model=copy.deepcopy(start), halves=proximal(50.0))
    assert "train-prox" not in m_plain and "train-prox" not in m_zero
    assert torch.equal(flat(zero), flat(plain))  # mu = 0 is plain training, bit for bit (same seed)
    # 2 steps: the term is 0 at the first (w = w_global) and > 0 after
    assert m_prox["train-prox"] > 0 and all_finite(m_prox)
    assert float((flat(prox) - w0).norm()) < float((flat(plain) - w0).norm())


def test_momentum_buffers_are_returned_and_restored(sup: Client) -> None:
    cfg = dataclasses.replace(sup.cfg, method="fedavg")
    first, _, state = run(sup, cfg)
    names = {n for n, _ in first.named_parameters()}
    assert set(state) == names
    assert all(v.device.type == "cpu" and float(v.abs().sum()) > 0 for v in state.values())
    kept = {n: v.clone() for n, v in state.items()}
    without, _, _ = run(sup, cfg, model=copy.deepcopy(first), seed=1)
    restored, _, state2 = run(sup, cfg, model=copy.deepcopy(first), seed=1, momentum_state=state)
    # (train_local is deterministic for a seed: test_fedprox_... shows bit-identical reruns)
    assert not torch.equal(flat(restored), flat(without))
    assert set(state2) == names
    assert all(torch.equal(state[n], kept[n]) for n in names)  # the given buffers are not modified
    # momentum 0: no buffers to return
    cfg0 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, momentum=0.0))
    _, _, s0 = run(sup, cfg0, model=copy.deepcopy(first), seed=1, momentum_state=state)
    assert s0 == {}


# --------------------------------------------------------------------------- self-supervised


def test_self_supervised_training_uses_no_labels(ssl: Client) -> None:
    assert ssl.prompts[0] == ssl.cfg.ssl.positive_prompt and len(ssl.prompts) == 5
    t = targets_for(ssl)
    assert t.prompt_reps.shape == (10, 4, 512)  # positive + 3 negatives
    start = fresh_model()
    a, m, _ = run(ssl, ssl.cfg, model=copy.deepcopy(start), targets=t)
    assert "train-accuracy" not in m
    assert "train-ce" not in m  # no labels, no CE
    assert all_finite(m) and m["train-tdcl"] > 0 and m["train-ndcr"] > 0
    assert m["train-total"] == pytest.approx(m["train-tdcl"] + m["train-ndcr"], rel=1e-5)
    # labels never matter: permuted labels give bit-identical weights
    rng = np.random.default_rng(0)
    shuffled = dataclasses.replace(ssl.data, labels=rng.permutation(ssl.data.labels))
    assert not np.array_equal(shuffled.labels[ssl.ids], ssl.data.labels[ssl.ids])
    b, _, _ = run(ssl, ssl.cfg, model=copy.deepcopy(start), targets=t, data=shuffled)
    assert torch.equal(flat(a), flat(b))
    # the classification head is never trained (only CE reaches it); the backbone is
    assert torch.equal(a.fc.weight, start.fc.weight) and a.fc.weight.grad is None
    assert not torch.equal(a.stem[0].weight, start.stem[0].weight)


def test_linear_probe_separates_separable_features() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 16)) * 4.0

    def draw(n):
        y = rng.integers(0, 3, size=n)
        return centres[y] + rng.normal(size=(n, 16)), y

    xtr, ytr = draw(90)
    xte, yte = draw(60)
    acc = linear_probe(xtr, ytr, xte, yte, epochs=5, seed=0)
    assert 0.0 <= acc <= 1.0
    assert acc >= 0.95  # chance is 1/3
    # pure noise features: no better than a coin would allow
    noise = linear_probe(rng.normal(size=(90, 16)), ytr, rng.normal(size=(60, 16)), yte, epochs=5, seed=0)
    assert 0.0 <= noise <= 0.7


# --------------------------------------------------------------------------- TeacherTargets


def test_teacher_targets_take_maps_rows_and_rejects_foreign_indices(sup: Client) -> None:
    t = targets_for(sup)
    # row j of the pooled features belongs to dataset index ids[j]; prompts: 10 classes, NDCR last
    assert sup.prompts[-1] == sup.cfg.diffusion.ndcr_prompt
    assert sup.prompts[:10] == tuple(
        sup.cfg.diffusion.prompt_template.format(c) for c in sup.data.class_names
    )
    assert torch.equal(t.rows[torch.as_tensor(sup.ids)], torch.arange(len(sup.ids)))
    fused = fuse(sup.pooled, client_basis(sup.cfg, sup.pooled, None))  # (10, 11, 512)
    assert np.array_equal(t.prompt_reps.numpy(), fused[:, :10]) and np.array_equal(
        t.ndcr.numpy(), fused[:, 10]
    )
    pick = torch.as_tensor(sup.ids[[3, 0, 3]])
    reps, h = t.take(pick)
    assert torch.equal(reps, t.prompt_reps[[3, 0, 3]]) and torch.equal(h, t.ndcr[[3, 0, 3]])
    foreign = int(np.setdiff1d(np.arange(sup.ids.max()), sup.ids)[0])  # in range, other client's image
    with pytest.raises(KeyError):
        t.take(torch.as_tensor([int(sup.ids[0]), foreign]))
    with pytest.raises(KeyError):
        t.take(torch.as_tensor([int(sup.ids.max()) + 1]))


def test_teacher_targets_on_a_device_check_ids_once_and_gather_without_a_host_read(sup: Client) -> None:
    t = targets_for(sup)
    foreign = int(np.setdiff1d(np.arange(sup.ids.max()), sup.ids)[0])
    with pytest.raises(KeyError):
        t.on(torch.device("meta"), np.append(sup.ids, foreign))
    # meta tensors hold no values: any host read of device data (bool(), .item(), .cpu()) in take
    # would raise here, so the gather is proven free of per-step syncs; indices move with the targets.
    m = t.on(torch.device("meta"), sup.ids)
    assert m.rows.device.type == m.prompt_reps.device.type == m.ndcr.device.type == "meta"
    reps, h = m.take(torch.as_tensor(sup.ids[[3, 0, 3]]))
    assert reps.device.type == h.device.type == "meta"
    assert reps.shape == (3, *t.prompt_reps.shape[1:]) and h.shape == (3, t.ndcr.shape[1])
    # on the CPU nothing moves and the values are those of take
    c = t.on(CPU, sup.ids)
    assert c.rows is t.rows and torch.equal(c.take(torch.as_tensor(sup.ids[:2]))[1], t.ndcr[:2])


def test_loader_pins_memory_only_when_asked(sup: Client) -> None:
    kw = dict(train=True, batch_size=4, seed=0)
    assert make_loader(sup.data, sup.ids, **kw).pin_memory is False
    assert make_loader(sup.data, sup.ids, **kw, pin_memory=True).pin_memory is True


def test_diverging_training_raises_and_returns_nothing(teacher_cache: Path) -> None:
    from feddifrc_app.train import DivergedError

    cfg = cfg_for(teacher_cache, method="fedavg", train__lr=1e6, train__local_epochs=10)
    data, ids = client_split(cfg, load_node_config(NODE))
    loader = make_loader(data, ids, train=True, batch_size=5, seed=0)
    with pytest.raises(
        DivergedError, match=r"^diverged: the training loss became non-finite; lower train.lr \(= 1e\+06\)"
    ):
        train_local(fresh_model(), loader, cfg, CPU)
