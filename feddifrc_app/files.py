"""Atomic file and folder writes: readers only ever see a whole file or the previous one."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: not every filesystem allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sibling(path: Path, tag: str) -> Path:
    # Hidden, unique per writer, in the same folder: os.replace stays a same-filesystem rename.
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write(path: Path, write: Callable[[Any], Any], mode: str = "wb") -> None:
    """Write via ``write(fileobj)`` to a temp file next to ``path``, fsync, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise OSError(
                e.errno, f"disk full writing {path}; the previous version (if any) is intact"
            ) from e
        raise
    fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: json.dump(obj, f, indent=2), mode="w")


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """Yield a temp sibling folder to fill; on success it replaces ``path`` as a whole.

    An existing ``path`` is moved aside first and put back if the swap fails, so a
    failure at any point leaves the previous folder (or nothing) in place.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            trash = _sibling(path, "old")
            os.replace(path, trash)
            try:
                os.replace(tmp, path)
            except OSError:
                os.replace(trash, path)
                raise
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_writable_dir(path: Path, key: str) -> Path:
    """Create ``path`` if needed and prove it takes a file, or fail naming the config key."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = _sibling(path / "probe", "tmp")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        what = "is not a folder" if path.exists() and not path.is_dir() else "is not writable"
        raise OSError(f"{key} = '{path}' {what} ({e.strerror or e}); set it to a writable folder") from None
    return path
