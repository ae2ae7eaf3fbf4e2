"""Many KITTI label / result files read at once: the evaluation CLI reads ~15,000 files (7,480 labels and
7,480 results of the KITTI training set), where parsing file by file in Python costs more than the metric.

All files' bytes are tokenized and converted with NumPy in one pass. A number written as
``[+-]digits[.digits]`` with at most 15 digits (every number our writer and KITTI's files write) is
m / 10^k with m < 2^53 and 10^k exact, so one IEEE division gives the correctly rounded double, the same
value ``float()`` (and the devkit's ``%lf``) reads; other spellings (``1e-7``, ``nan``, long digit
strings) go through ``float()`` one by one. Any file that breaks a rule (a line with another field count,
an unknown class, a non-numeric or non-finite value, a negative size, non-ASCII bytes, lone carriage
returns) sends the files through :func:`detector.data.kitti_labels.read_label`, which raises the one error naming
the file and line. Values and errors are those of ``read_label``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from detector.data.kitti_labels import (
    OBJECT_TYPES,
    KittiFormatError,
    KittiLabels,
    fields_valid,
    labels_from_fields,
    read_label,
)

_WS = np.zeros(256, bool)
_WS[[9, 10, 13, 32]] = True  # tab, newline, carriage return (of "\r\n"), space
_OK_BYTE = np.zeros(256, bool)
_OK_BYTE[32:127] = True
_OK_BYTE[[9, 10, 13]] = True
_MAX_DIGITS = 15  # m < 10^15 < 2^53: exact in float64
_POW10 = np.array([float(f"1e{i}") for i in range(_MAX_DIGITS + 1)])  # exact powers of ten


def read_labels(paths: Sequence[str | Path], with_score: bool) -> list[KittiLabels]:
    """Read label files (``with_score=False``, 15 fields a line) or result files (True, 16 fields)."""
    paths = [Path(p) for p in paths]
    try:
        blobs = [p.read_bytes() for p in paths]
    except FileNotFoundError as e:
        raise KittiFormatError(e.filename, "label file not found") from None
    out = _parse(blobs, 16 if with_score else 15)
    if out is None:  # something is off: the file-by-file parser names the file and line
        out = [read_label(p, with_score) for p in paths]
    return out


def _parse(blobs: list[bytes], n_fields: int) -> list[KittiLabels] | None:
    sizes = np.array([len(x) + 1 for x in blobs], np.int64)
    b = np.frombuffer(b"\n".join([*blobs, b""]), np.uint8)  # every file ends with a newline
    if not _OK_BYTE[b].all():
        return None
    nl_pos = np.flatnonzero(b == 10)
    cr = np.flatnonzero(b == 13)
    if cr.size and (b[np.minimum(cr + 1, b.size - 1)] != 10).any():  # a carriage return not before a newline
        return None
    edge = np.diff(_WS[b].view(np.int8), prepend=np.int8(1), append=np.int8(1))  # -1: token start, 1: end
    starts, ends = np.flatnonzero(edge == -1), np.flatnonzero(edge == 1)
    del edge
    per_line = np.bincount(np.searchsorted(nl_pos, starts))
    if not (per_line[per_line > 0] == n_fields).all():
        return None
    n_rec = starts.size // n_fields
    first = np.arange(n_rec) * n_fields
    name_idx = _names(b, starts[first], ends[first])
    if name_idx is None:
        return None
    num = np.ones(starts.size, bool)
    num[first] = False
    values = _numbers(b, starts[num], ends[num])
    if values is None:
        return None
    a = values.reshape(n_rec, n_fields - 1)
    names = np.asarray(OBJECT_TYPES, dtype="<U16")[name_idx]
    if not fields_valid(names, a):
        return None
    file_of = np.searchsorted(np.cumsum(sizes), starts[first], side="right")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(file_of, minlength=len(blobs)))])
    return [
        labels_from_fields(names[lo:hi], a[lo:hi]) if hi > lo else KittiLabels.empty(n_fields == 16)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def _names(b: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """Index into OBJECT_TYPES of each name token, or None if one is not a class name (byte for byte)."""
    idx = np.full(starts.size, -1)
    length = ends - starts
    for k, name in enumerate(OBJECT_TYPES):
        code = np.frombuffer(name.encode(), np.uint8)
        cand = np.flatnonzero(length == code.size)
        same = (b[starts[cand, None] + np.arange(code.size)] == code).all(axis=1)
        idx[cand[same]] = k
    return None if (idx < 0).any() else idx


def _numbers(b: np.ndarray, starts: np.ndarray, ends: np.ndarray, chunk: int = 1 << 20) -> np.ndarray | None:
    """float64 of each token (see the module doc), or None if one is not a number."""
    out = np.empty(starts.size)
    for lo in range(0, starts.size, chunk):
        s, e = starts[lo : lo + chunk], ends[lo : lo + chunk]
        length = e - s
        width = min(int(length.max(initial=1)), _MAX_DIGITS + 3)
        pos = s[:, None] + np.arange(width)
        inside = pos < e[:, None]
        c = np.where(inside, b[np.minimum(pos, b.size - 1)], np.uint8(32))
        digit = (c >= 48) & (c <= 57)
        dot = c == 46
        signed = (c[:, 0] == 45) | (c[:, 0] == 43)
        n_digits = np.count_nonzero(digit, axis=1)
        n_dots = np.count_nonzero(dot, axis=1)
        fast = (
            (length <= width)
            & (n_digits + n_dots + signed == length)
            & (n_dots <= 1)
            & (n_digits >= 1)
            & (n_digits <= _MAX_DIGITS)
        )
        m = np.zeros(s.size, np.int64)
        for j in range(width):
            m = np.where(digit[:, j], m * 10 + (c[:, j].astype(np.int64) - 48), m)
        k = np.where(n_dots > 0, length - np.argmax(dot, axis=1) - 1, 0)  # digits after the dot
        v = m / _POW10[np.clip(k, 0, _MAX_DIGITS)]  # (tokens that are not fast are overwritten below)
        v = np.where(c[:, 0] == 45, -v, v)
        for i in np.flatnonzero(~fast):  # other spellings: float() one by one
            try:
                v[i] = float(b[s[i] : e[i]].tobytes())
            except ValueError:
                return None
        out[lo : lo + s.size] = v
    return out
