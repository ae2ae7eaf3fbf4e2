"""Many KITTI label / result files read at once: the evaluation CLI reads ~15,000 files (7,480 labels and
7,480 results of the KITTI training set), where parsing file by file costs more than the metric.

The files' tokens are parsed in one batch (one float64 conversion for all numbers), under conditions that
guarantee every line has exactly the expected fields; any file that does not meet them, or any value
that breaks a rule, sends the files through :func:`detector.data.kitti.read_label` one by one, which
raises the one error naming the file and line. Values and errors are those of ``read_label``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from detector.data.kitti import (
    _CLASS_SET,
    KittiLabels,
    fields_valid,
    labels_from_fields,
    parse_label_lines,
    read_label_text,
)

_LINE_START = re.compile(r"^[ \t\r\f\v]*(\S)", re.MULTILINE)  # first character of each non-blank line


def read_labels(paths: Sequence[str | Path], with_score: bool) -> list[KittiLabels]:
    """Read label files (``with_score=False``, 15 fields a line) or result files (True, 16 fields)."""
    paths = [Path(p) for p in paths]
    texts = [read_label_text(p) for p in paths]
    out = _parse_batch(texts, 16 if with_score else 15)
    if out is None:  # something is off: the file-by-file parser names the file and line
        out = [parse_label_lines(t.splitlines(), p, with_score) for t, p in zip(texts, paths, strict=True)]
    return out


def _parse_batch(texts: list[str], n_fields: int) -> list[KittiLabels] | None:
    """All files' records, or None when a file breaks a rule. A file is taken only if its token count is
    n_fields × its non-blank lines, every line starts with a letter, and the tokens at multiples of n_fields
    are class names while all others parse as numbers: a line with another field count would then put a
    class name (or a word like nan) where a number must be, which fails the numeric or finite test."""
    tokens: list[str] = []
    counts = []
    for text in texts:
        toks = text.split()
        starts = "".join(_LINE_START.findall(text))
        if len(toks) != n_fields * len(starts) or not (starts.isalpha() or not starts):
            return None
        tokens += toks
        counts.append(len(starts))
    names = tokens[0::n_fields]
    if not set(names) <= _CLASS_SET:
        return None
    del tokens[0::n_fields]
    try:
        a = np.array(tokens, dtype=np.float64).reshape(len(names), n_fields - 1)
    except ValueError:
        return None
    name_arr = np.array(names, dtype="<U16")
    if not fields_valid(name_arr, a):
        return None
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [
        labels_from_fields(name_arr[lo:hi], a[lo:hi]) if hi > lo else KittiLabels.empty(n_fields == 16)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
