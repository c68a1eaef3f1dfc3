"""data.sources.image_folder: class-per-folder images, with and without split folders, test-only
folders (the server's), the federation's class list, and the errors."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import COLOURS, _png, _truncate, dcfg

from feddifrc_app.data.images import DatasetUnavailableError
from feddifrc_app.data.registry import load_dataset, load_validation
from feddifrc_app.data.sources.image_folder import image_folder_classes


def test_image_folder_without_split_folders(tmp_path: Path) -> None:
    for cls, rgb in COLOURS.items():
        for k in range(5):
            _png(tmp_path / cls / f"{k}.png", rgb)
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden").mkdir()
    cfg = dcfg(name="image-folder", data_dir=str(tmp_path), image_size=8)
    tr, te = load_dataset(cfg, "train"), load_dataset(cfg, "test")
    assert image_folder_classes(tmp_path) == ["cat", "dog_house", "zebra"]
    assert tr.class_names == ["cat", "dog house", "zebra"]
    va = load_dataset(cfg, "val")
    assert (len(tr), len(va), len(te)) == (11, 1, 3)  # 15 images: 3 test, then round(0.1 * 12) val
    assert np.bincount(te.labels).tolist() == [1, 1, 1]
    for d in (tr, te):
        assert d.images.shape[1:] == (3, 8, 8)  # non-square 10x6 -> 8x8 (shorter side, centre crop)
        for img, y in zip(d.images, d.labels, strict=True):
            want = torch.tensor(COLOURS[["cat", "dog_house", "zebra"][y]], dtype=torch.uint8)
            assert torch.equal(img[:, 4, 4], want)
    assert load_dataset(cfg, "test").fingerprint == te.fingerprint


def test_image_folder_with_split_folders(tmp_path: Path) -> None:
    for cls, rgb in COLOURS.items():
        for k in range(3):
            _png(tmp_path / "train" / cls / f"{k}.png", rgb, (8, 8))
    _png(tmp_path / "val" / "zebra" / "a.jpg", COLOURS["zebra"], (8, 8))
    cfg = dcfg(name="image-folder", data_dir=str(tmp_path), image_size=8)
    tr, te = load_dataset(cfg, "train"), load_dataset(cfg, "test")
    assert (len(tr), len(load_dataset(cfg, "val")), len(te)) == (8, 1, 1)  # val: round(0.1 * 9) of train/
    assert te.class_names == tr.class_names and te.labels.tolist() == [2]  # label from train's class list
    assert image_folder_classes(tmp_path) == ["cat", "dog_house", "zebra"]
    # a node's own folder numbered by the federation's class list (here it lacks "cat" and adds "auk")
    fed = load_dataset(dataclasses.replace(cfg, classes=("auk", "cat", "dog_house", "zebra")), "train")
    assert fed.class_names == ["auk", "cat", "dog house", "zebra"]
    assert sorted(set(fed.labels.tolist())) == [1, 2, 3]
    with pytest.raises(ValueError, match="'zebra' is not one of the classes"):
        load_dataset(dataclasses.replace(cfg, classes=("cat", "dog_house")), "train")
    _png(tmp_path / "val" / "unicorn" / "a.png", (1, 2, 3))
    with pytest.raises(ValueError, match="unicorn"):
        load_dataset(cfg, "test")


def test_a_folder_holding_only_test_is_the_servers_test_set(tmp_path: Path, caplog) -> None:
    # The server of image-folder sites has no training images: just test/ (or val/).
    for cls in ("cat", "zebra"):
        _png(tmp_path / "test" / cls / "0.png", COLOURS[cls], (8, 8))
    cfg = dcfg(name="image-folder", data_dir=str(tmp_path), image_size=8)
    te = load_dataset(dataclasses.replace(cfg, classes=("cat", "dog_house", "zebra")), "test")
    assert te.class_names == ["cat", "dog house", "zebra"] and te.labels.tolist() == [0, 2]
    assert image_folder_classes(tmp_path) == ["cat", "zebra"]  # without dataset.classes: its folders
    with pytest.raises(DatasetUnavailableError, match="holds only test/: a test set"):
        load_dataset(cfg, "train")  # a node pointed at it says so instead of training on "test"
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        assert load_validation(cfg) is None  # nothing to hold out: the server evaluates test only
    assert "no validation split" in caplog.text
    assert len(load_validation(dcfg())) == 144  # digits: a real hold-out


def test_image_folder_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DatasetUnavailableError, match=str(missing)):
        load_dataset(dcfg(name="image-folder", data_dir=str(missing)), "train")
    with pytest.raises(DatasetUnavailableError, match="no class subfolders"):
        load_dataset(dcfg(name="image-folder", data_dir=str(tmp_path)), "train")
    _png(tmp_path / "a" / "0.png", (1, 1, 1))
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="'b'.*no images"):
        load_dataset(dcfg(name="image-folder", data_dir=str(tmp_path)), "train")
    (tmp_path / "train").mkdir()
    with pytest.raises(DatasetUnavailableError, match="neither test/ nor val/"):
        load_dataset(dcfg(name="image-folder", data_dir=str(tmp_path)), "train")


def test_a_decoded_folder_is_kept_and_never_served_stale(tmp_path: Path, monkeypatch) -> None:
    """The decoded images are kept under the data dir's hidden .feddifrc-decoded/ and read back
    (no image decoded again) while no image file changed; a rewritten image (even with its old
    modification time restored), an added or a removed one is decoded afresh."""
    import os

    from feddifrc_app.data.sources import image_folder

    for cls, rgb in COLOURS.items():
        for k in range(3):
            _png(tmp_path / "train" / cls / f"{k}.png", rgb, (8, 8))
        _png(tmp_path / "test" / cls / "t.png", rgb, (8, 8))
    cfg = dcfg(name="image-folder", data_dir=str(tmp_path), image_size=8, val_fraction=0.0)
    decoded: list[Path] = []
    real = image_folder._read_image
    monkeypatch.setattr(image_folder, "_read_image", lambda p, s: decoded.append(p) or real(p, s))

    first = load_dataset(cfg, "train")
    assert len(decoded) == 9
    kept = sorted(p.name for p in (tmp_path / ".feddifrc-decoded").iterdir())
    assert len(kept) == 1 and kept[0].startswith("train-8px-")
    assert image_folder_classes(tmp_path) == ["cat", "dog_house", "zebra"]  # the hidden folder: no class
    again = load_dataset(cfg, "train")
    assert len(decoded) == 9  # read back, nothing decoded
    assert again.fingerprint == first.fingerprint and torch.equal(again.images, first.images)
    assert np.array_equal(again.labels, first.labels)

    # Rewritten in place with another colour, its modification time put back: the change time differs.
    cat0 = tmp_path / "train" / "cat" / "0.png"
    before = cat0.stat()
    _png(cat0, (1, 2, 3), (8, 8))
    os.utime(cat0, ns=(before.st_atime_ns, before.st_mtime_ns))
    changed = load_dataset(cfg, "train")
    assert len(decoded) == 18 and changed.fingerprint != first.fingerprint
    assert changed.images[0, :, 4, 4].tolist() == [1, 2, 3]  # the new image, not the kept one

    _png(tmp_path / "train" / "zebra" / "3.png", COLOURS["zebra"], (8, 8))
    assert len(load_dataset(cfg, "train")) == 10
    (tmp_path / "train" / "dog_house" / "2.png").unlink()
    assert len(load_dataset(cfg, "train")) == 9
    assert len(load_dataset(cfg, "train")) == 9 and len(decoded) == 18 + 10 + 9  # the last one read back


@contextlib.contextmanager
def _unwritable(folder: Path) -> Iterator[None]:
    """``folder`` made unwritable for this process, then writable again. A user's read-only data
    folder is mode 0o555; root writes through that mode, so for root the folder is also made
    immutable (``chattr +i``: Linux refuses every write to it, root's too, and ``access(W_OK)``
    says so, as for a read-only mount). Skipped only when a probe file can still be created."""
    folder.chmod(0o555)
    chattr = shutil.which("chattr")
    immutable = (
        _can_write(folder)
        and chattr is not None
        and subprocess.run([chattr, "+i", str(folder)]).returncode == 0
    )
    try:
        if _can_write(folder):
            pytest.skip(f"{folder} stays writable for this user (mode 0o555, and chattr +i refused)")
        yield
    finally:
        if immutable:
            subprocess.run([str(chattr), "-i", str(folder)], check=True)
        folder.chmod(0o755)


def _can_write(folder: Path) -> bool:
    probe = folder / ".probe"
    try:
        probe.touch()
    except OSError:
        return False
    probe.unlink()
    return True


def _every_file(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


def _folder_of_images(root: Path) -> None:
    for cls, rgb in COLOURS.items():
        for k in range(3):
            _png(root / "train" / cls / f"{k}.png", rgb, (8, 8))
        _png(root / "test" / cls / "t.png", rgb, (8, 8))


def test_a_read_only_image_folder_is_decoded_in_memory_said_once(tmp_path: Path, monkeypatch, caplog) -> None:
    """A site's read-only data folder: every load decodes (nothing can be kept), gives the same
    images, says so in one line per process, and writes nothing, not even a temp file."""
    from feddifrc_app.data.sources import image_folder

    data = tmp_path / "data"
    _folder_of_images(data)
    cfg = dcfg(name="image-folder", data_dir=str(data), image_size=8, val_fraction=0.0)
    decoded: list[Path] = []
    real = image_folder._read_image
    monkeypatch.setattr(image_folder, "_read_image", lambda p, s: decoded.append(p) or real(p, s))
    before = _every_file(data)
    with _unwritable(data), caplog.at_level(logging.INFO, logger="flwr.feddifrc"):
        first, again = load_dataset(cfg, "train"), load_dataset(cfg, "train")
        assert len(load_dataset(cfg, "test")) == 3
        assert _every_file(data) == before  # no .feddifrc-decoded/, no partial file
    assert len(decoded) == 9 + 9 + 3  # decoded every time
    assert again.fingerprint == first.fingerprint and torch.equal(again.images, first.images)
    assert sorted(first.images[:, :, 4, 4].tolist()) == sorted([list(c) for c in COLOURS.values()] * 3)
    said = [r.getMessage() for r in caplog.records if "not writable" in r.getMessage()]
    assert said == [f"image folder {data} is not writable: its images are decoded in every process"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    kept = load_dataset(cfg, "train")  # writable again: kept, and the same images
    assert kept.fingerprint == first.fingerprint and len(list((data / ".feddifrc-decoded").iterdir())) == 1


def test_an_unwritable_cache_folder_costs_a_warning_and_leaves_no_partial_file(
    tmp_path: Path, caplog
) -> None:
    """The data folder writable, its .feddifrc-decoded/ not (another user made it): the write
    fails, the run goes on with the decoded images, and no temp file is left behind."""
    data = tmp_path / "data"
    _folder_of_images(data)
    cfg = dcfg(name="image-folder", data_dir=str(data), image_size=8, val_fraction=0.0)
    reference = load_dataset(cfg, "train")
    cache = data / ".feddifrc-decoded"
    for f in cache.iterdir():
        f.unlink()
    with _unwritable(cache), caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        got = load_dataset(cfg, "train")
        assert list(cache.iterdir()) == []
    assert got.fingerprint == reference.fingerprint and torch.equal(got.images, reference.images)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"could not write decoded cache {cache}/train-8px-")
    assert line.endswith("the split will be decoded again next time")


@pytest.mark.parametrize("damage", ["flip-pixel-byte", "valid-npz-other-pixel", "truncate"])
def test_a_damaged_decoded_folder_is_never_loaded_and_is_rewritten(
    tmp_path: Path, monkeypatch, caplog, damage: str
) -> None:
    from feddifrc_app.data.sources import image_folder

    _folder_of_images(tmp_path)
    cfg = dcfg(name="image-folder", data_dir=str(tmp_path), image_size=8, val_fraction=0.0)
    reference = load_dataset(cfg, "train")
    (path,) = (tmp_path / ".feddifrc-decoded").iterdir()
    if damage == "flip-pixel-byte":  # bit rot inside the images member: the zip's CRC no longer holds
        raw = bytearray(path.read_bytes())
        raw[raw.index(b"images.npy") + 200] ^= 0x01
        path.write_bytes(bytes(raw))
    elif damage == "valid-npz-other-pixel":  # a well-formed file whose pixels are not the key's
        with np.load(path) as z:
            stored = {k: z[k] for k in z.files}
        stored["images"][0, 0, 0, 0] ^= 0x01
        with open(path, "wb") as f:  # np.savez(path) would append .npz to a name without it
            np.savez(f, **stored)
    else:
        _truncate(path)
    decoded: list[Path] = []
    real = image_folder._read_image
    monkeypatch.setattr(image_folder, "_read_image", lambda p, s: decoded.append(p) or real(p, s))
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        got = load_dataset(cfg, "train")
    assert len(decoded) == 9  # decoded afresh, not read from the damaged file
    assert torch.equal(got.images, reference.images) and got.fingerprint == reference.fingerprint
    assert f"decoded cache {path} " in caplog.text and "rebuilding" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        assert load_dataset(cfg, "train").fingerprint == reference.fingerprint
    assert len(decoded) == 9 and caplog.text == ""  # rewritten whole: read back clean
    assert [p.name for p in (tmp_path / ".feddifrc-decoded").iterdir()] == [path.name]
