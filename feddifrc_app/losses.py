"""FedDifRC local losses: CE + TDCL + NDCR.

A leaf module (torch only). Every function is pure: no module state, inputs are
cast to float32 inside (``.float()``), teacher tensors (diffusion
representations, NDCR targets) are detached inside so gradients never reach
them, and every function returns tensors.

Shapes: ``B`` batch, ``D`` embedding width (8 x model.width: 512 for the paper's ResNet-10), ``K`` number of
class prompts (number of classes) or of SSL negative prompts.

Two variants:

* ``"paper"`` (default) - the paper's per-sample TDCL
  ``L_i = log(1 + sum_{j in N_i} exp(s(z_i, F_ij)/tau) / exp(s(z_i, F_iy)/tau))``
  averaged over the batch, and the L2 NDCR ``sum_q (z_iq - H_iq)^2``.
* ``"code"`` - what the public code ``hwang52/FedDifRC`` (``main_FedDifRC.py``
  at ``c305f62``) actually computes, for comparison only: ONE batch-level
  InfoNCE log-ratio in which each negative is paired with ANOTHER sample's
  embedding, and a KL divergence between softmaxes of unit vectors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "VARIANTS",
    "NORMALISERS",
    "tdcl_paper",
    "ndcr_paper",
    "tdcl_code",
    "tdcl_code_pairing",
    "ndcr_code",
    "tdcl_ssl",
    "feddifrc_loss",
    "cosine_alignment",
]

VARIANTS = ("paper", "code")
NORMALISERS = ("none", "mean-distance")

# Guards against a zero-norm vector in cosine / unit-vector normalisation.
_EPS = 1e-8


# --------------------------------------------------------------------------- helpers


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _check_zr(z: Tensor, reps: Tensor, labels: Tensor | None = None) -> None:
    if z.dim() != 2:
        raise ValueError(f"z must be (B, D), got shape {tuple(z.shape)}")
    if reps.dim() != 3 or reps.shape[0] != z.shape[0] or reps.shape[2] != z.shape[1]:
        raise ValueError(
            f"reps must be (B, K, D) = ({z.shape[0]}, K, {z.shape[1]}), got shape {tuple(reps.shape)}"
        )
    if labels is not None:
        if labels.shape != (z.shape[0],):
            raise ValueError(f"labels must be ({z.shape[0]},), got shape {tuple(labels.shape)}")
        if labels.numel() and (labels.min() < 0 or labels.max() >= reps.shape[1]):
            raise ValueError(f"labels must lie in [0, {reps.shape[1]}), got {labels.tolist()}")


def _unit(x: Tensor) -> Tensor:
    """x / ||x|| along the last dim (float32), safe for a zero vector."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


def _cosine_bk(z: Tensor, reps: Tensor) -> Tensor:
    """(B,D) x (B,K,D) -> (B,K): cos(z_i, reps_ik)."""
    return torch.einsum("bd,bkd->bk", _unit(z), _unit(reps))


@torch.no_grad()
def _mean_distance(z: Tensor, reps: Tensor) -> Tensor:
    """[A] The paper's U, our reading. (B,D) x (B,K,D) -> (B,K), detached.

    ``U_ik = (1/B) * sum_b || z_b/||z_b|| - F_ik/||F_ik|| ||_2`` : the mean
    Euclidean distance of ALL the batch's (unit) sample embeddings to the
    diffusion representation ``F_ik``. Unit vectors keep U in [0, 2] and make
    it scale-free, like the cosine it divides; it is a stop-gradient scale
    (detached), so it never pushes embeddings away from the teacher.
    Computed as sqrt(2 - 2 cos) from a (B, B, K) cosine table: no (B,B,K,D) tensor.
    """
    cos = torch.einsum("bd,ikd->bik", _unit(z), _unit(reps))  # (B_b, B_i, K)
    dist = (2.0 - 2.0 * cos).clamp_min(0.0).sqrt()
    return dist.mean(dim=0).clamp_min(_EPS)  # (B_i, K)


def _similarity(z: Tensor, reps: Tensor, normaliser: str) -> Tensor:
    """s(z_i, F_ik), (B,K): plain cosine or cosine / U (see ``_mean_distance``)."""
    if normaliser not in NORMALISERS:
        raise ValueError(f"unknown TDCL normaliser {normaliser!r}; choices: {', '.join(NORMALISERS)}")
    s = _cosine_bk(z, reps)
    if normaliser == "mean-distance":
        s = s / _mean_distance(z, reps)
    return s


def _negative_mask(labels: Tensor, num_classes: int, num_negatives: int,
                   generator: torch.Generator | None, device: torch.device) -> Tensor:
    """(B,K) bool: True where class k is a negative of sample i.

    ``num_negatives`` 0 (or >= K-1): every class but the label. Otherwise exactly
    ``num_negatives`` classes per sample, drawn uniformly WITHOUT replacement
    from the other classes, independently per sample: the ``num_negatives``
    smallest of ``torch.rand(B, K, generator=generator)`` after the label's
    score is set to +inf. ``generator=None`` uses torch's global RNG.
    """
    b = labels.shape[0]
    others = torch.ones(b, num_classes, dtype=torch.bool, device=device)
    others[torch.arange(b, device=device), labels] = False
    if num_negatives <= 0 or num_negatives >= num_classes - 1:
        return others
    gen_device = generator.device if generator is not None else torch.device("cpu")
    scores = torch.rand(b, num_classes, generator=generator, device=gen_device).to(device)
    scores = scores.masked_fill(~others, float("inf"))
    picked = scores.topk(num_negatives, dim=1, largest=False).indices
    mask = torch.zeros_like(others)
    mask.scatter_(1, picked, True)
    return mask


# --------------------------------------------------------------------------- paper


def _prepare(z: Tensor, reps: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """Checked float32 ``z`` (B, D), detached float32 ``reps`` (B, K, D), int64 ``labels`` (B,)."""
    _check_temperature(temperature)
    z, reps, labels = z.float(), reps.detach().float(), labels.long()
    _check_zr(z, reps, labels)
    return z, reps, labels


def tdcl_paper(z: Tensor, reps: Tensor, labels: Tensor, *, temperature: float, num_negatives: int = 0,
               generator: torch.Generator | None = None, normaliser: str = "none") -> Tensor:
    """Paper TDCL. Returns a scalar (0-dim) float32 tensor.

    z:      (B, D) client embeddings (gradients flow here).
    reps:   (B, K, D) fused diffusion reps of the SAME image i under each of the
            K class prompts (detached inside).
    labels: (B,) ints in [0, K); the positive of sample i is ``reps[i, labels[i]]``.

    ``L_i = log(1 + sum_{j in N_i} exp(s_ij/tau) / exp(s_iy/tau))
          = softplus(logsumexp_{j in N_i}(s_ij/tau) - s_iy/tau)``, mean over i.
    Computed exactly in that softplus form (accurate near the minimum, where
    ``logsumexp - s_iy/tau`` would round to 0 in float32); K = 1 -> 0.

    N_i: all K-1 other classes (``num_negatives=0``) or ``num_negatives``
    sampled per sample without replacement with ``generator`` (see
    ``_negative_mask``). Each negative is compared with its OWN sample's z_i.
    s: cosine (``normaliser="none"``) or cosine / U (``"mean-distance"``, [A],
    see ``_mean_distance``).
    """
    z, reps, labels = _prepare(z, reps, labels, temperature)
    b, k, _ = reps.shape
    if b == 0:
        return z.sum() * 0.0
    logits = _similarity(z, reps, normaliser) / temperature  # (B, K)
    if k == 1:  # no negatives: log(1 + 0) = 0 (and no -inf logsumexp, whose gradient is NaN)
        return logits.sum() * 0.0
    neg = _negative_mask(labels, k, num_negatives, generator, z.device)  # >= 1 per row
    pos = logits.gather(1, labels[:, None]).squeeze(1)
    per_sample = F.softplus(torch.logsumexp(logits.masked_fill(~neg, float("-inf")), dim=1) - pos)
    return per_sample.mean()


NDCR_SPACES = ("unit", "raw")


def ndcr_paper(z: Tensor, target: Tensor, *, space: str = "raw") -> Tensor:
    """Paper NDCR: ``mean_i sum_q (z_iq - H_iq)^2``. z, target (B, D) -> scalar.

    ``space="raw"``: the literal form on the vectors as they are. ``space="unit"`` [A]: both
    vectors L2-normalised first (= 2 - 2 cos, in [0, 4]). The paper does not say at what scale
    H lives; raw PCA coordinates of a teacher make the effective NDCR weight depend on that
    teacher (the embedded tiny one starts at ~56 against CE ~2.3 and stalls CE), while the unit
    form is scale-free like TDCL's cosine. ``target`` (H) is detached inside.
    """
    if space not in NDCR_SPACES:
        raise ValueError(f"unknown NDCR space {space!r}; choices: {', '.join(NDCR_SPACES)}")
    z = z.float()
    target = target.detach().float()
    if z.shape != target.shape or z.dim() != 2:
        raise ValueError(f"z and target must both be (B, D), got {tuple(z.shape)} and {tuple(target.shape)}")
    if space == "unit":
        z, target = F.normalize(z, dim=1), F.normalize(target, dim=1)
    return (z - target).pow(2).sum(dim=1).mean()


def tdcl_ssl(z: Tensor, positive: Tensor, negatives: Tensor, *, temperature: float,
             num_negatives: int = 0, generator: torch.Generator | None = None,
             normaliser: str = "none") -> Tensor:
    """Self-supervised TDCL, same per-sample form as ``tdcl_paper``.

    z:         (B, D) embeddings.
    positive:  (B, D) rep of image i under "a photo of a similar object".
    negatives: (B, K, D) reps of image i under K unrelated class prompts.
    Equals ``tdcl_paper(z, cat([positive[:,None], negatives], 1), zeros(B))``.
    """
    positive = positive.detach().float()
    negatives = negatives.detach().float()
    if positive.dim() != 2 or negatives.dim() != 3:
        raise ValueError(
            f"positive must be (B, D) and negatives (B, K, D), got {tuple(positive.shape)} "
            f"and {tuple(negatives.shape)}"
        )
    reps = torch.cat([positive[:, None, :], negatives], dim=1)
    labels = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    return tdcl_paper(z, reps, labels, temperature=temperature, num_negatives=num_negatives,
                      generator=generator, normaliser=normaliser)


# --------------------------------------------------------------------------- public code


def tdcl_code_pairing(batch_size: int, num_negatives: int) -> Tensor:
    """Index of the embedding the public code compares with each negative row.

    The code stacks negatives sample-major (row ``r = i*M + m`` is sample i's
    m-th negative, ``M = num_negatives``; main_FedDifRC.py:191,193), puts them
    after the B positives (:149) and tiles the embeddings ``feas.repeat(M+1, 1)``
    (:194-195), so row ``B + r`` of the tiled batch is ``z[(B + r) mod B] =
    z[r mod B]``. Returns (B*M,) long: entry r = ``r % B`` (the right sample,
    ``i``, only when ``(i*M + m) % B == i``).
    """
    return torch.arange(batch_size * num_negatives) % max(batch_size, 1)


def tdcl_code(z: Tensor, reps: Tensor, labels: Tensor, *, temperature: float) -> Tensor:
    """The public code's TDCL, reproduced (main_FedDifRC.py:148-162, 186-196). Scalar.

    Code (hwang52/FedDifRC, main_FedDifRC.py):
      :189-191  per sample, ``f_pos = sd_text_fea[-1]`` (the label prompt) and
                ``f_neg = sd_text_fea[:-1]`` (the other prompts);
      :192-193  ``f_pos`` (B, D); ``f_neg`` stacked then ``reshape(-1, D)``:
                (B*M, D), sample-major;
      :194-195  ``f_now = feas.repeat(M+1, 1)``: the embeddings TILED, so
                negative row r (sample r // M) meets ``z[r % B]``, another
                sample's embedding in general (``tdcl_code_pairing``);
      :149-152  ``l = cosine_similarity(f_now, cat(f_pos, f_neg)) / tau``
                (no normaliser; tau = ``--infonce_t`` 0.04, utils/options.py);
      :153-161  ONE batch-level ratio over all (M+1)*B rows:
                ``-log(sum_pos exp(l) / sum_all exp(l))``.
    The writer of ``sdfeas_text_*.pth`` is not public, so the
    order of ``sd_text_fea[:-1]`` is unknown: [A] we take the other classes in
    ascending class order, M = K-1. The ratio is evaluated with logsumexp
    (same value, no overflow) and returned 0-dim (the code's is shape (1,)).

    z (B, D); reps (B, K, D) by class index (detached inside); labels (B,).
    """
    z, reps, labels = _prepare(z, reps, labels, temperature)
    b, k, d = reps.shape
    if b == 0:
        return z.sum() * 0.0
    rows = torch.arange(b, device=z.device)
    f_pos = reps[rows, labels]  # (B, D)
    others = torch.ones(b, k, dtype=torch.bool, device=z.device)
    others[rows, labels] = False
    f_neg = reps[others].reshape(-1, d)  # (B*(K-1), D), sample-major, ascending class order
    f_proto = torch.cat([f_pos, f_neg], dim=0)  # :149
    f_now = z.repeat(k, 1)  # :194-195, repeat_num = (B + B*(K-1)) / B = K
    logits = F.cosine_similarity(f_now, f_proto, dim=1) / temperature  # :150-151
    return torch.logsumexp(logits, dim=0) - torch.logsumexp(logits[:b], dim=0)  # :153-161


def ndcr_code(z: Tensor, target: Tensor) -> Tensor:
    """The public code's NDCR (main_FedDifRC.py:110, 181-184). z, target (B, D) -> scalar.

    ``KLDivLoss(reduction='batchmean')(log_softmax(z/||z||), softmax(H/||H||))``
    = ``(1/B) sum_i KL(P_i || Q_i)`` with target ``P_i = softmax(H_i/||H_i||)``
    and input ``Q_i = softmax(z_i/||z_i||)`` (softmax over the D features).
    Unit vectors' entries are ~1/sqrt(D), so for D = 512 this is at most about
    ``||u - v||^2 / (2D) <= 4/1024 ~ 0.004``: nearly inactive.
    """
    z = z.float()
    target = target.detach().float()
    if z.shape != target.shape or z.dim() != 2:
        raise ValueError(f"z and target must both be (B, D), got {tuple(z.shape)} and {tuple(target.shape)}")
    log_q = F.log_softmax(_unit(z), dim=1)
    p = F.softmax(_unit(target), dim=1)
    return F.kl_div(log_q, p, reduction="batchmean")


# --------------------------------------------------------------------------- combined


def feddifrc_loss(logits: Tensor | None, labels: Tensor | None, z: Tensor, reps: Tensor | None,
                  ndcr_target: Tensor | None, *, variant: str, tdcl_weight: float, ndcr_weight: float,
                  temperature: float, num_negatives: int = 0, normaliser: str = "none",
                  ndcr_space: str = "raw", generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """The local FedDifRC loss; returns ``{"ce", "tdcl", "ndcr", "total"}`` (0-dim float32).

    ``total = ce + tdcl_weight * tdcl + ndcr_weight * ndcr``.

    logits (B, C) / labels (B,): CE. ``logits=None`` -> no CE (ce = 0), the
    self-supervised mode; ``labels`` may then be None as well.
    reps (B, K, D): supervised -> indexed by class, positive ``reps[i, labels[i]]``;
    with ``labels=None`` (SSL) -> ``reps[:, 0]`` is the positive ("a photo of a
    similar object") and ``reps[:, 1:]`` the negatives (``tdcl_ssl``).
    ndcr_target (B, D): the noise-driven representation H.
    A term whose weight is 0 is NOT computed and is returned as a zero tensor;
    its input may then be None.
    ndcr_space: "raw" or "unit" (see ``ndcr_paper``; paper variant only).
    variant: "paper" (tdcl_paper / ndcr_paper) or "code" (tdcl_code / ndcr_code;
    the code has no negative sampling or normaliser, so ``num_negatives`` must
    be 0 and ``normaliser`` "none").
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown loss variant {variant!r}; choices: {', '.join(VARIANTS)}")
    if normaliser not in NORMALISERS:
        raise ValueError(f"unknown TDCL normaliser {normaliser!r}; choices: {', '.join(NORMALISERS)}")
    if tdcl_weight < 0 or ndcr_weight < 0:
        raise ValueError(f"loss weights must be >= 0, got tdcl {tdcl_weight!r}, ndcr {ndcr_weight!r}")
    if variant == "code" and (num_negatives != 0 or normaliser != "none"):
        raise ValueError(
            "loss variant 'code' reproduces the public code, which uses all negatives and plain "
            f"cosine: needs num_negatives=0 and normaliser='none', got {num_negatives!r}, {normaliser!r}"
        )
    zf = z.float()
    zero = zf.new_zeros(())

    if logits is not None:
        if labels is None:
            raise ValueError("logits given without labels: CE needs labels")
        ce = F.cross_entropy(logits.float(), labels.long())
    else:
        ce = zero

    tdcl = zero
    if tdcl_weight > 0:
        if reps is None:
            raise ValueError("tdcl_weight > 0 needs reps (B, K, D)")
        tl = labels.long() if labels is not None else torch.zeros(zf.shape[0], dtype=torch.long,
                                                                  device=zf.device)
        if variant == "paper":
            tdcl = tdcl_paper(zf, reps, tl, temperature=temperature, num_negatives=num_negatives,
                              generator=generator, normaliser=normaliser)
        else:
            tdcl = tdcl_code(zf, reps, tl, temperature=temperature)

    ndcr = zero
    if ndcr_weight > 0:
        if ndcr_target is None:
            raise ValueError("ndcr_weight > 0 needs ndcr_target (B, D)")
        ndcr = ndcr_paper(zf, ndcr_target, space=ndcr_space) if variant == "paper" else ndcr_code(zf, ndcr_target)

    total = ce
    if tdcl_weight > 0:
        total = total + tdcl_weight * tdcl
    if ndcr_weight > 0:
        total = total + ndcr_weight * ndcr
    return {"ce": ce, "tdcl": tdcl, "ndcr": ndcr, "total": total}


@torch.no_grad()
def cosine_alignment(z: Tensor, target: Tensor) -> Tensor:
    """Mean cosine between embeddings and NDCR targets, (B,D) x (B,D) -> 0-dim, detached (a metric)."""
    z = z.float()
    target = target.float()
    if z.shape != target.shape or z.dim() != 2:
        raise ValueError(f"z and target must both be (B, D), got {tuple(z.shape)} and {tuple(target.shape)}")
    return (_unit(z) * _unit(target)).sum(dim=1).mean()
