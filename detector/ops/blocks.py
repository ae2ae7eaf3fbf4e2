"""Block geometry of the SBNet sparse-block ops.

A sparse-block convolution cuts its input map into overlapping blocks of ``bsize`` pixels, runs a dense
convolution (``ksize``, ``stride``, VALID padding) on each active block, and writes each block's output
tile back into the output map. For the tiles to cover the convolution's output exactly once, the blocks
must sit on a grid with

    block stride  bstride = bsize - ksize + stride      (input pixels between neighbouring blocks)
    block offset  boffset = -padding                    (input row/column of block (0, 0)'s first pixel)
    output block  obsize  = (bsize - ksize) // stride + 1   (output tile of one block)
    halo                  = ksize - stride              (input pixels shared by neighbouring blocks)

and ``bstride == obsize * stride``, i.e. ``(bsize - ksize) % stride == 0``. Block ``(by, bx)`` reads
input rows ``boffset + by * bstride ... + bsize`` (columns alike; pixels outside the map read as 0) and
its output tile is output rows ``by * obsize ... (by + 1) * obsize`` (clipped to the output map). The
grid has enough blocks to cover the whole convolution output map, ``out = (H + 2 p - k) // s + 1``:
``bcount = ceil(out / obsize)``.

Every size is a pair (rows, columns); the helpers accept an int for a square size.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockParams", "calc_block_params", "pair"]


def pair(value: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    """``value`` as a (rows, columns) pair of Python ints; a clear error naming ``name`` for anything else."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (int(value[0]), int(value[1]))
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


@dataclass(frozen=True)
class BlockParams:
    """Geometry of one sparse-block convolution: input map, output map, block grid, conv parameters.

    All fields are (rows, columns) pairs split into ``_h`` / ``_w`` ints. Build it with
    :func:`calc_block_params`, which checks the constraints; the pair-valued properties
    (``bsize``, ``bstride``, ...) are for convenience.
    """

    in_h: int  # input map rows H
    in_w: int  # input map columns W
    out_h: int  # convolution output map rows H' = (H + 2 p - k) // s + 1
    out_w: int  # convolution output map columns W'
    bsize_h: int  # input block rows (with halo)
    bsize_w: int
    bstride_h: int  # input pixels between neighbouring blocks = bsize - ksize + stride
    bstride_w: int
    boffset_h: int  # input row of block (0, 0)'s first pixel = -padding
    boffset_w: int
    bcount_h: int  # blocks in the grid = ceil(out_h / obsize_h)
    bcount_w: int
    obsize_h: int  # output tile rows of one block = (bsize - ksize) // stride + 1
    obsize_w: int
    ksize_h: int
    ksize_w: int
    stride_h: int
    stride_w: int
    padding_h: int
    padding_w: int

    @property
    def in_size(self) -> tuple[int, int]:
        return (self.in_h, self.in_w)

    @property
    def out_size(self) -> tuple[int, int]:
        return (self.out_h, self.out_w)

    @property
    def bsize(self) -> tuple[int, int]:
        return (self.bsize_h, self.bsize_w)

    @property
    def bstride(self) -> tuple[int, int]:
        return (self.bstride_h, self.bstride_w)

    @property
    def boffset(self) -> tuple[int, int]:
        return (self.boffset_h, self.boffset_w)

    @property
    def bcount(self) -> tuple[int, int]:
        return (self.bcount_h, self.bcount_w)

    @property
    def obsize(self) -> tuple[int, int]:
        return (self.obsize_h, self.obsize_w)

    @property
    def ksize(self) -> tuple[int, int]:
        return (self.ksize_h, self.ksize_w)

    @property
    def stride(self) -> tuple[int, int]:
        return (self.stride_h, self.stride_w)

    @property
    def padding(self) -> tuple[int, int]:
        return (self.padding_h, self.padding_w)

    @property
    def halo(self) -> tuple[int, int]:
        """Input pixels shared by neighbouring blocks, ``ksize - stride`` (negative: gaps)."""
        return (self.ksize_h - self.stride_h, self.ksize_w - self.stride_w)

    @property
    def num_blocks(self) -> int:
        """Blocks per sample in the grid, ``bcount_h * bcount_w``."""
        return self.bcount_h * self.bcount_w


@dataclass(frozen=True)
class _Axis:
    """Geometry along one axis (see the module docstring)."""

    size: int
    out: int
    bsize: int
    bstride: int
    boffset: int
    bcount: int
    obsize: int
    ksize: int
    stride: int
    padding: int


def _axis(name: str, size: int, bsize: int, ksize: int, stride: int, padding: int) -> _Axis:
    """Geometry along one axis (``name`` is 'h' or 'w'); raises ValueError naming the bad argument."""
    if size < 1:
        raise ValueError(f"calc_block_params: map size along {name} must be >= 1, got {size}")
    if ksize < 1:
        raise ValueError(f"calc_block_params: ksize must be >= 1, got {ksize} along {name}")
    if stride < 1:
        raise ValueError(f"calc_block_params: stride must be >= 1, got {stride} along {name}")
    if padding < 0:
        raise ValueError(f"calc_block_params: padding must be >= 0, got {padding} along {name}")
    if bsize < ksize:
        raise ValueError(f"calc_block_params: bsize ({bsize}) must be >= ksize ({ksize}) along {name}")
    if (bsize - ksize) % stride != 0:
        raise ValueError(
            f"calc_block_params: (bsize - ksize) must be a multiple of stride along {name} "
            f"(bsize={bsize}, ksize={ksize}, stride={stride}); otherwise output tiles do not line up"
        )
    out = (size + 2 * padding - ksize) // stride + 1
    if out < 1:
        raise ValueError(
            f"calc_block_params: convolution output is empty along {name} "
            f"(size={size}, ksize={ksize}, stride={stride}, padding={padding})"
        )
    obsize = (bsize - ksize) // stride + 1
    return _Axis(size=size, out=out, bsize=bsize, bstride=bsize - ksize + stride, boffset=-padding,
                 bcount=-(-out // obsize), obsize=obsize, ksize=ksize, stride=stride, padding=padding)


def calc_block_params(
    H: int,
    W: int,
    bsize: int | tuple[int, int] = (16, 16),
    ksize: int | tuple[int, int] = 3,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 1,
) -> BlockParams:
    """Block geometry of a sparse-block convolution on an ``H x W`` input map.

    ``bsize`` is the input block size (halo included), ``ksize``/``stride``/``padding`` those of the
    (total) convolution run on each block with VALID padding; ``padding`` plays the part of the dense
    convolution's zero padding. See the module docstring for the formulas. Raises ValueError when
    ``bsize < ksize``, ``(bsize - ksize) % stride != 0`` or the output map would be empty.
    """
    for arg_name, arg in (("H", H), ("W", W)):
        if isinstance(arg, bool) or not isinstance(arg, int):
            raise TypeError(f"calc_block_params: {arg_name} must be an int, got {arg!r}")
    bs, ks, st, pd = (pair(v, f"calc_block_params: {n}") for v, n in ((bsize, "bsize"), (ksize, "ksize"),
                                                (stride, "stride"), (padding, "padding")))
    h = _axis("h", H, bs[0], ks[0], st[0], pd[0])
    w = _axis("w", W, bs[1], ks[1], st[1], pd[1])
    return BlockParams(
        in_h=h.size, in_w=w.size, out_h=h.out, out_w=w.out,
        bsize_h=h.bsize, bsize_w=w.bsize, bstride_h=h.bstride, bstride_w=w.bstride,
        boffset_h=h.boffset, boffset_w=w.boffset, bcount_h=h.bcount, bcount_w=w.bcount,
        obsize_h=h.obsize, obsize_w=w.obsize, ksize_h=h.ksize, ksize_w=w.ksize,
        stride_h=h.stride, stride_w=w.stride, padding_h=h.padding, padding_w=w.padding,
    )
