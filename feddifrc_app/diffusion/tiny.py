"""The embedded tiny teacher: a seeded, RANDOM-weight Stable Diffusion pipeline built offline.

``build_tiny_pipeline`` writes a diffusers ``StableDiffusionPipeline`` folder (~68 MB,
16.6 M parameters) with SD's structure, its own byte-level BPE tokenizer and SD's noise
schedule. It is the offline default teacher of tests and smoke runs: it carries no
pretrained knowledge and says so (``feddifrc.json``, ``README.md``). Its text side is
shared with ``feddifrc pretrain-teacher`` (``tiny_text_encoder``, ``save_tiny_pipeline``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from itertools import pairwise
from pathlib import Path

import torch

from feddifrc_app.files import atomic_folder

TINY_PREFIX = "tiny"
TINY_RESOLUTION = 16
MARKER = "feddifrc.json"  # what feddifrc wrote into a teacher folder (kind, seed, file checksums)
_KIND = "feddifrc-tiny-sd"

# up_blocks are block_out_channels reversed: (64, 256, 128, 128), so up_blocks[1], [2], [3]
# cover the default PCA widths 256/128/128 (sum 512 = the ResNet-10 width).
TINY_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(128, 128, 256, 64),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=2,  # diffusers' legacy name: the number of heads
    use_linear_projection=True,
    norm_num_groups=32,
)
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),  # one downsample: factor 2
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=16,
)
TINY_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    projection_dim=32,
    hidden_act="quick_gelu",
)
SD_SCHEDULER = dict(  # Stable Diffusion's scaled_linear schedule
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    skip_prk_steps=True,
    steps_offset=1,
    set_alpha_to_one=False,
)

# Words the app prompts with (templates, digits, CIFAR-10/100, SSL prompts) plus a little
# English, so that common prompts become few tokens. Order does not matter.
_TINY_CORPUS = (
    "a photo of a {} . a photo of a similar object . a photo of a visual object . an image of the "
    "zero one two three four five six seven eight nine 0 1 2 3 4 5 6 7 8 9 digit number handwritten "
    "airplane automobile bird cat deer dog frog horse ship truck "
    "apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus butterfly "
    "camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile "
    "cup dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo keyboard lamp "
    "lawn_mower leopard lion lizard lobster man maple_tree motorcycle mountain mouse mushroom "
    "oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain plate poppy porcupine "
    "possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper snail snake "
    "spider squirrel streetcar sunflower sweet_pepper table tank telephone television tiger tractor "
    "train trout tulip turtle wardrobe whale willow_tree wolf woman worm "
    "and in on with the is at picture small large red green blue black white"
)
_WORD_RE = re.compile(r"[^\W\d_]+|\d|[^\s\w]+|_", re.UNICODE)


@contextlib.contextmanager
def quiet():
    """Silence diffusers/transformers progress bars while loading/saving; restore them after."""
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    was = dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            dlog.enable_progress_bar()
        if was[1]:
            tlog.enable_progress_bar()


def tiny_name(seed: int) -> str:
    return f"{TINY_PREFIX}-seed{seed}"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP's reversible byte -> printable unicode map."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = [b for b in range(256) if b not in bs]
    bs += extra
    cs += [256 + n for n in range(len(extra))]
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _merge_pair(syms: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(syms):
        if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
            out.append(syms[i] + syms[i + 1])
            i += 2
        else:
            out.append(syms[i])
            i += 1
    return tuple(out)


def _tiny_bpe(max_merges: int = 1200) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP-style byte-level BPE vocab and merges learnt from ``_TINY_CORPUS``, deterministically.

    CLIP's layout: 256 byte symbols, the same with ``</w>``, one token per merge, then
    ``<|startoftext|>``, ``<|endoftext|>``.
    """
    b2u = _bytes_to_unicode()
    words: Counter[tuple[str, ...]] = Counter()
    for w in _WORD_RE.findall(_TINY_CORPUS.lower()):
        syms = [b2u[b] for b in w.encode("utf-8")]
        syms[-1] += "</w>"
        words[tuple(syms)] += 1
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for syms, f in words.items():
            for a, b in pairwise(syms):
                pairs[(a, b)] += f
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, ties lexicographic
        merges.append(best)
        new: Counter[tuple[str, ...]] = Counter()
        for syms, f in words.items():
            new[_merge_pair(syms, best)] += f
        words = new
    base = list(b2u.values())
    tokens = [
        *base,
        *(t + "</w>" for t in base),
        *("".join(m) for m in merges),
        "<|startoftext|>",
        "<|endoftext|>",
    ]
    vocab: dict[str, int] = {}
    for t in tokens:
        vocab.setdefault(t, len(vocab))
    return vocab, merges


def tiny_text_encoder(seed: int):
    """(CLIPTokenizer over ``_TINY_CORPUS``, seeded random tiny CLIPTextModel): the text side of
    both tiny teachers. Every word the app prompts with is one token."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab, merges = _tiny_bpe()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    eos = vocab["<|endoftext|>"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = CLIPTextConfig(
            vocab_size=len(vocab),
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=eos,
            pad_token_id=eos,
            **TINY_TEXT,
        )
        text_encoder = CLIPTextModel(config)
    return tokenizer, text_encoder


def save_tiny_pipeline(pipe, folder: Path) -> None:
    """``pipe.save_pretrained`` (safetensors) of a pipeline with the tiny tokenizer, plus the
    vocab.json/merges.txt pair that SD hub folders ship, so that transformers' slow
    CLIPTokenizer loads the folder too."""
    with quiet():
        pipe.save_pretrained(folder, safe_serialization=True)
    vocab, merges = _tiny_bpe()
    tok_dir = folder / "tokenizer"
    (tok_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_txt = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (tok_dir / "merges.txt").write_text(merges_txt, encoding="utf-8")


_CARD = """# {name}: tiny Stable-Diffusion-architecture pipeline, RANDOM WEIGHTS

Built offline by feddifrc_app.diffusion.tiny.build_tiny_pipeline (seeded, byte-identical
on rebuild). It has the structure of SD (UNet2DConditionModel with 4 down / 4 up blocks and
cross-attention, AutoencoderKL, CLIP text encoder, byte-level BPE tokenizer, SD's
scaled_linear noise schedule) but carries NO pretrained knowledge: features from it are
only useful to test the plumbing. Never report results obtained with it as FedDifRC.
"""


def _write_tiny(folder: Path, seed: int) -> None:
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**TINY_UNET)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKL(**TINY_VAE)
    tokenizer, text_encoder = tiny_text_encoder(seed + 2)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=PNDMScheduler(**SD_SCHEDULER),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    save_tiny_pipeline(pipe, folder)
    marker = {
        "kind": _KIND,
        "model_id": tiny_name(seed),
        "seed": seed,
        "random_weights": True,
        "resolution": TINY_RESOLUTION,
        "note": "RANDOM weights, SD architecture only: no pretrained knowledge. For tests and smoke runs.",
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    (folder / "README.md").write_text(_CARD.format(name=tiny_name(seed)))


def _is_complete_tiny(folder: Path, seed: int) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("seed") == seed and marker.get("kind") == _KIND and (folder / "model_index.json").is_file()
    )


class _AlreadyBuilt(Exception):
    """A concurrent builder finished first: keep its (byte-identical) folder."""


def build_tiny_pipeline(path: Path, seed: int = 0) -> Path:
    """Write the seeded tiny random-weight SD pipeline to ``path`` (diffusers folder format).

    Built in a temporary sibling folder and swapped into place whole. A complete tiny
    pipeline of this seed already at ``path`` (built earlier, or by a concurrent builder
    meanwhile) is kept as is. Rebuilding with the same seed gives byte-identical files.
    """
    path = Path(path).expanduser().resolve()
    if _is_complete_tiny(path, seed):
        return path
    with contextlib.suppress(_AlreadyBuilt), atomic_folder(path) as tmp:
        _write_tiny(tmp, seed)
        if _is_complete_tiny(path, seed):
            raise _AlreadyBuilt
    return path
