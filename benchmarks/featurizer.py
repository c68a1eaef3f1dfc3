"""Teacher feature extraction: the public code's naive way vs our batched Featurizer.

Run by hand (not a test), e.g.

    python benchmarks/featurizer.py                                   # tiny teacher, 16 px, CPU
    python benchmarks/featurizer.py --threads 1 --warm-cache          # + the on-disk feature cache
    python benchmarks/featurizer.py --model sd21-random --resolution 224 --device cuda \
        --images 64 --naive-images 8                                  # SD-2.1-sized, on a GPU
    python benchmarks/featurizer.py --model stabilityai/stable-diffusion-2-1 \
        --resolution 224 --device cuda --images 64 --naive-images 8   # the real SD-2.1 (cached)

Same process, same teacher, same images (sklearn's digits, 8x8 upsampled), same
prompts (10 class prompts + the unconditional NDCR prompt), same seeded noise:

(a) naive — what the public code does: one UNet call per (image, prompt); the VAE
    and the text encoder re-run on every call; nothing cached. Like the public
    ``MyUNet2DConditionModel`` it stops after the last needed up-block.
(b) ours, plain — ``Featurizer(fast=False)``: VAE once per image, prompts encoded once,
    ONE UNet call per batch of B images x P prompts, stock UNet modules.
(c) ours — ``Featurizer()``: (b) plus the exact shortcuts (shared-prompt cross-attention,
    prompt-independent prefix run once per image, oneDNN linear/GEGLU on CPU).

All three outputs must agree (allclose); prints images/s of each and the ratios, timed
batch by batch in rotating order (load from other processes hits all alike), then a
cost breakdown: what one naive call costs (text encoder, VAE, UNet on ONE row) against
what one row of our batched call costs -- the ratio can never exceed their quotient.
``--warm-cache`` adds (d): features read back from ``diffusion/cache.py``'s store
(filled once, then read by a fresh extractor that never loads the teacher).

``--model sd21-random`` builds a RANDOM-weight model with the architecture of SD-2.1
(UNet 865 M parameters, VAE encoder, 23-layer 1024-wide text encoder) in memory, so that
the cost of an SD-2.1-sized teacher can be measured on a machine with no weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from feddifrc_app.diffusion.featurizer import Featurizer, noise_seed, to_unit_range  # noqa: E402
from feddifrc_app.diffusion.pipeline import Teacher, load_teacher, resolve_device, resolve_dtype  # noqa: E402

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# The published SD-2.1 (768-v) component configs, for --model sd21-random.
SD21_UNET = dict(
    sample_size=96, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True,
    upcast_attention=True, norm_num_groups=32,
)
SD21_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32, sample_size=768,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
SD21_TEXT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
                 max_position_embeddings=77, projection_dim=512, hidden_act="gelu")


def sd21_random_teacher(cache_dir: Path, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Teacher:
    """A RANDOM-weight teacher with SD-2.1's architecture, built in memory (timing only).

    The tokenizer is the tiny model's (the vocabulary size does not change the cost).
    """
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from feddifrc_app.diffusion.pipeline import SD_SCHEDULER

    tok = load_teacher("tiny", cache_dir, torch.device("cpu"), torch.float32).tokenizer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**SD21_UNET)
        vae = AutoencoderKL(**SD21_VAE)
        text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SD21_TEXT))
    vae.decoder = None
    vae.post_quant_conv = None
    for m in (unet, vae, text):
        m.requires_grad_(False)
        m.eval()
        m.to(device, dtype)
    alphas = PNDMScheduler(**SD_SCHEDULER).alphas_cumprod.to("cpu", torch.float32)
    return Teacher(unet=unet, vae=vae, text_encoder=text, tokenizer=tok, alphas_cumprod=alphas,
                   model_id=f"sd21-random-seed{seed}", weights_hash="random", random_weights=True, device=device,
                   dtype=dtype, text_width=SD21_TEXT["hidden_size"],
                   block_channels=tuple(int(b.resnets[-1].out_channels) for b in unet.up_blocks))


def digits_images(n: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.repeat(d.images[:n, None], 3, axis=1)  # (n, 3, 8, 8), values 0..16
    return torch.from_numpy(np.round(x * (255.0 / 16.0)).astype(np.uint8))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def naive(teacher: Teacher, images: torch.Tensor, ids: torch.Tensor, prompts: tuple[str, ...], *,
          resolution: int, timestep: int, blocks: tuple[int, ...], ensemble: int, seed: int) -> dict[int, torch.Tensor]:
    """One full UNet call per (image, prompt); VAE and text encoder re-run every call."""
    t = teacher
    a = float(t.alphas_cumprod[timestep].double())
    sa, s1a = a**0.5, (1.0 - a) ** 0.5
    f = t.vae_scale_factor
    shape = (t.latent_channels, resolution // f, resolution // f)
    out = {b: torch.zeros(len(images), len(prompts), t.block_channels[b]) for b in blocks}
    grabbed: dict[int, torch.Tensor] = {}

    def hook_for(b: int):
        def hook(_m, _i, o):
            grabbed[b] = (o[0] if isinstance(o, tuple) else o).mean(dim=(2, 3), dtype=torch.float32)

        return hook

    handles = [t.unet.up_blocks[b].register_forward_hook(hook_for(b)) for b in blocks]
    g = torch.Generator(device="cpu")
    try:
        for i in range(len(images)):
            for p, prompt in enumerate(prompts):
                tok = t.tokenizer([prompt], padding="max_length", max_length=t.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids.to(t.device)
                emb = t.text_encoder(tok)[0].to(t.dtype)
                x = to_unit_range(images[i : i + 1].to(t.device), resolution).to(t.dtype)
                l0 = t.vae.encode(x).latent_dist.mean.float() * float(t.vae.config.scaling_factor)
                for draw in range(ensemble):
                    g.manual_seed(noise_seed(seed, int(ids[i]), draw))
                    eps = torch.randn(shape, generator=g)[None].to(t.device)
                    lt = (sa * l0 + s1a * eps).to(t.dtype)
                    t.unet(lt, torch.tensor(timestep, device=t.device), encoder_hidden_states=emb)
                    for b in blocks:
                        out[b][i, p] += grabbed[b][0].cpu() / ensemble
    finally:
        for h in handles:
            h.remove()
    return out


def ours(feat: Featurizer, images: torch.Tensor, ids: torch.Tensor, prompts: tuple[str, ...],
         batch: int) -> dict[int, torch.Tensor]:
    parts: dict[int, list[torch.Tensor]] = {b: [] for b in feat.blocks}
    for s in range(0, len(images), batch):
        got = feat(images[s : s + batch], ids[s : s + batch], prompts)
        for b in feat.blocks:
            parts[b].append(got[b])
    return {b: torch.cat(v) for b, v in parts.items()}


def timed(fn, device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | a local diffusers folder | a hub id (cached)")
    ap.add_argument("--resolution", type=int, default=None, help="SD input size (default: 16 tiny, 224 else)")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--naive-images", type=int, default=None,
                    help="images for the naive pass (default: all); throughput is per image either way")
    ap.add_argument("--batch-size", type=int, default=16, help="images per UNet call (ours)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--timestep", type=int, default=300)
    ap.add_argument("--blocks", default="1,2,3")
    ap.add_argument("--ensemble", type=int, default=1)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cache-dir", default="~/.cache/feddifrc", help="where 'tiny' is built / found")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--warm-cache", action="store_true", help="also time reads from the on-disk feature cache")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    res = args.resolution or (16 if args.model.startswith("tiny") else 224)
    blocks = tuple(int(b) for b in args.blocks.split(","))
    prompts = tuple(f"a photo of a {c}" for c in DIGITS) + ("",)
    images = digits_images(args.images)
    ids = torch.arange(len(images), dtype=torch.int64)
    n_naive = min(args.naive_images or len(images), len(images))

    t0 = time.perf_counter()
    teacher = load_teacher(args.model, Path(args.cache_dir).expanduser(), device, dtype)
    print(f"teacher {teacher.model_id} (weights {teacher.weights_hash[:12]}"
          f"{', RANDOM' if teacher.random_weights else ''}) on {device} {str(dtype).removeprefix('torch.')}, "
          f"loaded in {time.perf_counter() - t0:.1f}s; up_blocks channels {teacher.block_channels}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(images)} images x {len(prompts)} "
          f"prompts at {res} px, t={args.timestep}, blocks {blocks}, ensemble {args.ensemble}, "
          f"batch {args.batch_size} images = {args.batch_size * len(prompts)} UNet rows")

    feat = Featurizer(teacher, resolution=res, timestep=args.timestep, blocks=blocks,
                      ensemble=args.ensemble, seed=args.seed)
    kw = dict(resolution=res, timestep=args.timestep, blocks=blocks, ensemble=args.ensemble, seed=args.seed)
    # warm-up both paths (allocator, oneDNN/cuDNN kernel selection) outside the clock
    naive(teacher, images[:1], ids[:1], prompts[:2], **kw)
    ours(feat, images[: args.batch_size], ids[: args.batch_size], prompts, args.batch_size)

    # Interleave the two, one batch of images at a time, so that load from other processes on
    # a shared machine hits both alike; the ratio is also reported per batch.
    B = args.batch_size
    got_parts: dict[int, list[torch.Tensor]] = {b: [] for b in blocks}
    ref_parts: dict[int, list[torch.Tensor]] = {b: [] for b in blocks}
    t_ours = t_naive = 0.0
    ratios = []
    for k, s in enumerate(range(0, len(images), B)):
        sl = slice(s, s + B)
        m = max(0, min(B, n_naive - s))
        run_ours = lambda: ours(feat, images[sl], ids[sl], prompts, B)  # noqa: E731
        run_naive = lambda: naive(teacher, images[s : s + m], ids[s : s + m], prompts, **kw)  # noqa: E731
        if k % 2:
            (r, tn), (g, to) = timed(run_naive, device) if m else (None, 0.0), timed(run_ours, device)
        else:
            (g, to), (r, tn) = timed(run_ours, device), timed(run_naive, device) if m else (None, 0.0)
        t_ours += to
        t_naive += tn
        for b in blocks:
            got_parts[b].append(g[b])
            if m:
                ref_parts[b].append(r[b])
        if m:
            ratios.append((tn / m) / (to / len(images[sl])))
    got = {b: torch.cat(v) for b, v in got_parts.items()}
    ref = {b: torch.cat(v) for b, v in ref_parts.items()}

    # Batch size changes the float reduction order (one row vs B x P rows): compare with a
    # tolerance, elementwise (allclose) and overall (relative L2 error).
    fp32 = dtype == torch.float32
    tol = dict(atol=5e-3, rtol=1e-2) if fp32 else dict(atol=5e-2, rtol=5e-2)
    max_rel = 1e-3 if fp32 else 3e-2
    worst, worst_rel = 0.0, 0.0
    for b in blocks:
        a, r = got[b][:n_naive], ref[b]
        diff, rel = float((a - r).abs().max()), float((a - r).norm() / r.norm().clamp_min(1e-12))
        worst, worst_rel = max(worst, diff), max(worst_rel, rel)
        if not torch.allclose(a, r, **tol) or rel > max_rel:
            print(f"MISMATCH block {b}: max |diff| {diff:.3g}, relative L2 error {rel:.3g}")
            return 1
    ips_naive, ips_ours = n_naive / t_naive, len(images) / t_ours
    print(f"outputs agree over {n_naive} images: max |ours - naive| = {worst:.2e}, "
          f"relative L2 error {worst_rel:.1e}")
    print(f"(a) naive  per (image, prompt) call: {ips_naive:9.2f} images/s  ({t_naive:.2f}s for {n_naive})")
    print(f"(b) ours   batched Featurizer:       {ips_ours:9.2f} images/s  ({t_ours:.2f}s for {len(images)})")
    print(f"ratio ours / naive: {ips_ours / ips_naive:.1f}x  (per batch of {B}: min {min(ratios):.1f}x, "
          f"median {float(np.median(ratios)):.1f}x, max {max(ratios):.1f}x)")

    if args.warm_cache:
        warm_cache(args, teacher, feat, images, ids, prompts, got, ips_naive, device)
    return 0


def warm_cache(args, teacher: Teacher, feat: Featurizer, images, ids, prompts, got, ips_naive, device) -> None:
    from feddifrc_app.diffusion.cache import FeatureStore, LazyExtractor, cached_pooled_features, key_fields
    from feddifrc_app.diffusion.cache import key_from_fields

    fields = key_fields(model_id=teacher.model_id, weights_hash=teacher.weights_hash, resolution=feat.resolution,
                        timestep=feat.timestep, blocks=feat.blocks, prompts=prompts, seed=feat.seed,
                        ensemble=feat.ensemble, dataset_fingerprint=f"sklearn-digits-first-{len(images)}",
                        dtype=str(teacher.dtype))
    key = key_from_fields(fields)
    with tempfile.TemporaryDirectory() as tmp:
        store = FeatureStore(Path(tmp) / "features")
        npids = ids.numpy()

        def extractor() -> LazyExtractor:
            return LazyExtractor(lambda: feat, lambda i: images[torch.as_tensor(i)], prompts, args.batch_size)

        cold = extractor()
        (_, s_cold), t_cold = timed(lambda: cached_pooled_features(store, key, npids, cold), device)
        fresh = extractor()  # as in a new process: the teacher would not even be loaded
        (warm, s_warm), t_warm = timed(lambda: cached_pooled_features(store, key, npids, fresh), device)
        assert s_warm.hits == len(images) and s_warm.misses == 0 and not fresh.loaded
        worst = max(float((torch.from_numpy(warm[b]) - got[b]).abs().max()) for b in feat.blocks)
        ips_warm = len(images) / t_warm
        print(f"(c) cache  cold fill (extract + write): {len(images) / t_cold:9.2f} images/s")
        print(f"(c) cache  warm read (teacher not loaded): {ips_warm:9.2f} images/s; "
              f"max |cached - ours| = {worst:.2e} (float16 storage)")
        print(f"ratio warm cache / naive: {ips_warm / ips_naive:.0f}x")


if __name__ == "__main__":
    raise SystemExit(main())
