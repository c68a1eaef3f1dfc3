"""Atomic file and folder writes: readers only ever see a whole file or the previous one."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
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
def atomic_folder(
    path: Path, tag: str = "", may_replace: Callable[[Path], None] | None = None
) -> Iterator[Path]:
    """Yield a temp sibling folder to fill; on success it replaces ``path`` as a whole.

    An existing ``path`` is moved aside first and put back if the swap fails, so a
    failure at any point leaves the previous folder (or nothing) in place.
    ``may_replace(path)`` runs just before an existing ``path`` is replaced and raises to
    keep it (the caller's ownership check, repeated at the last moment). ``tag`` prefixes the
    temp names (``.<name>.<tag>tmp-<pid>-<hex>``, ``.<name>.<tag>old-...``) so that one
    writer can find and remove what a killed run of itself left (:func:`stale_siblings`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, f"{tag}tmp")
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            if may_replace is not None:
                may_replace(path)
            trash = _sibling(path, f"{tag}old")
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


def stale_siblings(path: Path, tag: str) -> tuple[list[Path], list[Path]]:
    """(temp folders, moved-aside old folders) that :func:`atomic_folder` with ``tag`` left next
    to ``path`` in processes of this machine that no longer exist (killed mid-write)."""
    pat = re.compile(rf"^\.{re.escape(path.name)}\.{re.escape(tag)}(tmp|old)-(\d+)-[0-9a-f]{{8}}$")
    out: dict[str, list[Path]] = {"tmp": [], "old": []}
    if not path.parent.is_dir():
        return [], []
    for p in sorted(path.parent.iterdir()):
        m = pat.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not _pid_alive(int(m.group(2))):
            out[m.group(1)].append(p)
    return out["tmp"], out["old"]


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


# --------------------------------------------------------------------------- folder ownership

LOCK_NAME = ".lock"  # <folder>/.lock: flock'ed by the process that owns the folder, with who it is
_HELD: dict[str, int] = {}  # folder -> fd of a lock this process holds (kept open until exit)


class FolderInUse(RuntimeError):
    """Another live process owns the folder (one line: who, since when, what to do)."""


def _holder_text(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"{}")
        return f"pid {info['pid']} on {info['host']} since {info['since']} ({info['what']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file does not say which)"


def lock_folder(folder: Path, what: str) -> None:
    """Own ``folder`` until this process exits: an exclusive flock on ``<folder>/.lock``, which
    the kernel drops when the process dies however it dies (so a killed owner never leaves a
    stale lock). Re-entrant within the process. ``FolderInUse`` names the holder otherwise.
    flock is per machine: folders shared over NFS between machines are not covered."""
    key = str(Path(folder).resolve())
    if key in _HELD:
        return
    fd = os.open(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_text(fd)
        os.close(fd)
        raise FolderInUse(f"{folder} is in use by {holder}; wait for it to end or stop it first") from None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "what": f"{what}, {Path(sys.argv[0]).name if sys.argv and sys.argv[0] else 'python'}",
    }
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(info).encode())
    _HELD[key] = fd


def release_folder(folder: Path) -> None:
    """Give up a lock taken with :func:`lock_folder` (no-op if this process holds none)."""
    fd = _HELD.pop(str(Path(folder).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor drops the flock


def folder_holder(folder: Path) -> str | None:
    """Which other live process owns ``folder`` ("pid N on HOST since T (what)"), or None."""
    if str(Path(folder).resolve()) in _HELD:
        return None  # this process: it may continue what it owns
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(fd)
    finally:
        os.close(fd)
    return None
