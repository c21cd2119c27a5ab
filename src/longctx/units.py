"""Sizes and counts as people write them, parsed one way for every command, config file and function.

- A **count** (tokens, steps, layers): an int, or text of one (``"131072"``, ``"131_072"``), or scientific notation
  of a whole number (``"1e5"``, ``1.3e5`` as a float, ``"1.0e+3"``).
- A **size** in bytes: text with a unit (``"40GiB"``, ``"40 GB"``, ``"512MiB"``, ``"1.5TiB"``; GB and GiB are both
  2**30, as GPU memory is quoted), or an int of bytes from Python. Text without a unit is refused with the fix
  (``"40"`` -> write ``40GiB``), and so is an int below 1 MiB (40 bytes of GPU memory is a missing unit, not a plan).
"""

from __future__ import annotations

import argparse
import re

__all__ = ["parse_count", "to_count", "parse_bytes", "count_arg", "counts_arg"]

_NUMBER = re.compile(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?")
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", flags=re.IGNORECASE)


def to_count(value: object) -> int | None:
    """The whole number ``value`` stands for (an int, a whole float, or text of one, scientific notation included),
    or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            f = float(text)
            return int(f) if f.is_integer() else None
    return None


def parse_count(value: object, name: str, minimum: int | None = None) -> int:
    """`to_count`, or a ValueError naming ``name``, what was received and the fix (also below ``minimum``)."""
    n = to_count(value)
    if n is None:
        raise ValueError(f"{name} must be a whole number (e.g. 131072 or 1.3e5), got {value!r}")
    if minimum is not None and n < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")
    return n


def count_arg(name: str, minimum: int | None = None):
    """An argparse ``type=`` for a count (``--seq-length 1e5``)."""

    def parse(text: str) -> int:
        try:
            return parse_count(text, name, minimum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def counts_arg(name: str, minimum: int | None = None):
    """An argparse ``type=`` for comma-separated counts (``--seq-lengths 8192,32768,1e5``)."""

    def parse(text: str) -> list[int]:
        try:
            return [parse_count(x, name, minimum) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e} (in {text!r}: comma-separated whole numbers)") from None

    return parse


def parse_bytes(value: str | int | float, name: str = "budget") -> int:
    """A size (module docstring) -> bytes.

    Raises:
        TypeError: not text or a number. ValueError: text without a unit, an unknown unit, a non-positive size, or
        an int below 1 MiB (the message suggests the size with its unit).
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a size like '40GiB' or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        size = float(value)
        if 0 < size < 2**20:
            raise ValueError(
                f"{name}={value!r} would be {value!r} bytes; give the unit: {name}='{value:g}GiB' (or a number of "
                "bytes of at least 1 MiB)"
            )
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m is None:
            raise ValueError(f"{name} must be a size like '40GiB', '16GB' or '512MiB', got {value!r}")
        if m.group(2) is None:
            raise ValueError(
                f"{name} needs a unit: {value.strip()!r} has none; write {m.group(1)}GiB (or MiB, GB, TiB, B)"
            )
        unit = m.group(2).upper().rstrip("B").rstrip("I")
        size = float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    else:
        raise TypeError(f"{name} must be a size like '40GiB' or a number of bytes, got {type(value).__name__}")
    if not size > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return int(size)
