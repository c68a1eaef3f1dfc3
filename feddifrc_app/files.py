"""Atomic file and folder writes: readers only ever see a whole file or the previous one.

Also the one mechanism of the app's verified array files (feature shards, prepared targets):
an uncompressed ``.npz`` with a JSON ``header`` member (format, version, key, the kind's own
fields, sha256) whose sha256 covers the arrays (``write_verified`` / ``read_verified``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feddifrc_app import log


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


_TEMP_FILE = re.compile(
    r"^\..+\.tmp-(\d+)-[0-9a-f]{8}$"
)  # an atomic_write temp file: .<name>.tmp-<pid>-<hex>


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


def dead_temp_files(folder: Path) -> list[Path]:
    """The temp files :func:`atomic_write` left in ``folder`` in processes of this machine that no
    longer exist (killed mid-write). A live writer's temp file is never listed: deleting it would
    fail that writer's rename."""
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.iterdir()):
        m = _TEMP_FILE.match(p.name)
        if m and p.is_file() and not p.is_symlink() and not _pid_alive(int(m.group(1))):
            out.append(p)
    return out


# --------------------------------------------------------------------------- verified array files


def evict(folder: Path, keep: Path, budget: int, what: str) -> None:
    """Remove the least recently used ``*.npz`` files of ``folder`` beyond ``budget`` bytes (never
    ``keep``; ``what`` they are names them in the log), and the temp files of writers killed
    mid-write."""
    for p in dead_temp_files(folder):
        p.unlink(missing_ok=True)
    files = []
    for p in folder.glob("*.npz"):
        try:
            st = p.stat()
        except FileNotFoundError:  # another process evicted it
            continue
        files.append((p != keep, -st.st_mtime_ns, st.st_size, p))
    total = 0
    for others, _, size, p in sorted(files):  # `keep` first, then newest first
        total += size
        if others and total > budget:
            p.unlink(missing_ok=True)
            log.info("%s: removed %s (least recently used; %d bytes kept at most)", what, p, budget)


class CorruptFile(Exception):
    """A stored file that fails its checks and must not be used (the reason in the message)."""


def array_digest(parts: Iterable[tuple[str, Any]]) -> str:
    """sha256 over ``(tag, array)`` pairs in order: the tag's utf-8 bytes, then the array's bytes,
    little-endian and in C order, so the digest is the same on every machine."""
    h = hashlib.sha256()
    for tag, a in parts:
        a = np.asarray(a)
        h.update(tag.encode("utf-8"))
        # The array's own buffer when it is already little-endian C order (no copy: hashing a
        # prepared-targets file is on every deployment message's path).
        h.update(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8))
    return h.hexdigest()


def write_archive(path: Path, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """Atomically write an uncompressed ``.npz``: ``header`` (utf-8 JSON as a uint8 member), ``arrays``."""
    if "header" in arrays:
        raise ValueError("write_archive: 'header' is the header's member name")
    members = {"header": np.frombuffer(json.dumps(dict(header)).encode("utf-8"), dtype=np.uint8), **arrays}
    atomic_write(path, lambda f: np.savez(f, **members))


def read_archive(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(header, every other member) of a :func:`write_archive` file, read with ``allow_pickle=False``.

    ``CorruptFile`` when it is not such a file (truncated, overwritten, not a zip, no JSON header);
    checking the header against the arrays, and the checksum, is the caller's. A missing file
    raises ``FileNotFoundError`` (absent is not corrupt).
    """
    try:
        with np.load(path, allow_pickle=False) as z:
            if "header" not in z.files:
                raise CorruptFile(f"members {sorted(z.files)} lack a header")
            header = json.loads(bytes(np.asarray(z["header"], dtype=np.uint8)).decode("utf-8"))
            if not isinstance(header, dict):
                raise CorruptFile("its header is not a JSON object")
            return header, {k: z[k] for k in z.files if k != "header"}
    except (CorruptFile, FileNotFoundError):
        raise
    except Exception as e:  # zip/npy/json errors of a truncated or overwritten file
        raise CorruptFile(f"unreadable ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class ArchiveKind:
    """One kind of verified archive: the header's ``format`` and ``version``, the members a header
    promises (``members(header) -> {name: (dtype str, shape)}``; a KeyError, TypeError or
    ValueError means a malformed header) and the digest over the members (``digest(members)``)."""

    format: str
    version: int
    members: Callable[[Mapping[str, Any]], Mapping[str, tuple[str, tuple[int, ...]]]]
    digest: Callable[[Mapping[str, np.ndarray]], str]


def write_verified(
    path: Path, kind: ArchiveKind, key: str, members: Mapping[str, np.ndarray], fields: Mapping[str, Any]
) -> None:
    """Atomically write ``members`` under the header ``format, version, key, *fields, sha256``
    (in that order: the header's JSON text is part of the file)."""
    header = {"format": kind.format, "version": kind.version, "key": key, **fields}
    header["sha256"] = kind.digest(members)
    write_archive(path, header, members)


# path -> (device, inode, size, mtime_ns, ctime_ns, sha256) of archives whose digest this
# process verified (ctime: a rewrite that restores the mtime still changes it).
_VERIFIED: dict[str, tuple[Any, ...]] = {}


def _stat_tag(path: Path) -> tuple[int, ...]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_verified(path: Path, kind: ArchiveKind, key: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(header, members) of a :func:`write_verified` file of ``kind`` and ``key``. ``CorruptFile``
    (the reason) unless the format, version and key match, the members are exactly the ones the
    header promises with their dtypes and shapes, and the digest holds; ``FileNotFoundError`` if
    there is none. The digest pass reads every byte again: a file this process verified and that
    was not replaced since (same device, inode, size, mtime and ctime, before and after this
    read) is not hashed twice."""
    before = _stat_tag(path)
    header, members = read_archive(path)
    if header.get("format") != kind.format or header.get("version") != kind.version:
        raise CorruptFile(f"format {header.get('format')!r} v{header.get('version')!r}")
    if header.get("key") != key:
        raise CorruptFile(f"belongs to key {str(header.get('key'))[:12]}..., not {key[:12]}...")
    try:
        promised = {
            k: (str(d), tuple(int(n) for n in shape)) for k, (d, shape) in kind.members(header).items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptFile(f"malformed header ({type(e).__name__}: {e})") from None
    if set(promised) != set(members):
        raise CorruptFile(f"members {sorted(members)}, header lists {sorted(promised)}")
    for k, (dtype, shape) in promised.items():
        if (members[k].dtype.str, members[k].shape) != (dtype, shape):
            raise CorruptFile(
                f"{k}: {members[k].dtype.str} {list(members[k].shape)}, header says {dtype} {list(shape)}"
            )
    tag = (*before, header.get("sha256"))
    if _VERIFIED.get(str(path)) != tag or _stat_tag(path) != before:
        if kind.digest(members) != header.get("sha256"):
            raise CorruptFile("checksum mismatch")
        _VERIFIED[str(path)] = tag
    return header, members


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


def _open_lock(path: Path, flags: int) -> int:
    """``path`` opened as a lock file: never through a symlink, and only if it is a regular file
    with no other name (a hard link), so that writing who holds it overwrites nothing else.
    ``NotALockFile`` otherwise; O_NONBLOCK so that a FIFO planted there cannot hang the open."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a symlink
            raise NotALockFile(f"{path} is a symbolic link, not a lock file; {_REFUSED}") from None
        if e.errno in (errno.EISDIR, errno.ENXIO):  # a folder; a socket or a FIFO without a reader
            raise NotALockFile(f"{path} is not a regular file; {_REFUSED}") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else "has another name (a hard link)"
        raise NotALockFile(f"{path} {what}; {_REFUSED}")
    return fd


_REFUSED = "refusing to use it as the folder's lock (it may point at someone's file): remove it and retry"


class NotALockFile(OSError):
    """A folder's ``.lock`` is a symlink, a hard link or not a regular file: never opened or written."""


def lock_folder(folder: Path, what: str) -> None:
    """Own ``folder`` until this process exits: an exclusive flock on ``<folder>/.lock``, which
    the kernel drops when the process dies however it dies (so a killed owner never leaves a
    stale lock). Re-entrant within the process. ``FolderInUse`` names the holder otherwise;
    ``NotALockFile`` when ``.lock`` is anything but this app's own regular file.
    flock is per machine: folders shared over NFS between machines are not covered."""
    key = str(Path(folder).resolve())
    if key in _HELD:
        return
    fd = _open_lock(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT)
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
    os.ftruncate(fd, 0)  # ours: a regular file of this folder that we hold the flock of
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
        fd = _open_lock(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:  # none, or not a lock file (lock_folder refuses it, naming it)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(fd)
    finally:
        os.close(fd)
    return None
