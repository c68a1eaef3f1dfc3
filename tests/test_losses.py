"""feddifrc_app.methods.feddifrc.losses: hand-computed values on 1-3 samples with D = 2.

Every expected number below is written out with math on python floats from
cosines read off the chosen vectors, never by calling the formula under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from feddifrc_app.methods.feddifrc import losses
from feddifrc_app.methods.feddifrc.losses import (
    cosine_alignment,
    feddifrc_loss,
    ndcr_code,
    ndcr_paper,
    tdcl_code,
    tdcl_paper,
)

R2 = math.sqrt(2.0)
E = math.e


def t(x, **kw) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, **kw)


def sp(x: float) -> float:
    """softplus, log(1 + e^x)."""
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------- fixtures of hand cases

# Case A: B=2, K=3, D=2.
#   sample 0: z=(1,0); reps (1,0),(0,1),(-1,0) -> cos 1, 0, -1; label 0
#   sample 1: z=(0,2); reps (3,0),(0,1),(1,1)  -> cos 0, 1, 1/sqrt2; label 1
ZA = [[1.0, 0.0], [0.0, 2.0]]
RA = [[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], [[3.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]
LA = [0, 1]


def case_a():
    return t(ZA), t(RA), torch.tensor(LA)


# ---------------------------------------------------------------- tdcl_paper


def test_tdcl_paper_all_negatives_hand_value():
    z, reps, y = case_a()
    tau = 0.5
    l0 = math.log(1 + (math.exp(0 / tau) + math.exp(-1 / tau)) / math.exp(1 / tau))
    l1 = math.log(1 + (math.exp(0 / tau) + math.exp((1 / R2) / tau)) / math.exp(1 / tau))
    got = tdcl_paper(z, reps, y, temperature=tau)
    assert got.dim() == 0 and got.dtype == torch.float32
    assert got.item() == pytest.approx((l0 + l1) / 2, rel=1e-6)


def test_tdcl_paper_negatives_use_their_own_sample():
    z, reps, y = case_a()
    tau = 0.5
    own = tdcl_paper(z, reps, y, temperature=tau).item()
    # If sample 1's negatives were compared with z_0=(1,0) instead (cos 1 with (3,0), 1/sqrt2 with
    # (1,1)), the value would be different:
    l0 = math.log(1 + (math.exp(0 / tau) + math.exp(-1 / tau)) / math.exp(1 / tau))
    l1_other = math.log(1 + (math.exp(1 / tau) + math.exp((1 / R2) / tau)) / math.exp(1 / tau))
    assert abs(own - (l0 + l1_other) / 2) > 0.1
    # Each per-sample term depends only on its own row: permuting the batch changes nothing.
    perm = torch.tensor([1, 0])
    assert tdcl_paper(z[perm], reps[perm], y[perm], temperature=tau).item() == pytest.approx(own, rel=1e-6)


def test_tdcl_paper_sampled_negatives_fixed_generator():
    # B=2, K=4, D=2, one sampled negative per sample, tau=1.
    # sample 0: z=(1,0); reps (1,0)[pos], (0,1), (-1,0), (1,1) -> cos 1, 0, -1, 1/sqrt2
    # sample 1: z=(0,1); reps (1,0), (0,-1), (0,1)[pos], (-1,1) -> cos 0, -1, 1, 1/sqrt2
    z = t([[1.0, 0.0], [0.0, 1.0]])
    reps = t(
        [
            [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 1.0]],
            [[1.0, 0.0], [0.0, -1.0], [0.0, 1.0], [-1.0, 1.0]],
        ]
    )
    y = torch.tensor([0, 2])
    cos = [[1.0, 0.0, -1.0, 1 / R2], [0.0, -1.0, 1.0, 1 / R2]]
    # per-sample value with the single negative j: log(1 + e^{cos_j} / e^{cos_y})
    one = [
        {j: math.log(1 + math.exp(cos[i][j]) / math.exp(cos[i][y[i]])) for j in range(4) if j != y[i]}
        for i in range(2)
    ]
    # The documented rule: the num_negatives smallest of torch.rand(B, K, generator) over non-labels.
    seen = set()
    for seed in range(12):
        scores = torch.rand(2, 4, generator=torch.Generator().manual_seed(seed))
        scores[0, 0] = scores[1, 2] = float("inf")
        j0, j1 = int(scores[0].argmin()), int(scores[1].argmin())
        seen.add((j0, j1))
        got = tdcl_paper(
            z, reps, y, temperature=1.0, num_negatives=1, generator=torch.Generator().manual_seed(seed)
        ).item()
        assert got == pytest.approx((one[0][j0] + one[1][j1]) / 2, rel=1e-6)
        # same seed, same draw
        again = tdcl_paper(
            z, reps, y, temperature=1.0, num_negatives=1, generator=torch.Generator().manual_seed(seed)
        ).item()
        assert again == got
    assert len(seen) > 1  # the seed really changes the negatives
    # num_negatives >= K-1 means all of them
    all_neg = tdcl_paper(z, reps, y, temperature=1.0)
    assert tdcl_paper(z, reps, y, temperature=1.0, num_negatives=3).item() == pytest.approx(all_neg.item())
    assert tdcl_paper(z, reps, y, temperature=1.0, num_negatives=9).item() == pytest.approx(all_neg.item())


def test_negative_sampling_is_without_replacement_and_uniform():
    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 3, 5])
    counts = torch.zeros(3, 6)
    n = 600
    for _ in range(n):
        m = losses._negative_mask(labels, 6, 2, g, torch.device("cpu"))
        assert m.sum(1).tolist() == [2, 2, 2]  # exactly num_negatives, distinct classes
        assert not m[torch.arange(3), labels].any()  # never the label
        counts += m
    expected = n * 2 / 5  # each of the 5 other classes
    is_other = torch.ones(3, 6, dtype=torch.bool)
    is_other[torch.arange(3), labels] = False
    others = counts[is_other]
    assert ((others - expected).abs() < 0.25 * expected).all()


def test_tdcl_paper_mean_distance_normaliser_hand_value():
    # B=2, K=2, D=2. z_0=(1,0), z_1=(0,1).
    # reps_0 = (1,0)[pos], (1,1); reps_1 = (1,0), (0,1)[pos].
    # U for F=(1,0) or (0,1): distances from the unit embeddings 0 and sqrt2 -> U = sqrt2/2.
    # U for F=(1,1)/sqrt2: both distances sqrt(2 - 2/sqrt2) = sqrt(2 - sqrt2) -> U = sqrt(2 - sqrt2).
    z = t([[1.0, 0.0], [0.0, 1.0]])
    reps = t([[[1.0, 0.0], [1.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]])
    y = torch.tensor([0, 1])
    tau = 0.5
    s00 = 1.0 / (R2 / 2)
    s01 = (1 / R2) / math.sqrt(2 - R2)
    s10 = 0.0 / (R2 / 2)
    s11 = 1.0 / (R2 / 2)
    want = (sp((s01 - s00) / tau) + sp((s10 - s11) / tau)) / 2
    got = tdcl_paper(z, reps, y, temperature=tau, normaliser="mean-distance")
    assert got.item() == pytest.approx(want, rel=1e-5)
    plain = (sp((1 / R2 - 1) / tau) + sp((0 - 1) / tau)) / 2
    assert tdcl_paper(z, reps, y, temperature=tau, normaliser="none").item() == pytest.approx(plain, rel=1e-6)
    with pytest.raises(ValueError, match="mean-distance"):
        tdcl_paper(z, reps, y, temperature=tau, normaliser="bogus")


def test_tdcl_paper_decreases_as_z_aligns_with_positive():
    reps = t([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    y = torch.tensor([0])
    vals = []
    for theta in [math.pi / 2, math.pi / 3, math.pi / 6, math.pi / 12, 0.0]:
        z = t([[math.cos(theta), math.sin(theta)]])
        vals.append(tdcl_paper(z, reps, y, temperature=0.04).item())
    assert all(a > b for a, b in zip(vals, vals[1:], strict=False))
    # aligned: log(1 + (e^{0/tau} + e^{-1/tau}) / e^{1/tau}) ~ e^{-25}, its minimum over z
    assert vals[-1] == pytest.approx(math.log1p((1 + math.exp(-25)) * math.exp(-25)), rel=1e-3)
    assert vals[-1] < 1e-10


def test_tdcl_single_class_is_zero_and_finite_gradient():
    z = t([[1.0, 2.0]], requires_grad=True)
    out = tdcl_paper(z, t([[[3.0, 1.0]]]), torch.tensor([0]), temperature=0.04)
    out.backward()
    assert out.item() == 0.0 and torch.isfinite(z.grad).all()


def test_bad_shapes_and_labels_are_rejected():
    z, reps, y = case_a()
    with pytest.raises(ValueError, match="reps"):
        tdcl_paper(z, reps[:, :, :1], y, temperature=0.1)
    with pytest.raises(ValueError, match="labels"):
        tdcl_paper(z, reps, torch.tensor([0, 3]), temperature=0.1)
    with pytest.raises(ValueError, match="temperature"):
        tdcl_paper(z, reps, y, temperature=0.0)


# ---------------------------------------------------------------- ndcr_paper


def test_ndcr_paper_hand_value_and_zero_when_aligned():
    z = t([[1.0, 2.0], [0.0, 0.0]])
    h = t([[0.0, 0.0], [3.0, 4.0]])
    # ((1 + 4) + (9 + 16)) / 2
    assert ndcr_paper(z, h, space="raw").item() == pytest.approx(15.0)
    assert ndcr_paper(h, h, space="raw").item() == 0.0


# ---------------------------------------------------------------- tdcl_code


def test_tdcl_code_cross_sample_pairing_hand_value():
    # B=2, K=3 (M=2 negatives each, ascending class order), tau=1, D=2.
    # z_0=(1,0), z_1=(0,1); labels 0 and 2.
    # sample 0: pos (1,0); negs c1=(0,1), c2=(1,1).  sample 1: negs c0=(1,0), c1=(-1,0); pos c2=(0,1).
    z = t([[1.0, 0.0], [0.0, 1.0]])
    reps = t([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]]])
    y = torch.tensor([0, 2])
    # Code rows: positives cos(z_0,(1,0))=1, cos(z_1,(0,1))=1.
    # negatives, tiled pairing z_0, z_1, z_0, z_1:
    #   cos(z_0,(0,1))=0, cos(z_1,(1,1))=1/sqrt2, cos(z_0,(1,0))=1, cos(z_1,(-1,0))=0.
    pos = [E, E]
    neg = [1.0, math.exp(1 / R2), E, 1.0]
    want = -math.log(sum(pos) / (sum(pos) + sum(neg)))
    got = tdcl_code(z, reps, y, temperature=1.0)
    assert got.dim() == 0
    assert got.item() == pytest.approx(want, rel=1e-6)
    # With each negative paired with ITS OWN sample the negatives would be
    #   cos(z_0,(0,1))=0, cos(z_0,(1,1))=1/sqrt2, cos(z_1,(1,0))=0, cos(z_1,(-1,0))=0:
    own = -math.log(sum(pos) / (sum(pos) + 1.0 + math.exp(1 / R2) + 1.0 + 1.0))
    assert abs(got.item() - own) > 0.1
    # ... and the paper's per-sample mean on the same inputs is something else again.
    paper = (math.log(1 + (1.0 + math.exp(1 / R2)) / E) + math.log(1 + (1.0 + 1.0) / E)) / 2
    assert tdcl_paper(z, reps, y, temperature=1.0).item() == pytest.approx(paper, rel=1e-6)
    assert abs(got.item() - paper) > 0.1


def test_tdcl_code_one_ratio_not_per_sample_mean():
    # M=1 (K=2): the tiled pairing happens to be right, yet the code's ONE ratio over the batch
    # differs from the mean of per-sample ratios. B=2, tau=1.
    # s0: z=(1,0), pos (0,1) cos 0;  its negative (-1,0) (row 0 of the negatives, meets z_0): cos -1
    # s1: z=(0,1), pos (0,1) cos 1;  its negative (0,-1) (row 1, meets z_1): cos -1
    z = t([[1.0, 0.0], [0.0, 1.0]])
    reps = t([[[0.0, 1.0], [-1.0, 0.0]], [[0.0, -1.0], [0.0, 1.0]]])
    y = torch.tensor([0, 1])
    want = -math.log((1.0 + E) / (1.0 + E + math.exp(-1.0) + math.exp(-1.0)))
    assert tdcl_code(z, reps, y, temperature=1.0).item() == pytest.approx(want, rel=1e-6)
    per_sample = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(-2.0))) / 2
    assert tdcl_paper(z, reps, y, temperature=1.0).item() == pytest.approx(per_sample, rel=1e-6)
    assert abs(want - per_sample) > 0.03


# ---------------------------------------------------------------- ndcr_code


def test_ndcr_code_hand_value():
    # z=(1,0) (any positive scale), H=(0,1): Q=softmax(1,0), P=softmax(0,1);
    # KL(P||Q) = 1/(1+e)*(-1) + e/(1+e)*(+1) = (e-1)/(e+1). Second sample z == H -> 0. batchmean /2.
    z = t([[5.0, 0.0], [0.3, 0.4]])
    h = t([[0.0, 2.0], [0.3, 0.4]])
    assert ndcr_code(z, h).item() == pytest.approx((E - 1) / (E + 1) / 2, rel=1e-6)
    # direction: KL(P_target || Q_z), not the reverse. z=(1,0), H=(1,1)/sqrt2:
    a = 1 / R2
    q = [E / (E + 1), 1 / (E + 1)]
    p = [0.5, 0.5]
    kl_pq = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    kl_qp = sum(qi * math.log(qi / pi) for pi, qi in zip(p, q, strict=True))
    got = ndcr_code(t([[1.0, 0.0]]), t([[a, a]])).item()
    assert got == pytest.approx(kl_pq, rel=1e-6)
    assert abs(got - kl_qp) > 1e-3


def test_ndcr_code_is_tiny_for_512d_unit_vectors():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 512, generator=g)
    h = torch.randn(16, 512, generator=g)
    assert ndcr_code(z, h).item() < 0.0045
    assert ndcr_code(z, -z).item() < 0.0045  # antipodal: the worst case for dense vectors
    e1 = torch.zeros(1, 512)
    e1[0, 0] = 1.0
    assert ndcr_code(e1, -e1).item() < 0.0045
    assert ndcr_code(z, 3 * z).item() == pytest.approx(0.0, abs=1e-7)
    # ... while the paper's L2 on the same vectors is large
    assert ndcr_paper(z, h, space="raw").item() > 100


# ---------------------------------------------------------------- gradients and dtypes


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_gradients_reach_z_only(variant):
    z, reps, y = case_a()
    z.requires_grad_(True)
    reps.requires_grad_(True)
    h = torch.randn(2, 2, requires_grad=True)
    logits = torch.randn(2, 3, requires_grad=True)
    out = feddifrc_loss(
        logits,
        y,
        z,
        reps,
        h,
        variant=variant,
        tdcl_weight=1.0,
        ndcr_weight=1.0,
        temperature=0.5,
        ndcr_space="raw",
    )
    out["total"].backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
    assert logits.grad is not None
    assert reps.grad is None and h.grad is None


def test_each_function_detaches_teachers():
    z, reps, y = case_a()
    z.requires_grad_(True)
    reps.requires_grad_(True)
    h = torch.randn(2, 2, requires_grad=True)
    for out in (
        tdcl_paper(z, reps, y, temperature=0.5, normaliser="mean-distance"),
        tdcl_code(z, reps, y, temperature=0.5),
        ndcr_paper(z, h, space="raw"),
        ndcr_code(z, h),
    ):
        out.backward()
    assert reps.grad is None and h.grad is None and z.grad.abs().sum() > 0


def test_float16_inputs_are_computed_in_float32():
    z, reps, y = case_a()
    zh, rh = z.half(), reps.half()
    hh = torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=torch.float16)
    for fn, args, kw in [
        (tdcl_paper, (zh, rh, y), {"temperature": 0.04}),
        (tdcl_code, (zh, rh, y), {"temperature": 0.04}),
        (ndcr_paper, (zh, hh), {"space": "raw"}),
        (ndcr_code, (zh, hh), {}),
        (cosine_alignment, (zh, hh), {}),
    ]:
        got = fn(*args, **kw)
        assert got.dtype == torch.float32
        ref = fn(*[a.float() if a.is_floating_point() else a for a in args], **kw)
        assert got.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-9)
    out = feddifrc_loss(
        torch.zeros(2, 3, dtype=torch.float16),
        y,
        zh,
        rh,
        hh,
        variant="paper",
        tdcl_weight=1.0,
        ndcr_weight=1.0,
        temperature=0.04,
        ndcr_space="raw",
    )
    assert all(v.dtype == torch.float32 for v in out.values())
    # with tau = 0.04, s/tau up to 25: the exps would overflow float16 (max 65504) were it used
    assert torch.isfinite(out["total"])


# ---------------------------------------------------------------- feddifrc_loss


def test_feddifrc_loss_total_and_parts():
    z, reps, y = case_a()
    logits = t([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    h = t([[1.0, 1.0], [0.0, 0.0]])
    out = feddifrc_loss(
        logits,
        y,
        z,
        reps,
        h,
        variant="paper",
        tdcl_weight=0.5,
        ndcr_weight=2.0,
        temperature=0.5,
        ndcr_space="raw",
    )
    assert set(out) == {"ce", "tdcl", "ndcr", "total"}
    ce = (-math.log(E**2 / (E**2 + 2)) + -math.log(1 / 3)) / 2
    tdcl = (math.log(1 + (1 + math.exp(-2)) / E**2) + math.log(1 + (1 + math.exp(R2)) / E**2)) / 2
    ndcr = ((0 + 1) + (0 + 4)) / 2  # z-H = (0,-1) and (0,2)
    assert out["ce"].item() == pytest.approx(ce, rel=1e-6)
    assert out["tdcl"].item() == pytest.approx(tdcl, rel=1e-6)
    assert out["ndcr"].item() == pytest.approx(ndcr, rel=1e-6)
    assert out["total"].item() == pytest.approx(ce + 0.5 * tdcl + 2.0 * ndcr, rel=1e-6)


def test_ndcr_aligns_ndcr_z_when_given():
    # NDCR reads ndcr_z (another view's embedding), TDCL and CE read z.
    z, reps, y = case_a()
    h = t([[1.0, 1.0], [0.0, 0.0]])
    kw = dict(variant="paper", tdcl_weight=1.0, ndcr_weight=1.0, temperature=0.5, ndcr_space="raw")
    plain = feddifrc_loss(None, y, z, reps, h, **kw)
    other = feddifrc_loss(None, y, z, reps, h, ndcr_z=h.clone(), **kw)
    assert other["ndcr"].item() == 0.0 and plain["ndcr"].item() == pytest.approx(2.5)
    assert other["tdcl"].item() == pytest.approx(plain["tdcl"].item())


def test_zero_weights_switch_terms_off_and_skip_computation(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a zero-weight term was computed")

    for name in ("tdcl_paper", "tdcl_code", "ndcr_paper", "ndcr_code"):
        monkeypatch.setattr(losses, name, boom)
    z, reps, y = case_a()
    logits = t([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    for variant in ("paper", "code"):
        # teachers absent (None) or even malformed: never touched
        for r, h in ((None, None), (torch.zeros(7), torch.zeros(3))):
            out = feddifrc_loss(
                logits,
                y,
                z,
                r,
                h,
                variant=variant,
                tdcl_weight=0.0,
                ndcr_weight=0.0,
                temperature=0.04,
                ndcr_space="raw",
            )
            assert out["tdcl"].item() == 0.0 and out["ndcr"].item() == 0.0
            assert out["total"].item() == pytest.approx(out["ce"].item())
    out["total"].backward()
    assert logits.grad is not None


def test_single_term_weights():
    z, reps, y = case_a()
    h = t([[1.0, 1.0], [0.0, 0.0]])
    only_ndcr = feddifrc_loss(
        None,
        y,
        z,
        None,
        h,
        variant="paper",
        tdcl_weight=0.0,
        ndcr_weight=1.0,
        temperature=0.5,
        ndcr_space="raw",
    )
    assert only_ndcr["tdcl"].item() == 0.0 and only_ndcr["total"].item() == pytest.approx(2.5)
    only_tdcl = feddifrc_loss(
        None,
        y,
        z,
        reps,
        None,
        variant="paper",
        tdcl_weight=1.0,
        ndcr_weight=0.0,
        temperature=0.5,
        ndcr_space="raw",
    )
    assert only_tdcl["ndcr"].item() == 0.0
    assert only_tdcl["total"].item() == pytest.approx(tdcl_paper(z, reps, y, temperature=0.5).item())
    with pytest.raises(ValueError, match="reps"):
        feddifrc_loss(
            None,
            y,
            z,
            None,
            h,
            variant="paper",
            tdcl_weight=1.0,
            ndcr_weight=0.0,
            temperature=0.5,
            ndcr_space="raw",
        )
    with pytest.raises(ValueError, match="ndcr_target"):
        feddifrc_loss(
            None,
            y,
            z,
            reps,
            None,
            variant="paper",
            tdcl_weight=0.0,
            ndcr_weight=1.0,
            temperature=0.5,
            ndcr_space="raw",
        )


def test_feddifrc_loss_without_labels_is_ssl():
    # reps[:, 0] is the positive, reps[:, 1:] the negatives.
    z = t([[1.0, 1.0]], requires_grad=True)
    reps = t([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    h = t([[1.0, 1.0]])
    out = feddifrc_loss(
        None,
        None,
        z,
        reps,
        h,
        variant="paper",
        tdcl_weight=1.0,
        ndcr_weight=1.0,
        temperature=1.0,
        ndcr_space="raw",
    )
    assert out["ce"].item() == 0.0
    assert out["tdcl"].item() == pytest.approx(math.log(2 + math.exp(-R2)), rel=1e-6)
    assert out["ndcr"].item() == 0.0
    out["total"].backward()
    assert z.grad is not None
    code = feddifrc_loss(
        None,
        None,
        z,
        reps,
        h,
        variant="code",
        tdcl_weight=1.0,
        ndcr_weight=1.0,
        temperature=1.0,
        ndcr_space="raw",
    )
    # B=1: the code's pairing is trivially right, so TDCL matches; its NDCR is the KL (0 here too).
    assert code["tdcl"].item() == pytest.approx(math.log(2 + math.exp(-R2)), rel=1e-6)


def test_feddifrc_loss_rejects_bad_options():
    z, reps, y = case_a()
    kw = dict(tdcl_weight=1.0, ndcr_weight=0.0, temperature=0.5, ndcr_space="raw")
    with pytest.raises(ValueError, match="paper, code"):
        feddifrc_loss(None, y, z, reps, None, variant="nope", **kw)
    with pytest.raises(ValueError, match="num_negatives"):
        feddifrc_loss(None, y, z, reps, None, variant="code", num_negatives=1, **kw)
    with pytest.raises(ValueError, match="normaliser"):
        feddifrc_loss(None, y, z, reps, None, variant="paper", normaliser="x", **kw)
    with pytest.raises(ValueError, match="labels"):
        feddifrc_loss(torch.zeros(2, 3), None, z, reps, None, variant="paper", **kw)


def test_feddifrc_loss_passes_sampling_options():
    z, reps, y = case_a()
    out = feddifrc_loss(
        None,
        y,
        z,
        reps,
        None,
        variant="paper",
        tdcl_weight=1.0,
        ndcr_weight=0.0,
        temperature=0.5,
        ndcr_space="raw",
        num_negatives=1,
        normaliser="mean-distance",
        generator=torch.Generator().manual_seed(3),
    )
    ref = tdcl_paper(
        z,
        reps,
        y,
        temperature=0.5,
        num_negatives=1,
        normaliser="mean-distance",
        generator=torch.Generator().manual_seed(3),
    )
    assert out["tdcl"].item() == pytest.approx(ref.item())


# ---------------------------------------------------------------- cosine_alignment


def test_cosine_alignment_hand_value():
    z = t([[1.0, 0.0], [1.0, 1.0]], requires_grad=True)
    h = t([[2.0, 0.0], [0.0, 1.0]])
    got = cosine_alignment(z, h)
    assert got.item() == pytest.approx((1 + 1 / R2) / 2, rel=1e-6)
    assert not got.requires_grad


# ---------------------------------------------------------------- transcription of the public code


def test_code_variant_matches_a_transcription_of_the_public_code():
    """main_FedDifRC.py:148-162 and 181-196 (hwang52/FedDifRC), transcribed, on random data.

    The code's per-sample text features are (M+1, D) with the label prompt LAST; we lay ours out
    as the other classes in ascending order then the label ([A], see tdcl_code).
    """
    g = torch.Generator().manual_seed(0)
    b, k, d, tau = 5, 4, 8, 0.04
    feas = torch.randn(b, d, generator=g)
    reps = torch.randn(b, k, d, generator=g)
    y = torch.randint(0, k, (b,), generator=g)
    sd_text_feas = torch.stack(
        [torch.cat([reps[i][[c for c in range(k) if c != y[i]]], reps[i, y[i]][None]]) for i in range(b)]
    )
    f_pos = torch.stack([s[-1] for s in sd_text_feas])
    f_neg = torch.stack([s[:-1] for s in sd_text_feas]).reshape(-1, d)
    f_now = feas.repeat(int((f_pos.size(0) + f_neg.size(0)) / feas.size(0)), 1)
    sim = torch.cosine_similarity(f_now, torch.cat((f_pos, f_neg), dim=0), dim=1) / tau
    exp_l = torch.exp(sim).view(1, -1)
    pos_mask = torch.tensor([1] * b + [0] * (b * (k - 1)), dtype=torch.float).view(1, -1)
    ref_text = -torch.log((exp_l * pos_mask).sum(1) / exp_l.sum(1))
    assert tdcl_code(feas, reps, y, temperature=tau).item() == pytest.approx(ref_text.item(), rel=1e-5)

    sd = torch.randn(b, d, generator=g)
    ref_noise = torch.nn.KLDivLoss(reduction="batchmean")(
        torch.nn.functional.log_softmax(feas / feas.norm(dim=-1, keepdim=True), dim=1),
        torch.nn.functional.softmax(sd / sd.norm(dim=-1, keepdim=True), dim=1),
    )
    assert ndcr_code(feas, sd).item() == pytest.approx(ref_noise.item(), rel=1e-6)
