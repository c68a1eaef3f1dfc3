"""``image-folder``: ``cfg.data_dir`` with ``train/`` and ``test/`` (or ``val/``) class-per-folder
subfolders, or class folders directly (then a fixed stratified 80/20 split), or only ``test/``
(or ``val/``): the server's test set of image-folder sites. Labels are positions in the
federation's class list (``dataset.classes``), or this folder's sorted class folders.

Decoded folders are kept in ``<data_dir>/.feddifrc-decoded/`` (hidden: never read as a class
folder), one file per scanned folder, image size and class list, keyed by the class list and a
digest of every image file's name, size and modification/change times (``_listing``): a changed,
added or removed image is a rebuild, never a stale read. Decoding 12,500 PNGs costs a simulation actor
tens of seconds on a loaded core; reading them back, well under one. A data dir this process
cannot write (a site's read-only mount) is decoded every time, as before (said once per process)."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from feddifrc_app import log
from feddifrc_app.config import DatasetConfig
from feddifrc_app.data.decoded import read_decoded, write_decoded
from feddifrc_app.data.holdouts import holdout_split
from feddifrc_app.data.images import DatasetUnavailableError, Loaded, Stats
from feddifrc_app.data.transforms import fit_rgb

# Image folders use ImageNet's statistics: fixed, so every node of a federation
# normalises its own folder identically.
IMAGENET_STATS: Stats = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

IMAGE_EXTENSIONS: tuple[str, ...] = (
    ".png",
    ".jpg",
    ".jpeg",
    ".bmp",
    ".gif",
    ".webp",
    ".tif",
    ".tiff",
    ".ppm",
)


def _is_image_name(name: str) -> bool:
    return not name.startswith(".") and Path(name).suffix.lower() in IMAGE_EXTENSIONS


def _class_folders(root: Path) -> list[str]:
    """Sorted class-folder names directly under ``root`` (hidden folders skipped)."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DatasetUnavailableError(
            f"image folder {root} has no class subfolders (expected {root}/<class>/<image>)"
        )
    return classes


def image_folder_classes(root: str | os.PathLike[str]) -> list[str]:
    """The class-folder names (sorted) that define labels for the image folder at ``root``.

    With split folders these are the folders of ``root/train``; otherwise those of ``root``.
    """
    train_root, test_root = image_folder_layout(Path(root))
    return _class_folders(train_root or test_root)


def image_folder_layout(root: Path) -> tuple[Path | None, Path | None]:
    """(train root, test root); (class root, None) when there are no split folders; and
    (None, test root) for a folder holding only test/ (or val/): the server's test set."""
    if not root.is_dir():
        raise DatasetUnavailableError(
            f"dataset 'image-folder': data dir {root} does not exist; set dataset.data-dir to a folder of "
            f"class subfolders, or with train/ and test/ (or val/) subfolders of class folders"
        )
    if (root / "train").is_dir():
        for name in ("test", "val"):
            if (root / name).is_dir():
                return root / "train", root / name
        raise DatasetUnavailableError(f"image folder {root} has train/ but neither test/ nor val/")
    subfolders = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if subfolders in (["test"], ["val"]):
        return None, root / subfolders[0]
    return root, None


def _read_image(path: Path, size: int) -> np.ndarray:
    """Any PIL-readable file -> uint8 (size, size, 3) (see ``transforms.fit_rgb``)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return fit_rgb(im, size)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot decode image {path}: {e}") from e


def _class_files(root: Path, folder: str, classes: list[str]) -> list[tuple[Path, os.stat_result]]:
    """The image files of class folder ``root/folder``, sorted, each with its ``stat``; ValueError
    for a folder that is not a listed class, holds folders, or holds no image. One ``scandir``:
    a folder of thousands of images is listed in a fraction of what a Path per check costs."""
    if folder not in classes:
        raise ValueError(
            f"image folder {root}: class folder '{folder}' is not one of the classes ({', '.join(classes)})"
        )
    with os.scandir(root / folder) as it:
        entries = [e for e in it if not e.name.startswith(".")]
    nested = sorted(e.name for e in entries if e.is_dir())
    if nested:
        raise ValueError(
            f"image folder class '{folder}' ({root / folder}) holds folders {nested}: "
            "expected images directly inside each class folder"
        )
    # By name: the order of the Paths themselves, which share their folder.
    images = sorted((e for e in entries if e.is_file() and _is_image_name(e.name)), key=lambda e: e.name)
    if not images:
        raise ValueError(
            f"image folder class '{folder}' ({root / folder}) has no images "
            f"(extensions {', '.join(IMAGE_EXTENSIONS)})"
        )
    return [(Path(e.path), e.stat()) for e in images]


def _scan(data_dir: Path, root: Path, classes: list[str], size: int) -> tuple[torch.Tensor, np.ndarray]:
    """Decode ``root/<class>/*`` for the classes present; label = position in ``classes``.
    Read back from ``data_dir``'s decoded cache (module docstring) when the listing is unchanged."""
    found = [(folder, _class_files(root, folder, classes)) for folder in _class_folders(root)]
    split = root.name if root != data_dir else "classes"  # train, test or val; else the class root
    key: dict[str, object] = {
        "v": 1,
        "name": "image-folder",
        "split": split,
        "size": size,
        "source": _listing(found, classes),
    }
    # One file per class list too: nodes numbering the same folder differently do not take turns
    # rebuilding it.
    tag = hashlib.blake2b("\0".join(classes).encode(), digest_size=4).hexdigest()
    path = data_dir / DECODED_FOLDER / f"{split}-{size}px-{tag}.npz"
    if cached := read_decoded(path, key):
        return cached[0], cached[1]
    arrays: list[np.ndarray] = []
    labels: list[int] = []
    for folder, files in found:
        arrays.extend(_read_image(p, size) for p, _ in files)
        labels.extend([classes.index(folder)] * len(files))
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    out = images, np.asarray(labels, dtype=np.int64)
    if os.access(data_dir, os.W_OK):
        write_decoded(path, key, *out, list(classes))
    else:
        _unwritable(data_dir)
    return out


DECODED_FOLDER = ".feddifrc-decoded"


def _listing(found: list[tuple[str, list[tuple[Path, os.stat_result]]]], classes: list[str]) -> str:
    """Digest of what a decode reads: the class list and every image's class folder, name, size,
    and modification and change times in ns (a rewrite changes the change time even when the
    size and a restored mtime do not)."""
    h = hashlib.blake2b(digest_size=16)
    h.update("\0".join(classes).encode() + b"\n")
    for folder, files in found:
        for p, st in files:
            h.update(f"{folder}/{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode())
    return h.hexdigest()


@functools.cache
def _unwritable(data_dir: Path) -> None:
    log.info("image folder %s is not writable: its images are decoded in every process", data_dir)


def load_image_folder(cfg: DatasetConfig, split: str) -> Loaded:
    root = Path(cfg.data_dir)
    train_root, test_root = image_folder_layout(root)
    if train_root is None and split == "train":
        raise DatasetUnavailableError(
            f"image folder {root} holds only {test_root.name}/: a test set (the server's); a node "
            "trains on class folders, or on train/ beside test/"
        )
    class_root = train_root or test_root
    classes = list(cfg.classes) or _class_folders(class_root)
    if len(classes) < 2:
        raise ValueError(
            f"image folder {class_root}: one class ({classes[0]!r}); a classifier needs at least 2"
        )
    names = [c.replace("_", " ") for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"image folder {class_root}: class folders collide once '_' -> ' ': {classes}")
    if test_root is not None:
        images, labels = _scan(root, train_root if split == "train" else test_root, classes, cfg.image_size)
        return images, labels, names, IMAGENET_STATS
    images, labels = _scan(root, train_root, classes, cfg.image_size)
    keep = holdout_split(labels, split)
    return images[torch.from_numpy(keep)], labels[keep], names, IMAGENET_STATS
