"""What identifies a teacher's files: the content sha256 of everything loading reads (the
feature cache keys on it), memoised across processes, and the checksums a
``feddifrc pretrain-teacher`` folder ships with (``feddifrc.json``), verified before a load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from feddifrc_app.diffusion.tiny import MARKER
from feddifrc_app.files import write_json


class TeacherLoadError(RuntimeError):
    """The diffusion teacher is unavailable; the message says how to provide it."""


# what loading reads, over all families (SD's five first: an SD folder hashes as it always did)
_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler", "transformer")
_COMPONENTS += ("text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
WEIGHT_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".onnx", ".h5", ".pb")


def one_line(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split())
    if len(msg) > limit:
        msg = msg[: limit - 3] + "..."
    return f"{type(e).__name__}: {msg}"


def _file_digest(p: Path, memo: dict[str, str] | None = None) -> str:
    """sha256 of a file's content. Hub-cache LFS blobs are named by that sha256: reuse it.

    ``memo`` maps "realpath|size|mtime_ns" to a digest computed earlier: in deployment every
    message is a new process, and re-reading a 5 GB SD folder each time would cost more than
    the round itself.
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
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", name.rsplit(".", 1)[0])
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
        weights = [p for p in entries if p.name.endswith(WEIGHT_EXTS)]
        plain = [p for p in weights if not _is_variant(p.name)]
        if any(p.name.endswith(".safetensors") for p in plain):
            plain = [p for p in plain if p.name.endswith(".safetensors")]
        files += [p for p in entries if p not in weights] + plain
    return [p for p in files if p.is_file()]


def _read_memo(memo_file: Path) -> dict[str, str]:
    try:
        memo = json.loads(memo_file.read_text()) if memo_file.is_file() else {}
    except (OSError, ValueError):
        return {}  # unreadable memo: recompute (and rewrite it)
    return memo if isinstance(memo, dict) else {}


def weights_hash(folder: Path, memo_file: Path | None = None) -> str:
    """sha256 over (relative path, content sha256) of every file loading reads. Content-defined:
    a hub snapshot and a plain copy of it hash the same. ``memo_file`` (JSON) remembers file
    digests by (path, size, mtime) across processes; it is rewritten atomically."""
    folder = Path(folder)
    memo = None if memo_file is None else _read_memo(memo_file)
    before = dict(memo or {})
    h = hashlib.sha256()
    for p in _loaded_files(folder):
        h.update(f"{p.relative_to(folder).as_posix()}\0{_file_digest(p, memo)}\n".encode())
    if memo_file is not None and memo != before:
        write_json(memo_file, memo)
    return h.hexdigest()


def folder_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a pipeline folder but the marker and the card (relative posix paths)."""
    folder = Path(folder)
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in (MARKER, "README.md"))
    return {p.relative_to(folder).as_posix(): _file_digest(p) for p in files}


def verify_folder(folder: Path) -> dict[str, Any]:
    """Check the files of a ``feddifrc pretrain-teacher`` folder against the sha256 sums in its
    ``feddifrc.json`` and return that marker. Every file loading reads must be listed; a
    missing, truncated or altered one is a one-line ``TeacherLoadError`` naming it, never a load."""
    how = f"rebuild it with `feddifrc pretrain-teacher --out {folder}` or reinstall feddifrc-app"
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no file checksums")
    except (OSError, ValueError, KeyError, TypeError):
        raise TeacherLoadError(
            f"teacher folder {folder} has no readable {MARKER} with file checksums; {how}"
        ) from None
    for p in _loaded_files(folder):
        if p.relative_to(folder).as_posix() not in files:
            raise TeacherLoadError(
                f"teacher file {p} is not covered by the checksums in {folder / MARKER}; {how}"
            )
    for rel, digest in sorted(files.items()):
        p = folder / rel
        if not p.is_file():
            raise TeacherLoadError(f"teacher file {p} is missing; {how}")
        try:
            ok = _file_digest(p) == digest
        except OSError as e:
            raise TeacherLoadError(f"teacher file {p} cannot be read ({one_line(e, 120)}); {how}") from None
        if not ok:
            raise TeacherLoadError(f"teacher file {p} is corrupt (its sha256 does not match {MARKER}); {how}")
    return marker
