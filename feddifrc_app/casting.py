"""A value the user gave (a run-config key, a node-config key, a CLI argument) cast to its type,
with a one-line error that names where it came from, the value and what is allowed: integers,
finite numbers in a range, flags, strings, lists and paths. Stdlib only; config.py says which
key takes which.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Longest timeout (seconds) a key accepts: 30 days; 1e308 would overflow the waits it feeds.
MAX_TIMEOUT_S = 30 * 86400
# Bounds of every int / float key that sets no upper bound of its own: no count of rounds,
# epochs, nodes, images or negatives reaches 2^31 - 1 (torch and numpy take int32/int64 there,
# and 1e308 "rounds" would never end), and no weight, rate or temperature is above 1e9 (a large
# learning rate below it is still accepted: the run reports it as diverged).
MAX_INT = 2**31 - 1
MAX_FLOAT = 1e9
# A server step (eta, eta-l, server-learning-rate, tau) above 10 is of no use (FedAdam, eta 1e3: NaN).
MAX_STEP = 10.0
# q-FFL weighs node k by F_k^q: with losses up to ~10 (cross-entropy over 100+ classes early on)
# F^q leaves float32 at q ~ 38; the q-FFL paper's largest q is 15.
MAX_Q = 20.0
FLOAT32_TINY = 1.1754943508222875e-38  # numpy.finfo(float32).tiny: smaller is 0 in float32
# Smallest contrastive temperature (loss.temperature, moon.tau): similarities in [-1, 1] divided by
# it are logits up to 1e3, their gradients scaled as much; far below (1e-300: inf logits) every
# step is NaN. The papers' temperatures are 0.04-0.5.
MIN_TEMPERATURE = 1e-3


class ConfigError(ValueError):
    """A config key is missing, unknown, of the wrong type or out of range."""


def invalid(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}")


def did_you_mean(unknown: str, known: Iterable[str]) -> str:
    """``'train.lrr' (did you mean 'train.lr'?)``: an unknown key named with the nearest known one,
    else with the known keys of the same last part (``lr`` -> ``train.lr``), if any."""
    import difflib

    known = list(known)
    leaf = unknown.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(unknown, known, n=1, cutoff=0.7) or [
        k for k in known if k.rsplit(".", 1)[-1] == leaf
    ]
    return f"{unknown!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(unknown)


def as_int(key: str, v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("+-").isdigit():
        return int(v.strip())
    raise invalid(key, v, "expected an integer")


def as_float(key: str, v: Any) -> float:
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError
        out = float(v.strip() if isinstance(v, str) else v)
    except ValueError:
        raise invalid(key, v, "expected a number") from None
    if not math.isfinite(out):
        raise invalid(key, v, "expected a finite number")
    return out


def as_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.strip().lower() in ("true", "1", "yes")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise invalid(key, v, "expected true or false")


def as_str(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise invalid(key, v, "expected a string")
    if "\0" in v:  # no path, name or prompt holds one; os calls would raise a bare ValueError
        raise invalid(key, v, "contains a NUL byte (\\x00); remove it")
    return v


def int_list(key: str, v: Any) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    try:
        out = tuple(int(p) for p in as_str(key, v).split(",") if p.strip())
    except ValueError:
        raise invalid(key, v, "expected comma-separated integers, e.g. '1,2,3'") from None
    if not out:
        raise invalid(key, v, "expected at least one integer")
    return out


def _bound(x: float) -> str:
    """A range end as written: an int bound in full (2147483647, not 2.14748e+09), a float as :g."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def bounds(typ: type, rng: tuple[float | None, float | None, bool, bool]) -> tuple[Any, Any, bool, bool]:
    """A number key's range ``(lo, hi, lo_open, hi_open)`` as checked: no upper bound of its own
    means MAX_INT (int) or MAX_FLOAT (float); the reference page (tools/reference.py) reads it too."""
    lo, hi, lo_open, hi_open = rng
    return lo, (MAX_INT if typ is int else MAX_FLOAT) if hi is None else hi, lo_open, hi_open


def check_range(key: str, v: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> None:
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (
        hi is not None and (v >= hi if hi_open else v > hi)
    ):
        lo_s = "-inf" if lo is None else _bound(lo)
        hi_s = "inf" if hi is None else _bound(hi)
        raise invalid(
            key, v, f"expected a value in {'(' if lo_open else '['}{lo_s}, {hi_s}{')' if hi_open else ']'}"
        )


class PathError(ValueError):
    """A path given by the user that cannot be resolved (a symlink loop, a name too long): one
    line naming the key or argument it came from; ``why`` is the reason alone."""

    def __init__(self, name: str, value: str, why: str) -> None:
        self.why = f"cannot be resolved ({why}); pass a path to a real folder or file"
        super().__init__(f"{name} = {value!r} {self.why}")


def resolve_path(value: str, name: str) -> Path:
    """``value`` made absolute, ``~`` expanded and symlinks followed: the one place a path the user
    gave (a config key, a node key, a CLI argument ``name``) is resolved. A path that does not
    exist is fine (it may be created); one that cannot be resolved is a ``PathError``."""
    try:
        path = Path(os.path.expanduser(value)).resolve()
    except RuntimeError:  # Python < 3.13: resolve() on a symlink loop
        raise PathError(name, value, "a symlink loop") from None
    try:
        os.stat(path)  # Python >= 3.13 resolves a loop without raising; stat still meets it
    except OSError as e:
        if e.errno == errno.ELOOP or e.errno == errno.ENAMETOOLONG:
            why = "a symlink loop" if e.errno == errno.ELOOP else e.strerror
            raise PathError(name, value, why) from None
        # absent (created later), or refused later, naming it, by what uses it
    return path


def as_path(key: str, v: str) -> str:
    """A path key's value, resolved (``ConfigError`` naming the key when it cannot be). A relative
    path is refused: the ServerApp and every ClientApp would resolve it against its own working
    directory (under ``flwr run``, none of them is the user's), so each would use another folder."""
    if v and not os.path.isabs(os.path.expanduser(v)):
        raise invalid(
            key,
            v,
            "a relative path resolves against each Flower process's own working directory (the "
            "ServerApp's and every node's, not yours): give an absolute path or one starting with ~",
        )
    try:
        return str(resolve_path(v, key)) if v else ""
    except PathError as e:
        raise invalid(key, v, e.why) from None


def as_folder(key: str, raw: Any, v: str) -> str:
    """A folder key's value, resolved: refused if something other than a folder is there, or a
    file above it (either would fail later, as a bare errno in someone else's words); absent is
    fine (it is created)."""
    path = as_path(key, v)
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise invalid(key, raw, f"{path} exists and is not a folder; expected a folder path")
    if path and (above := file_above(Path(path))):
        raise invalid(
            key, raw, f"{above} is a file, so no folder can be created under it; expected a folder path"
        )
    return path


def file_above(path: Path) -> Path | None:
    """The nearest existing folder above ``path`` when it is not a folder (a file: nothing can be
    created under it), else None."""
    above = next((p for p in path.parents if os.path.exists(p)), None)
    return above if above is not None and not os.path.isdir(above) else None
