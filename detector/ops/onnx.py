"""The sbnet ops in standard ONNX operators, for ``torch.onnx.export(..., custom_translation_table=TABLE)``.

Each translation does the op's sparse work with stock operators (any ONNX runtime runs it, no custom
domain): the active blocks are found in the graph from the mask, and the blocks are moved by index, so the
convolutions between them still run on ``[K, C, bh, bw]`` blocks only.

- ``reduce_mask``: ``max``: the mask padded with -inf (a window wholly outside the map never wins), ``MaxPool``
  with kernel ``bsize`` and stride ``bstride`` = each block's max over its in-map window; ``avgpool=True``:
  the mean over the window's in-map pixels (the op's mean, in float64): the mask (float64) and a map of ones,
  zero-padded, each cut into the grid's windows by two ``Gather`` s of constant row/column indices and summed
  (``ReduceSum``) = the in-map sum and pixel count, mean = sum / count where the count is not 0. Then
  ``> tol`` (compared in float64, as the kernels compare), ``NonZero`` = the active (n, by, bx) rows in
  ascending order (the kernels' order).
- ``sparse_gather``: ``x`` zero-padded by the halo (the op's out-of-map zeros), viewed as
  ``[N * Hp * Wp, C]`` pixel rows, one ``Gather`` of the blocks' ``K * bh * bw`` pixel rows.
- ``sparse_scatter`` (and the in-place ``sparse_scatter_`` after functionalization): ``base`` padded by
  one tile at the bottom/right (tiles past the border land in the padding, dropped after), the tiles'
  pixel rows combined (``add``: the base's own rows gathered and added; ``relu``) and written with one
  ``ScatterND``.

Pixel row of block ``k`` = (n, by, bx), block pixel (i, j), in the padded map:
``(n * Hp + by * stride_h + i) * Wp + bx * stride_w + j`` - the offset is absorbed by the padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["table", "MIN_OPSET"]

MIN_OPSET = 18  # ScatterND with reduction, Pad with the axes input, ReduceMax with axes as input


def _op():
    from onnxscript import opset18

    return opset18


def _ints(values: list[int]):
    return _op().Constant(value_ints=[int(v) for v in values])


def _pixel_rows(indices, hp, wp, size_h, size_w, stride: list[int]):
    """Flat pixel rows ``[K * size_h * size_w]`` (int64) of the blocks at ``indices`` [K, 3] in a padded
    ``[N, Hp, Wp]`` map whose row/column 0 is the first block's first pixel; ``hp``, ``wp``, ``size_h``,
    ``size_w``: 1-D int64 graph values of one element."""
    op = _op()
    idx = op.Cast(indices, to=7)  # int64
    n = op.Gather(idx, _ints([0]), axis=1)  # [K, 1]
    by = op.Gather(idx, _ints([1]), axis=1)
    bx = op.Gather(idx, _ints([2]), axis=1)
    row0 = op.Add(op.Mul(n, hp), op.Mul(by, _ints([stride[0]])))  # [K, 1]
    col0 = op.Mul(bx, _ints([stride[1]]))
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    i = op.Reshape(op.Range(zero, op.Squeeze(size_h), one), _ints([1, -1, 1]))
    j = op.Reshape(op.Range(zero, op.Squeeze(size_w), one), _ints([1, 1, -1]))
    rows = op.Add(op.Unsqueeze(row0, _ints([2])), i)  # [K, size_h, 1]
    flat = op.Add(op.Mul(rows, wp), op.Add(op.Unsqueeze(col0, _ints([2])), j))  # [K, size_h, size_w]
    return op.Reshape(flat, _ints([-1]))


def _hw(t):
    op = _op()
    shape = op.Shape(t)
    return (op.Gather(shape, _ints([0])), op.Gather(shape, _ints([1])), op.Gather(shape, _ints([2])),
            op.Gather(shape, _ints([3])))


def _pad(t, top: int, left: int, bottom: int, right: int, value):
    op = _op()
    return op.Pad(t, _ints([0, 0, top, left, 0, 0, bottom, right]), value)


def _double(value: float):
    """A float64 scalar constant (``Constant(value_float=...)`` would round it to float32)."""
    import numpy as np
    from onnx import numpy_helper

    return _op().Constant(value=numpy_helper.from_array(np.array(float(value), dtype=np.float64)))


def _window_sums(t, bsize: Sequence[int], bstride: Sequence[int], bcount: Sequence[int]):
    """``[N, 1, bcount_h, bcount_w]``: the sum of each grid window of ``t`` (padded so that window (0, 0) starts
    at row/column 0 and every window lies inside), its rows and columns picked by constant indices."""
    import numpy as np
    from onnx import numpy_helper

    op = _op()

    def windows(count: int, size: int, stride: int):  # [count, size]: row (column) i of window b
        index = np.arange(count)[:, None] * stride + np.arange(size)[None, :]
        return op.Constant(value=numpy_helper.from_array(index.astype(np.int64)))

    rows = op.Gather(t, windows(bcount[0], bsize[0], bstride[0]), axis=2)  # [N, 1, bcount_h, bsize_h, Wp]
    cells = op.Gather(rows, windows(bcount[1], bsize[1], bstride[1]), axis=4)  # [N, 1, bch, bsh, bcw, bsw]
    return op.ReduceSum(cells, _ints([3, 5]), keepdims=0)


def reduce_mask(mask, bsize: Sequence[int], bstride: Sequence[int], boffset: Sequence[int], bcount: Sequence[int],
                tol: float, avgpool: bool):
    op = _op()
    top, left = -int(boffset[0]), -int(boffset[1])
    # enough rows/columns at the bottom/right for every grid block's window (the extra windows are sliced off)
    bottom = max(0, (bcount[0] - 1) * bstride[0] + bsize[0])
    right = max(0, (bcount[1] - 1) * bstride[1] + bsize[1])
    if avgpool:  # mean over the in-map pixels: windows wholly outside the map (count 0) are never active
        m = op.Cast(mask, to=11)  # float64, as the kernels take the mean
        zero = op.CastLike(op.Constant(value_float=0.0), m)
        total = _window_sums(_pad(m, top, left, bottom, right, zero), bsize, bstride, bcount)
        ones = op.Expand(op.CastLike(op.Constant(value_float=1.0), m), op.Shape(m))
        count = _window_sums(_pad(ones, top, left, bottom, right, zero), bsize, bstride, bcount)
        mean = op.Div(total, op.Max(count, op.CastLike(op.Constant(value_float=1.0), m)))
        active = op.And(op.Greater(count, zero), op.Greater(mean, _double(tol)))
    else:
        neg = op.CastLike(op.Constant(value_float=float("-inf")), mask)
        padded = _pad(mask, top, left, bottom, right, neg)
        pooled = op.MaxPool(padded, kernel_shape=list(bsize), strides=list(bstride))
        pooled = pooled[0] if isinstance(pooled, (tuple, list)) else pooled  # (values, optional indices)
        pooled = op.Slice(pooled, _ints([0, 0]), _ints(list(bcount)), _ints([2, 3]))
        active = op.Greater(op.Cast(pooled, to=11), _double(tol))  # in float64, as the kernels compare
    rows = op.Transpose(op.NonZero(active), perm=[1, 0])  # [K, 4]: n, 0, by, bx (row-major = ascending)
    return op.Cast(op.Gather(rows, _ints([0, 2, 3]), axis=1), to=6)  # int32


def sparse_gather(x, indices, bsize: Sequence[int], bstride: Sequence[int], boffset: Sequence[int]):
    op = _op()
    top, left = -int(boffset[0]), -int(boffset[1])
    padded = _pad(x, top, left, int(bsize[0]), int(bsize[1]), op.CastLike(op.Constant(value_float=0.0), x))
    n, c, hp, wp = _hw(padded)
    rows = op.Reshape(op.Transpose(padded, perm=[0, 2, 3, 1]), op.Concat(_ints([-1]), c, axis=0))
    where = _pixel_rows(indices, hp, wp, _ints([bsize[0]]), _ints([bsize[1]]), list(bstride))
    picked = op.Gather(rows, where, axis=0)
    blocks = op.Reshape(picked, op.Concat(_ints([-1, int(bsize[0]), int(bsize[1])]), c, axis=0))
    return op.Transpose(blocks, perm=[0, 3, 1, 2])


def sparse_scatter(blocks, indices, base, bstride: Sequence[int], boffset: Sequence[int], add: bool,
                   relu: bool = False):
    if any(int(v) != 0 for v in boffset):
        raise NotImplementedError("sbnet.sparse_scatter with a non-zero offset has no ONNX translation")
    op = _op()
    bshape = op.Shape(blocks)
    th, tw = op.Gather(bshape, _ints([2])), op.Gather(bshape, _ints([3]))
    n, c, h, w = _hw(base)
    # one tile of padding at the bottom/right: the stride is >= the tile, so every tile fits
    pads = op.Concat(_ints([0, 0, 0, 0, 0, 0]), op.Gather(_ints(list(bstride)), _ints([0])),
                     op.Gather(_ints(list(bstride)), _ints([1])), axis=0)
    padded = op.Pad(base, pads, op.CastLike(op.Constant(value_float=0.0), base))
    _, _, hp, wp = _hw(padded)
    rows = op.Reshape(op.Transpose(padded, perm=[0, 2, 3, 1]), op.Concat(_ints([-1]), c, axis=0))
    tile_rows = op.Reshape(op.Transpose(blocks, perm=[0, 2, 3, 1]), op.Concat(_ints([-1]), c, axis=0))
    where = _pixel_rows(indices, hp, wp, th, tw, list(bstride))
    if add:
        tile_rows = op.Add(tile_rows, op.Gather(rows, where, axis=0))
    if relu:
        tile_rows = op.Relu(tile_rows)
    rows = op.ScatterND(rows, op.Unsqueeze(where, _ints([1])), tile_rows)
    out = op.Transpose(op.Reshape(rows, op.Concat(n, hp, wp, c, axis=0)), perm=[0, 3, 1, 2])
    return op.Slice(out, _ints([0, 0]), op.Concat(h, w, axis=0), _ints([2, 3]))


def table() -> dict:
    """``{torch op overload: translation}`` for ``torch.onnx.export``'s ``custom_translation_table`` (the
    kernels must be loaded: they define the ops)."""
    lib = torch.ops.sbnet
    return {
        lib.reduce_mask.default: reduce_mask,
        lib.sparse_gather.default: sparse_gather,
        lib.sparse_scatter.default: sparse_scatter,
    }
