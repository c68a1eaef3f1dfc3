"""The frozen Stable Diffusion teacher: device/dtype choice, loading, the embedded tiny model.

``load_teacher`` loads any diffusers Stable Diffusion pipeline (a hub id, a local
diffusers folder, or ``"tiny"``) once per process and keeps only what feature
extraction needs: the UNet, the VAE *encoder*, the text encoder and tokenizer, and
the noise schedule. Every parameter is frozen (``requires_grad_(False)``, ``.eval()``).
Nothing here ever falls back silently: a missing model or a missing CUDA device is a
``TeacherLoadError`` with one actionable line.

``build_tiny_pipeline`` writes a seeded, RANDOM-weight, SD-architecture pipeline in
diffusers folder format (~68 MB, 16.6 M parameters: the 256-wide up_blocks[1] the default
PCA widths need dominates). It is the offline default teacher for tests and
smoke runs; it carries no pretrained knowledge and is marked so (``feddifrc.json``,
``README.md`` in the folder, ``Teacher.random_weights``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TeacherLoadError",
    "Teacher",
    "TeacherIdentity",
    "teacher_identity",
    "teacher_resolution",
    "resolve_device",
    "resolve_dtype",
    "build_tiny_pipeline",
    "folder_digests",
    "packaged_teacher_dir",
    "verify_folder",
    "PACKAGED_TEACHERS",
    "PRETRAINED_KIND",
    "load_teacher",
    "weights_hash",
    "TINY_PREFIX",
]

TINY_PREFIX = "tiny"
_MARKER = "feddifrc.json"
_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
_WEIGHT_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".onnx", ".h5", ".pb")
_MIN_VOCAB = 100


class TeacherLoadError(RuntimeError):
    """The diffusion teacher (or its device) is unavailable; the message says how to provide it."""


# --------------------------------------------------------------------------- device / dtype


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; ``cpu``; ``cuda``/``cuda:N`` (an error without CUDA)."""
    n = str(name).strip().lower()
    if n == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if n == "cpu":
        return torch.device("cpu")
    if n == "cuda" or n.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise TeacherLoadError(
                f"diffusion device '{name}' requested but torch {torch.__version__} sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); "
                "set diffusion.device = 'cpu' or 'auto', or give the ClientApp a GPU "
                "(client-resources-num-gpus > 0)"
            )
        dev = torch.device(n)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TeacherLoadError(
                f"diffusion device '{name}' requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        return dev
    raise TeacherLoadError(f"unknown diffusion device '{name}': expected auto, cpu or cuda")


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> float16 on CUDA, float32 on CPU; else float32 / float16 / bfloat16."""
    n = str(name).strip().lower()
    if n == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if n in _DTYPES:
        return _DTYPES[n]
    raise TeacherLoadError(f"unknown diffusion dtype '{name}': expected auto, float32, float16 or bfloat16")


# --------------------------------------------------------------------------- the teacher


@dataclass(frozen=True, eq=False)
class Teacher:
    """A loaded, frozen SD teacher. Hashable by identity (one per process per key)."""

    unet: Any  # diffusers UNet2DConditionModel
    vae: Any  # diffusers AutoencoderKL, decoder dropped (encode only)
    text_encoder: Any  # transformers CLIPTextModel
    tokenizer: Any  # transformers CLIPTokenizer
    alphas_cumprod: torch.Tensor  # (T,) float32 on CPU, from the pipeline's scheduler
    model_id: str  # "tiny-seed0" / hub id / absolute folder
    weights_hash: str  # sha256 over the content of the loaded component files
    random_weights: bool  # True for the embedded tiny model: label results accordingly
    device: torch.device
    dtype: torch.dtype
    text_width: int  # text encoder hidden size (width of prompt token embeddings)
    block_channels: tuple[int, ...]  # output channels of unet.up_blocks[0..]

    @property
    def vae_scale_factor(self) -> int:
        """Pixel -> latent downsampling factor of the VAE encoder."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.latent_channels)


# --------------------------------------------------------------------------- tiny builder


@contextlib.contextmanager
def _quiet():
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


def _tiny_name(seed: int) -> str:
    return f"{TINY_PREFIX}-seed{seed}"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP reversible byte -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


# Words the app actually prompts with (templates, digits, CIFAR-10/100, SSL prompts) plus
# a little English, so that common prompts become few tokens. Order does not matter.
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


def _tiny_bpe(max_merges: int = 1200) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Build a CLIP-style byte-level BPE vocab and merges from ``_TINY_CORPUS``, deterministically.

    Layout follows CLIP's: 256 byte symbols, the same with ``</w>``, one token per merge,
    then ``<|startoftext|>``, ``<|endoftext|>``.
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
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] += f
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, ties lexicographic
        merges.append(best)
        new: Counter[tuple[str, ...]] = Counter()
        for syms, f in words.items():
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            new[tuple(out)] += f
        words = new
    base = list(b2u.values())
    tokens = base + [t + "</w>" for t in base] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {}
    for t in tokens:
        vocab.setdefault(t, len(vocab))
    return vocab, merges


# The tiny architecture. up_blocks are block_out_channels reversed: (64, 256, 128, 128), so
# up_blocks[1], [2], [3] cover the default PCA widths 256/128/128 (sum 512 = ResNet-10 width).
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
SD_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    skip_prk_steps=True,
    steps_offset=1,
    set_alpha_to_one=False,
)
TINY_RESOLUTION = 16


def tiny_text_encoder(seed: int):
    """(CLIPTokenizer over ``_TINY_CORPUS``, seeded random tiny CLIPTextModel): the text side of
    both tiny teachers. Every word the app prompts with is one token."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab, merges = _tiny_bpe()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(vocab),
                bos_token_id=vocab["<|startoftext|>"],
                eos_token_id=vocab["<|endoftext|>"],
                pad_token_id=vocab["<|endoftext|>"],
                **TINY_TEXT,
            )
        )
    return tokenizer, text_encoder


def save_tiny_pipeline(pipe, folder: Path) -> None:
    """``pipe.save_pretrained`` (safetensors) of a pipeline with the tiny tokenizer, plus the classic
    vocab.json/merges.txt pair that SD hub folders ship, so that the slow CLIPTokenizer of
    transformers 4.x loads the folder too."""
    with _quiet():
        pipe.save_pretrained(folder, safe_serialization=True)
    tok_dir = folder / "tokenizer"
    vocab, merges = _tiny_bpe()
    (tok_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (tok_dir / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )


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
        "kind": "feddifrc-tiny-sd",
        "model_id": _tiny_name(seed),
        "seed": seed,
        "random_weights": True,
        "resolution": TINY_RESOLUTION,
        "note": "RANDOM weights, SD architecture only: no pretrained knowledge. For tests and smoke runs.",
    }
    (folder / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    (folder / "README.md").write_text(
        f"# {_tiny_name(seed)}: tiny Stable-Diffusion-architecture pipeline, RANDOM WEIGHTS\n\n"
        "Built offline by feddifrc_app.diffusion.pipeline.build_tiny_pipeline (seeded, byte-identical\n"
        "on rebuild). It has the structure of SD (UNet2DConditionModel with 4 down / 4 up blocks and\n"
        "cross-attention, AutoencoderKL, CLIP text encoder, byte-level BPE tokenizer, SD's\n"
        "scaled_linear noise schedule) but carries NO pretrained knowledge: features from it are\n"
        "only useful to test the plumbing. Never report results obtained with it as FedDifRC.\n"
    )


def _is_complete_tiny(folder: Path, seed: int) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("seed") == seed and marker.get("kind") == "feddifrc-tiny-sd" and (
        folder / "model_index.json"
    ).is_file()


def build_tiny_pipeline(path: Path, seed: int = 0) -> Path:
    """Write the seeded tiny random-weight SD pipeline to ``path`` (diffusers folder format).

    Atomic: built in a temporary sibling folder, then renamed into place. If ``path``
    already holds a complete tiny pipeline of this seed it is kept as is. Rebuilding with
    the same seed gives byte-identical files.
    """
    path = Path(path).expanduser().resolve()
    if _is_complete_tiny(path, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_tiny(tmp, seed)
        try:
            os.replace(tmp, path)
        except OSError:
            # path exists and is not empty: a concurrent builder won, or stale content.
            if _is_complete_tiny(path, seed):
                return path
            trash = path.parent / f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(path, trash)
            os.replace(tmp, path)
            shutil.rmtree(trash, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# --------------------------------------------------------------------------- weights hash


def _file_digest(p: Path, memo: dict[str, str] | None = None) -> str:
    """sha256 of a file's content. Hub-cache LFS blobs are named by that sha256: reuse it.

    ``memo`` maps "realpath|size|mtime_ns" to a digest computed earlier: in deployment every
    message is a new process, and re-reading a 5 GB local SD folder each time would cost more
    than the round itself.
    """
    if p.is_symlink():
        target = Path(os.path.realpath(p))
        if re.fullmatch(r"[0-9a-f]{64}", target.name) and target.parent.name == "blobs":
            return target.name
    if memo is not None:
        st = p.stat()
        tag = f"{os.path.realpath(p)}|{st.st_size}|{st.st_mtime_ns}"
        if tag not in memo:
            memo[tag] = _file_digest(p)
        return memo[tag]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_variant(name: str) -> bool:
    """name.fp16.safetensors / name.fp16-00001-of-00002.safetensors are variant weights."""
    stem = name.rsplit(".", 1)[0]
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem)
    return "." in stem


def _loaded_files(folder: Path) -> list[Path]:
    """The files of a diffusers SD folder that loading reads: model_index.json, and per component
    its configs/tokenizer files plus its non-variant weights (safetensors preferred)."""
    files = [folder / "model_index.json"]
    for comp in _COMPONENTS:
        d = folder / comp
        if not d.is_dir():
            continue
        entries = sorted(p for p in d.iterdir() if p.is_file())
        weights = [p for p in entries if p.name.endswith(_WEIGHT_EXTS)]
        other = [p for p in entries if p not in weights]
        plain = [p for p in weights if not _is_variant(p.name)]
        if any(p.name.endswith(".safetensors") for p in plain):
            plain = [p for p in plain if p.name.endswith(".safetensors")]
        files += other + plain
    return [p for p in files if p.is_file()]


def weights_hash(folder: Path, memo_file: Path | None = None) -> str:
    """sha256 over (relative path, content sha256) of every file loading reads. Content-defined:
    a hub snapshot and a plain copy of it hash the same. ``memo_file`` (JSON) remembers file
    digests by (path, size, mtime) across processes; it is rewritten atomically."""
    folder = Path(folder)
    memo: dict[str, str] | None = None
    if memo_file is not None:
        try:
            memo = json.loads(memo_file.read_text()) if memo_file.is_file() else {}
            if not isinstance(memo, dict):
                memo = {}
        except (OSError, ValueError):
            memo = {}  # unreadable memo: recompute (and rewrite it below)
        before = dict(memo)
    h = hashlib.sha256()
    for p in _loaded_files(folder):
        h.update(f"{p.relative_to(folder).as_posix()}\0{_file_digest(p, memo)}\n".encode())
    if memo_file is not None and memo != before:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_name(f".{memo_file.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_file)
    return h.hexdigest()


# --------------------------------------------------------------------------- loading


def _one_line(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split())
    if len(msg) > limit:
        msg = msg[: limit - 3] + "..."
    return f"{type(e).__name__}: {msg}"


def _hf_offline() -> bool:
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        import huggingface_hub

        return env or bool(huggingface_hub.is_offline_mode())
    except Exception:  # pragma: no cover - very old huggingface_hub
        return env


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "~", ".", "\\")) or os.path.isabs(model) or Path(model).exists()


PRETRAINED_KIND = "feddifrc-pretrained-tiny-sd"  # feddifrc.json "kind" of `feddifrc pretrain-teacher` folders

# Teachers shipped inside the package (feddifrc_app/teachers/<name>/), by diffusion.model name;
# each is the output of `feddifrc pretrain-teacher` (seed 0).
PACKAGED_TEACHERS: tuple[str, ...] = ("tiny-mnist",)


def _installed_package_dir() -> Path:
    """``feddifrc_app/`` of the INSTALLED distribution (site-packages, or the checkout of an
    editable install). Not ``__file__``: Flower runs the app from an unpacked FAB, which
    carries text files only, so packaged weights are never next to the running code."""
    import urllib.parse
    from importlib import metadata

    try:
        dist = metadata.distribution("feddifrc-app")
    except metadata.PackageNotFoundError:
        return Path(__file__).resolve().parents[1]  # a source tree used without installing it
    direct = dist.read_text("direct_url.json")
    if direct:
        info = json.loads(direct)
        if info.get("dir_info", {}).get("editable"):  # PEP 610: the project folder
            return (Path(urllib.parse.unquote(urllib.parse.urlparse(info["url"]).path)) / "feddifrc_app").resolve()
    return Path(str(dist.locate_file("feddifrc_app"))).resolve()


def packaged_teacher_dir(name: str) -> tuple[Path, dict[str, Any]]:
    """(folder, marker) of a teacher shipped in the package (``PACKAGED_TEACHERS``), files verified."""
    folder = _installed_package_dir() / "teachers" / name
    return folder, verify_folder(folder)


def folder_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a pipeline folder but the marker and the card (relative posix paths)."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): _file_digest(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in (_MARKER, "README.md")}


def verify_folder(folder: Path) -> dict[str, Any]:
    """Check the files of a ``feddifrc pretrain-teacher`` folder against the sha256 sums in its
    ``feddifrc.json`` and return that marker. Every file loading reads must be listed; a
    missing, truncated or altered one is a one-line ``TeacherLoadError`` naming it, never a load."""
    how = f"rebuild it with `feddifrc pretrain-teacher --out {folder}` or reinstall feddifrc-app"
    try:
        marker = json.loads((folder / _MARKER).read_text())
        files = marker["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no file checksums")
    except (OSError, ValueError, KeyError, TypeError):
        raise TeacherLoadError(f"teacher folder {folder} has no readable {_MARKER} with file checksums; {how}") from None
    unlisted = [p.relative_to(folder).as_posix() for p in _loaded_files(folder)
                if p.relative_to(folder).as_posix() not in files]
    if unlisted:
        raise TeacherLoadError(f"teacher file {folder / unlisted[0]} is not covered by the checksums in "
                               f"{folder / _MARKER}; {how}")
    for rel, digest in sorted(files.items()):
        p = folder / rel
        if not p.is_file():
            raise TeacherLoadError(f"teacher file {p} is missing; {how}")
        try:
            ok = _file_digest(p) == digest
        except OSError as e:
            raise TeacherLoadError(f"teacher file {p} cannot be read ({_one_line(e, 120)}); {how}") from None
        if not ok:
            raise TeacherLoadError(f"teacher file {p} is corrupt (its sha256 does not match {_MARKER}); {how}")
    return marker


def _resolve_folder(model: str, cache_dir: Path) -> tuple[Path, str, bool]:
    """model -> (local diffusers folder, model_id, random_weights). Builds tiny on first use;
    finds packaged teachers in the installed package; fetches hub ids from the HF cache (or
    the hub when online)."""
    if model in PACKAGED_TEACHERS:
        folder, marker = packaged_teacher_dir(model)
        return folder, model, bool(marker.get("random_weights"))
    m = re.fullmatch(rf"{TINY_PREFIX}(?:-seed(\d+))?", model)
    if m:
        seed = int(m.group(1) or 0)
        name = _tiny_name(seed)
        return build_tiny_pipeline(cache_dir / "models" / name, seed), name, True
    if _looks_like_path(model):
        folder = Path(model).expanduser().resolve()
        if not folder.is_dir():
            raise TeacherLoadError(
                f"diffusion model folder '{folder}' does not exist; set diffusion.model to a diffusers "
                "Stable Diffusion folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/, "
                "scheduler/ as written by StableDiffusionPipeline.save_pretrained), a cached hub id, or 'tiny-mnist'"
            )
        if not (folder / "model_index.json").is_file():
            raise TeacherLoadError(
                f"diffusion model folder '{folder}' has no model_index.json: it is not a diffusers pipeline "
                "folder; save one with StableDiffusionPipeline.save_pretrained(folder) or copy a hub snapshot"
            )
        marker = _read_marker(folder)
        if marker.get("kind") == PRETRAINED_KIND:  # written by `feddifrc pretrain-teacher`: verify it
            verify_folder(folder)
        return folder, str(folder), bool(marker.get("random_weights", False))
    # a hub id
    from diffusers import DiffusionPipeline

    kw = dict(safety_checker=None, feature_extractor=None, use_safetensors=None)
    try:
        folder = DiffusionPipeline.download(model, local_files_only=True, **kw)
    except Exception:
        if _hf_offline():
            raise TeacherLoadError(
                f"diffusion model '{model}' is not in the Hugging Face cache {_hf_cache_dir()} and "
                f"HF_HUB_OFFLINE is set; on a machine with internet run `hf download {model}` and copy "
                "that cache here (or point HF_HOME at it), or set diffusion.model to a local diffusers "
                "folder or 'tiny-mnist'"
            ) from None
        try:
            folder = DiffusionPipeline.download(model, **kw)
        except Exception as e:
            raise TeacherLoadError(
                f"diffusion model '{model}' is not in the Hugging Face cache {_hf_cache_dir()} and could "
                f"not be downloaded ({_one_line(e, 160)}); check the id and the network (gated models "
                "need `hf auth login`), copy a cache made with `hf download` here, or set "
                "diffusion.model to a local diffusers folder or 'tiny-mnist'"
            ) from None
    return Path(folder), model, False


def _read_marker(folder: Path) -> dict[str, Any]:
    """The folder's ``feddifrc.json`` ({} when it has none); an unreadable one is an error, since
    it may be what says the weights are random or must be verified."""
    path = folder / _MARKER
    if not path.exists():
        return {}
    try:
        m = json.loads(path.read_text())
        if not isinstance(m, dict):
            raise ValueError("not a JSON object")
        return m
    except (OSError, ValueError) as e:
        raise TeacherLoadError(f"teacher folder {folder}: {path.name} is unreadable ({_one_line(e, 120)}); "
                               "restore it or rebuild the folder") from None


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover
        return "~/.cache/huggingface/hub"


def _from_pretrained(folder: Path, model: str, dtype: torch.dtype):
    from diffusers import StableDiffusionPipeline

    kw: dict[str, Any] = dict(
        torch_dtype=dtype,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        local_files_only=True,
    )
    try:
        import accelerate  # noqa: F401
    except ImportError:
        kw["low_cpu_mem_usage"] = False  # no accelerate: avoid diffusers' warning
    try:
        with _quiet(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch_dtype.*", category=FutureWarning)
            return StableDiffusionPipeline.from_pretrained(str(folder), **kw)
    except Exception as e:
        raise TeacherLoadError(
            f"diffusion model '{model}' found at '{folder}' but could not be loaded as a Stable Diffusion "
            f"pipeline ({_one_line(e)}); re-download it or rebuild the folder with "
            "StableDiffusionPipeline.save_pretrained"
        ) from None


@dataclass(frozen=True)
class TeacherIdentity:
    """What identifies a teacher's weights, known without building any network."""

    model_id: str
    weights_hash: str
    random_weights: bool
    folder: Path  # the local diffusers folder the weights are read from


def teacher_identity(model: str, cache_dir: Path) -> TeacherIdentity:
    """``(model_id, weights_hash, random_weights, folder)`` of ``model`` WITHOUT loading it.

    Same resolution and hash as ``load_teacher`` (so cache keys agree); builds the tiny
    model if needed, reads hub ids from the HF cache. Memoised per process.
    """
    ident = _identity_cached(str(model).strip(), Path(cache_dir).expanduser().resolve())
    if not (ident.folder / "model_index.json").is_file():  # deleted/rebuilt since: recompute
        _identity_cached.cache_clear()
        ident = _identity_cached(str(model).strip(), Path(cache_dir).expanduser().resolve())
    return ident


@functools.cache
def _identity_cached(model: str, cache_dir: Path) -> TeacherIdentity:
    folder, model_id, random_weights = _resolve_folder(model, cache_dir)
    return TeacherIdentity(model_id, weights_hash(folder, cache_dir / "weights-digests.json"), random_weights, folder)


def teacher_resolution(model: str, cache_dir: Path) -> int | None:
    """The input size a feddifrc-built teacher (tiny, pretrain-teacher) was made for; None otherwise."""
    res = _read_marker(teacher_identity(model, cache_dir).folder).get("resolution")
    return int(res) if isinstance(res, int) else None


def load_teacher(model: str, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> Teacher:
    """Load (once per process per (model, cache_dir, device, dtype)) the frozen teacher.

    ``model``: ``"tiny"`` (or ``"tiny-seedN"``) -> ``cache_dir/models/tiny-seedN``, built on first
    use and loaded back through ``from_pretrained``; a hub id (HF cache first, the hub only when
    online); or a local diffusers folder. Raises ``TeacherLoadError`` (one line) when unavailable.
    """
    model = str(model).strip()
    cache_dir = Path(cache_dir).expanduser().resolve()
    return _load_teacher_cached(model, cache_dir, torch.device(device), dtype)


@functools.cache
def _load_teacher_cached(model: str, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> Teacher:
    ident = teacher_identity(model, cache_dir)
    folder = ident.folder
    pipe = _from_pretrained(folder, model, dtype)
    tok = pipe.tokenizer
    if tok is None or len(tok) < _MIN_VOCAB:
        size = 0 if tok is None else len(tok)
        raise TeacherLoadError(
            f"diffusion model '{model}': the tokenizer in '{folder / 'tokenizer'}' loaded with only {size} "
            "tokens (its vocab.json/merges.txt/tokenizer.json are missing or empty); copy the model's "
            "tokenizer files there or re-download the model"
        )
    unet, vae, text_encoder = pipe.unet, pipe.vae, pipe.text_encoder
    vae.decoder = None  # encode-only teacher: drop the decoder half
    if getattr(vae, "post_quant_conv", None) is not None:
        vae.post_quant_conv = None
    for mod in (unet, vae, text_encoder):
        mod.requires_grad_(False)
        mod.eval()
        mod.to(device)  # already in dtype (loaded with it)
    alphas = pipe.scheduler.alphas_cumprod.detach().to("cpu", torch.float32).clone()
    block_channels = tuple(int(b.resnets[-1].out_channels) for b in unet.up_blocks)
    return Teacher(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        alphas_cumprod=alphas,
        model_id=ident.model_id,
        weights_hash=ident.weights_hash,
        random_weights=ident.random_weights,
        device=device,
        dtype=dtype,
        text_width=int(text_encoder.config.hidden_size),
        block_channels=block_channels,
    )


def _cache_clear() -> None:
    """Forget every loaded teacher and identity of this process (tests, long-lived tools)."""
    _load_teacher_cached.cache_clear()
    _identity_cached.cache_clear()


load_teacher.cache_clear = _cache_clear  # type: ignore[attr-defined]
