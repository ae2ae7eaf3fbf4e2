"""The cases the sparse-block op tests share: one table of block geometries, each named for what it
exercises, the dtypes and memory layouts the ops run over, and the inputs built from them.

A module picks geometries by name: ``params(*names)`` parametrizes a test (ids are the names) and
``select(*names)`` gives the same geometries in that order (modules seed their data with a geometry's
position in their selection). ``calc_block_params(*geometry)`` is its BlockParams.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch


class Geometry(NamedTuple):
    """One map and block shape: ``calc_block_params(H, W, bsize, ksize, stride, padding)``."""

    H: int
    W: int
    bsize: int | tuple[int, int]
    ksize: int | tuple[int, int]
    stride: int | tuple[int, int]
    padding: int | tuple[int, int]


GEOMETRIES: dict[str, Geometry] = {
    "halo2": Geometry(13, 11, (6, 5), 3, 1, 1),  # a 3 x 3 conv on rectangular blocks: halo 2 (2 x 2 phases)
    "square": Geometry(16, 16, 8, 3, 1, 1),  # square map and blocks
    "big-block": Geometry(7, 9, 16, 3, 1, 1),  # blocks larger than the map
    "stride2": Geometry(20, 14, (7, 5), 3, 2, 1),  # a strided conv
    "k5": Geometry(15, 12, 9, 5, 1, 2),  # a 5 x 5 conv: halo 4
    "k5-rect": Geometry(9, 10, (8, 6), 5, 1, 2),  # a 5 x 5 conv on rectangular blocks (2 x 3 phases)
    "1x1": Geometry(11, 10, 4, 1, 1, 0),  # a 1 x 1 conv: no halo
    "rect-kernel": Geometry(12, 13, (6, 8), (3, 5), 1, (0, 2)),  # a 3 x 5 kernel, padded in one axis only
    "many-blocks": Geometry(40, 36, 10, 5, 1, 2),  # many blocks: several OpenMP chunks
    "overlap3": Geometry(17, 19, 8, 6, 1, 3),  # bstride 3 < bsize 8: up to 3 x 3 blocks overlap a pixel
    # tiny maps for gradcheck (a numerical derivative per element)
    "tiny-halo2": Geometry(7, 6, (5, 4), 3, 1, 1),
    "tiny-stride2": Geometry(9, 7, 7, 3, 2, 1),
    "tiny-k5": Geometry(6, 7, 6, 5, 1, 2),
}

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LOW_PRECISION = [torch.float16, torch.bfloat16]
LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
FORMATS = [pytest.param(fmt, id=name) for name, fmt in LAYOUTS.items()]  # the memory formats, ids their names


def select(*names: str) -> list[Geometry]:
    """The named geometries, in that order."""
    return [GEOMETRIES[name] for name in names]


def params(*names: str) -> list:
    """The named geometries as ``pytest.param``s whose ids are their names."""
    return [pytest.param(GEOMETRIES[name], id=name) for name in names]


def memory_format(layout: str) -> torch.memory_format:
    """The memory format of a layout name of ``LAYOUTS``."""
    return LAYOUTS[layout]


def indices(bp, n: int, frac: float, seed: int) -> torch.Tensor:
    """Random active blocks of ``n`` maps (each block with probability ``frac``): ``[K, 3]`` int32, sorted."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand((n, bp.bcount_h, bp.bcount_w), generator=gen) < frac).nonzero().to(torch.int32)


def quarters(shape, dtype: torch.dtype, seed: int, layout: str = "nchw") -> torch.Tensor:
    """Multiples of 1/4 in [-2, 2]: exact in every dtype, and so are sums of a few of them, so results compare
    exactly whatever the summation order."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=gen).to(dtype) / 4).contiguous(memory_format=memory_format(layout))
