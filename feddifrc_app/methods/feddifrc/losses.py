"""FedDifRC local losses: CE + TDCL + NDCR, as pure functions.

Inputs are cast to float32 inside and teacher tensors (diffusion representations, NDCR
targets) detached, so gradients only reach the client embeddings. Shapes: ``B`` batch,
``D`` embedding width, ``K`` class prompts (or SSL prompts).

Two variants: ``"paper"``, the paper's per-sample TDCL and L2 NDCR; ``"code"``, what the
public code (``hwang52/FedDifRC``, ``main_FedDifRC.py``) computes, for comparison only: one
batch-level InfoNCE ratio whose negatives meet other samples' embeddings, and a softmax KL.
docs/method-notes.md relates both to the paper and the code line by line.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from feddifrc_app.methods.feddifrc.rules import LOSS_VARIANTS, NDCR_SPACES, NORMALISERS

# Guards against a zero-norm vector in cosine / unit-vector normalisation.
_EPS = 1e-8


# --------------------------------------------------------------------------- helpers


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choices: {', '.join(choices)}")


def _check_pair(z: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """float32 ``z`` and detached float32 ``target``, both (B, D)."""
    z, target = z.float(), target.detach().float()
    if z.shape != target.shape or z.dim() != 2:
        raise ValueError(f"z and target must both be (B, D), got {tuple(z.shape)} and {tuple(target.shape)}")
    return z, target


def _prepare(z: Tensor, reps: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """Checked float32 ``z`` (B, D), detached float32 ``reps`` (B, K, D), int64 ``labels`` (B,)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    z, reps, labels = z.float(), reps.detach().float(), labels.long()
    if z.dim() != 2:
        raise ValueError(f"z must be (B, D), got shape {tuple(z.shape)}")
    if reps.dim() != 3 or reps.shape[0] != z.shape[0] or reps.shape[2] != z.shape[1]:
        raise ValueError(
            f"reps must be (B, K, D) = ({z.shape[0]}, K, {z.shape[1]}), got shape {tuple(reps.shape)}"
        )
    if labels.shape != (z.shape[0],):
        raise ValueError(f"labels must be ({z.shape[0]},), got shape {tuple(labels.shape)}")
    # Checked on the CPU only: on an accelerator it would cost two host syncs per step, and an
    # out-of-range label fails there in the gather's own device-side check anyway.
    if labels.device.type == "cpu" and labels.numel() and (labels.min() < 0 or labels.max() >= reps.shape[1]):
        raise ValueError(f"labels must lie in [0, {reps.shape[1]}), got {labels.tolist()}")
    return z, reps, labels


def _unit(x: Tensor) -> Tensor:
    """x / ||x|| along the last dim, safe for a zero vector."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


@torch.no_grad()
def _mean_distance(z: Tensor, reps: Tensor) -> Tensor:
    """The paper's U, our reading: (B, D) x (B, K, D) -> (B, K), detached.

    ``U_ik = (1/B) sum_b || z_b/||z_b|| - F_ik/||F_ik|| ||``, in [0, 2] and scale-free like the
    cosine it divides; a stop-gradient scale. Computed as sqrt(2 - 2 cos) from a (B, B, K) table.
    """
    cos = torch.einsum("bd,ikd->bik", _unit(z), _unit(reps))  # (B_b, B_i, K)
    return (2.0 - 2.0 * cos).clamp_min(0.0).sqrt().mean(dim=0).clamp_min(_EPS)  # (B_i, K)


def _negative_mask(
    labels: Tensor,
    num_classes: int,
    num_negatives: int,
    generator: torch.Generator | None,
    device: torch.device,
) -> Tensor:
    """(B, K) bool, True where class k is a negative of sample i.

    ``num_negatives`` 0 (or >= K-1): every class but the label; else that many per sample, drawn
    without replacement (the smallest of ``torch.rand(B, K, generator=generator)``, label excluded).
    """
    b = labels.shape[0]
    others = torch.ones(b, num_classes, dtype=torch.bool, device=device)
    others[torch.arange(b, device=device), labels] = False
    if num_negatives <= 0 or num_negatives >= num_classes - 1:
        return others
    gen_device = generator.device if generator is not None else torch.device("cpu")
    scores = torch.rand(b, num_classes, generator=generator, device=gen_device).to(device)
    picked = scores.masked_fill(~others, float("inf")).topk(num_negatives, dim=1, largest=False).indices
    return torch.zeros_like(others).scatter_(1, picked, True)


# --------------------------------------------------------------------------- paper


def tdcl_paper(
    z: Tensor,
    reps: Tensor,
    labels: Tensor,
    *,
    temperature: float,
    num_negatives: int = 0,
    generator: torch.Generator | None = None,
    normaliser: str = "none",
) -> Tensor:
    """Paper TDCL, a 0-dim float32 tensor.

    z (B, D): client embeddings; reps (B, K, D): diffusion reps of image i under each class
    prompt (detached inside); labels (B,) in [0, K): the positive is ``reps[i, labels[i]]``.
    ``L_i = log(1 + sum_{j in N_i} exp(s_ij/tau) / exp(s_iy/tau))``, mean over i, computed as
    ``softplus(logsumexp_j(s_ij/tau) - s_iy/tau)`` (exact near the minimum); K = 1 gives 0.
    N_i: the other classes, or ``num_negatives`` sampled per sample with ``generator``.
    s: cosine (``normaliser="none"``) or cosine / U (``"mean-distance"``, our reading of U).
    """
    z, reps, labels = _prepare(z, reps, labels, temperature)
    b, k, _ = reps.shape
    if b == 0:
        return z.sum() * 0.0
    _check_choice("TDCL normaliser", normaliser, NORMALISERS)
    logits = torch.einsum("bd,bkd->bk", _unit(z), _unit(reps))  # cosine (B, K)
    if normaliser == "mean-distance":
        logits = logits / _mean_distance(z, reps)
    logits = logits / temperature
    if k == 1:  # no negatives: log(1 + 0) = 0 (and no -inf logsumexp, whose gradient is NaN)
        return logits.sum() * 0.0
    neg = _negative_mask(labels, k, num_negatives, generator, z.device)  # >= 1 per row
    pos = logits.gather(1, labels[:, None]).squeeze(1)
    return F.softplus(torch.logsumexp(logits.masked_fill(~neg, float("-inf")), dim=1) - pos).mean()


def ndcr_paper(z: Tensor, target: Tensor, *, space: str) -> Tensor:
    """Paper NDCR ``mean_i sum_q (z_iq - H_iq)^2``: z, target (B, D) -> 0-dim; target detached.

    ``space="raw"``: on the vectors as they are; ``"unit"``: both L2-normalised first (2 - 2 cos),
    scale-free like TDCL's cosine, whereas raw PCA coordinates make the effective weight depend
    on the teacher's scale (which the paper does not state).
    """
    _check_choice("NDCR space", space, NDCR_SPACES)
    z, target = _check_pair(z, target)
    if space == "unit":
        z, target = F.normalize(z, dim=1), F.normalize(target, dim=1)
    return (z - target).pow(2).sum(dim=1).mean()


# --------------------------------------------------------------------------- public code


def tdcl_code(z: Tensor, reps: Tensor, labels: Tensor, *, temperature: float) -> Tensor:
    """The public code's TDCL (``main_FedDifRC.py``): z (B, D), reps (B, K, D), labels (B,) -> 0-dim.

    Positives ``reps[i, y_i]`` then every sample's K-1 negatives (ascending class order, our
    assumption: the code's order is not public), sample-major, against the embeddings TILED
    ``z.repeat(K, 1)``, so negative row r meets ``z[r % B]``, in general another sample's.
    ONE batch-level ratio ``-log(sum_pos exp(l) / sum_all exp(l))``, ``l = cos / tau``.
    """
    z, reps, labels = _prepare(z, reps, labels, temperature)
    b, k, d = reps.shape
    if b == 0:
        return z.sum() * 0.0
    rows = torch.arange(b, device=z.device)
    others = torch.ones(b, k, dtype=torch.bool, device=z.device)
    others[rows, labels] = False
    f_proto = torch.cat([reps[rows, labels], reps[others].reshape(-1, d)], dim=0)  # (B*K, D)
    logits = F.cosine_similarity(z.repeat(k, 1), f_proto, dim=1) / temperature
    return torch.logsumexp(logits, dim=0) - torch.logsumexp(logits[:b], dim=0)


def ndcr_code(z: Tensor, target: Tensor) -> Tensor:
    """The public code's NDCR: z, target (B, D) -> 0-dim; ``(1/B) sum_i KL(P_i || Q_i)`` with
    ``P = softmax(H/||H||)``, ``Q = softmax(z/||z||)`` over the D features
    (``KLDivLoss(reduction='batchmean')``); at most about 4 / (2D), nearly inactive for D = 512."""
    z, target = _check_pair(z, target)
    return F.kl_div(F.log_softmax(_unit(z), dim=1), F.softmax(_unit(target), dim=1), reduction="batchmean")


# --------------------------------------------------------------------------- combined


def _check_options(variant: str, normaliser: str, num_negatives: int) -> None:
    _check_choice("loss variant", variant, LOSS_VARIANTS)
    _check_choice("TDCL normaliser", normaliser, NORMALISERS)
    if variant == "code" and (num_negatives != 0 or normaliser != "none"):
        raise ValueError(
            "loss variant 'code' reproduces the public code, which uses all negatives and plain "
            f"cosine: needs num_negatives=0 and normaliser='none', got {num_negatives!r}, {normaliser!r}"
        )


def feddifrc_loss(
    logits: Tensor | None,
    labels: Tensor | None,
    z: Tensor,
    reps: Tensor | None,
    ndcr_target: Tensor | None,
    *,
    variant: str,
    tdcl_weight: float,
    ndcr_weight: float,
    temperature: float,
    ndcr_space: str,
    num_negatives: int = 0,
    normaliser: str = "none",
    generator: torch.Generator | None = None,
    ndcr_z: Tensor | None = None,
) -> dict[str, Tensor]:
    """The local loss ``{"ce", "tdcl", "ndcr", "total"}`` (0-dim float32),
    ``total = ce + tdcl_weight * tdcl + ndcr_weight * ndcr``.

    logits (B, C) / labels (B,): CE; ``logits=None``: self-supervised, no CE, and with
    ``labels=None`` reps[:, 0] is the positive prompt, reps[:, 1:] the negatives.
    reps (B, K, D) and ndcr_target (B, D) feed TDCL and NDCR (``ndcr_space``: see ``ndcr_paper``);
    a zero-weight term is not computed (its input may be None) and returned as 0. ``ndcr_z``
    (B, D): the embedding NDCR aligns (e.g. of the un-augmented view its target was computed
    from); None = ``z``. Variant "code" has no negative sampling or normaliser.
    """
    _check_options(variant, normaliser, num_negatives)
    if logits is not None and labels is None:
        raise ValueError("logits given without labels: CE needs labels")
    zf, paper = z.float(), variant == "paper"
    out = {name: zf.new_zeros(()) for name in ("ce", "tdcl", "ndcr")}
    if logits is not None:
        out["ce"] = F.cross_entropy(logits.float(), labels.long())
    total = out["ce"]
    if tdcl_weight > 0:
        if reps is None:
            raise ValueError("tdcl_weight > 0 needs reps (B, K, D)")
        tl = labels.long() if labels is not None else torch.zeros(len(zf), dtype=torch.long, device=zf.device)
        opts = {"num_negatives": num_negatives, "generator": generator, "normaliser": normaliser}
        tdcl = tdcl_paper if paper else tdcl_code
        out["tdcl"] = tdcl(zf, reps, tl, temperature=temperature, **(opts if paper else {}))
        total = total + tdcl_weight * out["tdcl"]
    if ndcr_weight > 0:
        if ndcr_target is None:
            raise ValueError("ndcr_weight > 0 needs ndcr_target (B, D)")
        nz = zf if ndcr_z is None else ndcr_z.float()
        out["ndcr"] = ndcr_paper(nz, ndcr_target, space=ndcr_space) if paper else ndcr_code(nz, ndcr_target)
        total = total + ndcr_weight * out["ndcr"]
    return {**out, "total": total}


@torch.no_grad()
def cosine_alignment(z: Tensor, target: Tensor) -> Tensor:
    """Mean cosine between embeddings and NDCR targets, (B, D) x (B, D) -> 0-dim, detached (a metric)."""
    z, target = _check_pair(z, target)
    return (_unit(z) * _unit(target)).sum(dim=1).mean()
