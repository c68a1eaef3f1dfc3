"""A teacher's prompt encoders are freed, not parked: released once the prompt lists a process
needs are encoded, loaded again from the teacher's folder only if a new prompt list comes.

A run's prompts are fixed (the class prompts and the NDCR prompt), so a node's extraction
needs its text encoders for one encoding (``Featurizer.encode_then_release``): T5-XXL
(PixArt, SD3; 4.7 B parameters, ~11.5 GB in float16 with its float32 ``wo`` layers) would
otherwise sit in host RAM beside every actor's denoiser for the whole extraction. Released
means nothing of the teacher holds them: its ``text_encoder`` and ``tokenizer`` and the kept
pipeline's text encoders and tokenizers (``parts["pipe"]``) are None, so the memory is freed
once the caller's own references go. The encodings stay memoised in the featurizer, so no
feature changes: the same tensors condition the denoiser as before.
"""

from __future__ import annotations

import gc
from typing import Any

from feddifrc_app import log
from feddifrc_app.diffusion.pipeline import Teacher, _from_pretrained, placement


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
    skip, dtype = (teacher.adapter.DENOISER, "vae"), teacher.dtype
    pipe = _from_pretrained(teacher.folder, teacher.model_id, teacher.family, dtype, dtype, skip)
    found = {name: getattr(pipe, name, None) for name in _names(teacher)}
    home = placement(teacher.device)["text_encoders"]
    for name in teacher.adapter.TEXT_PARTS:
        if found.get(name) is not None:
            found[name].requires_grad_(False).eval().to(home)  # dtypes as loaded (T5's fp32 `wo` kept)
    _hold(teacher, found)
    log.info("teacher %s: text encoders loaded again for a new prompt list", teacher.model_id)
