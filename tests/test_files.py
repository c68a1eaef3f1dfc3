"""files.py's verified-array format: the digest is byte-order and layout independent and does not
move across versions (cached files written before must still verify); read_archive detects damage.
A folder's lock file is never opened through a symlink nor written when it is not ours."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from feddifrc_app import files
from feddifrc_app.files import (
    ArchiveKind,
    CorruptFile,
    NotALockFile,
    array_digest,
    folder_holder,
    lock_folder,
    read_archive,
    read_verified,
    release_folder,
    write_archive,
    write_verified,
)


def _reference(parts) -> str:
    """The digest's definition, spelled with copies: tag bytes, then little-endian C-order bytes."""
    h = hashlib.sha256()
    for tag, a in parts:
        h.update(tag.encode("utf-8"))
        h.update(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize(
    "a",
    [
        np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2],  # big-endian, not contiguous
        np.array(3.5),  # 0-d
        np.zeros((0, 3), np.float32),  # empty
        np.ones((2, 3), bool),
        np.arange(6, dtype=np.int64).reshape(2, 3).T,  # Fortran order
        np.float16([1, 2, 3]),
    ],
)
def test_array_digest_matches_its_definition(a):
    assert array_digest([("|x|", a)]) == _reference([("|x|", a)])


def test_array_digest_is_pinned():
    # Written once from the definition: a change here would orphan every cached file.
    parts = [("|ids|", np.arange(3, dtype=np.int64)), ("|v|", np.float32([[0.5, -1.0]]))]
    assert array_digest(parts) == "e6c0e1c1d757284044573d1cea9f9c9fd746eb1a421dccfb0a8c6279af4c0c79"


def test_archive_round_trip_and_truncation_is_detected(tmp_path):
    p = tmp_path / "a.npz"
    arrays = {"ids": np.arange(5), "v": np.linspace(0, 1, 10, dtype=np.float32).reshape(5, 2)}
    write_archive(p, {"k": "x"}, arrays)
    header, members = read_archive(p)
    assert header == {"k": "x"}
    assert set(members) == {"ids", "v"} and np.array_equal(members["v"], arrays["v"])
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptFile, match="unreadable"):
        read_archive(p)
    with pytest.raises(FileNotFoundError):
        read_archive(tmp_path / "absent.npz")


def _listed_digest(members):
    return array_digest((f"|{k}|", members[k]) for k in sorted(members))


KIND = ArchiveKind("test-kind", 2, members=lambda h: h["members"], digest=lambda m: _listed_digest(m))


def _write(path, key="k1", **members):
    listed = {k: [a.dtype.str, list(a.shape)] for k, a in members.items()}
    write_verified(path, KIND, key, members, {"n": 3, "members": listed})


@pytest.mark.parametrize(
    "damage", ["format", "version", "key", "dtype", "shape", "extra", "missing", "digest", "malformed"]
)
def test_a_verified_archive_round_trips_and_every_check_refuses(tmp_path, damage):
    p = tmp_path / "a.npz"
    ids, v = np.arange(3), np.float32([[1, 2], [3, 4], [5, 6]])
    _write(p, ids=ids, v=v)
    header, members = read_verified(p, KIND, "k1")
    assert list(header) == ["format", "version", "key", "n", "members", "sha256"]
    assert header["sha256"] == _listed_digest({"ids": ids, "v": v}) and header["format"] == "test-kind"
    assert np.array_equal(members["v"], v)
    kind, key = KIND, "k1"
    if damage in ("format", "version"):
        kind = ArchiveKind(
            *(("other", 2) if damage == "format" else ("test-kind", 3)), KIND.members, KIND.digest
        )
    elif damage == "key":
        key = "k2"
    else:
        h, m = read_archive(p)
        if damage == "dtype":
            m["v"] = v.astype(np.float64)
        elif damage == "shape":
            m["v"] = v.reshape(2, 3)
        elif damage == "extra":
            m["w"] = v
        elif damage == "missing":
            del m["v"]
        elif damage == "digest":
            m["v"] = v + 1
        elif damage == "malformed":
            h["members"] = "v"
        write_archive(p, h, m)
    with pytest.raises(CorruptFile):
        read_verified(p, kind, key)


def test_a_verified_archive_is_not_rehashed_until_replaced(tmp_path):
    p, calls = tmp_path / "a.npz", []
    counting = ArchiveKind("test-kind", 2, KIND.members, lambda m: calls.append(1) or _listed_digest(m))
    _write(p, ids=np.arange(3))
    files._VERIFIED.clear()
    read_verified(p, counting, "k1")
    read_verified(p, counting, "k1")
    assert len(calls) == 1
    _write(p, ids=np.arange(3) + 1)  # replaced: verified again
    read_verified(p, counting, "k1")
    assert len(calls) == 2


def _plant(folder, kind, victim):
    """``folder/.lock`` as an attacker (or an accident) leaves it, pointing at ``victim``."""
    folder.mkdir()
    lock = folder / ".lock"
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling symlink":
        lock.symlink_to(victim.with_name("not-yet"))
    elif kind == "hard link":
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "hard link", "fifo", "folder"])
def test_a_lock_file_that_is_not_ours_is_refused_and_left_untouched(tmp_path, kind):
    """Issue 33 case 3: a ``.lock`` planted as a link to someone's file was opened and overwritten
    with the holder's JSON. Now it is refused naming the path, and its target keeps its bytes."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    folder = tmp_path / "victim"
    _plant(folder, kind, victim)
    with pytest.raises(NotALockFile, match=f"^{folder / '.lock'} (is|has) .*: remove it and retry$"):
        lock_folder(folder, "a test")
    assert folder_holder(folder) is None  # a reader never opens it either
    assert victim.read_text() == "precious\n" and victim.stat().st_nlink == (2 if kind == "hard link" else 1)
    assert not victim.with_name("not-yet").exists()  # not created through the dangling link
    if kind == "folder":
        (folder / ".lock").rmdir()
    else:
        (folder / ".lock").unlink()
    lock_folder(folder, "a test")  # removed as the message says: the folder locks again
    release_folder(folder)
    assert (folder / ".lock").is_file() and not (folder / ".lock").is_symlink()
