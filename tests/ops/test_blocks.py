"""calc_block_params: known answers and clear errors."""

import pytest

from detector.ops import BlockParams, calc_block_params


def test_known_answer_sbnet_default():
    bp = calc_block_params(800, 704, bsize=(16, 16), ksize=3, stride=1, padding=1)
    assert (bp.in_h, bp.in_w, bp.out_h, bp.out_w) == (800, 704, 800, 704)
    assert bp.bsize == (16, 16) and bp.bstride == (14, 14) and bp.boffset == (-1, -1)
    assert bp.obsize == (14, 14) and bp.halo == (2, 2)
    # ceil(800 / 14) = 58, ceil(704 / 14) = 51
    assert bp.bcount == (58, 51) and bp.num_blocks == 58 * 51


def test_known_answer_strided_rectangular():
    # H=13: out = (13 + 2 - 3) // 2 + 1 = 7; bsize 7 -> obsize (7 - 3) // 2 + 1 = 3, bstride 7 - 3 + 2 = 6
    bp = calc_block_params(13, 10, bsize=(7, 5), ksize=(3, 1), stride=(2, 2), padding=(1, 0))
    assert (bp.out_h, bp.out_w) == (7, 5)  # W: (10 - 1) // 2 + 1 = 5
    assert bp.obsize == (3, 3) and bp.bstride == (6, 6) and bp.boffset == (-1, 0)
    assert bp.bcount == (3, 2)  # ceil(7 / 3), ceil(5 / 3)
    assert bp.ksize == (3, 1) and bp.stride == (2, 2) and bp.padding == (1, 0)
    # the output tile of a block starts where its input window's first conv output lands
    assert bp.bstride_h == bp.obsize_h * bp.stride_h


@pytest.mark.parametrize(
    "H, W, bsize, ksize, stride, padding",
    [
        (5, 5, 16, 3, 1, 1),
        (1, 1, 3, 3, 1, 1),
        (9, 17, (8, 6), 5, 1, 2),
        (30, 31, 9, 3, 2, 0),
        (7, 7, 4, 1, 1, 0),
    ],
)
def test_grid_covers_output_map(H, W, bsize, ksize, stride, padding):
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    assert isinstance(bp, BlockParams)
    for out, ob, cnt in ((bp.out_h, bp.obsize_h, bp.bcount_h), (bp.out_w, bp.obsize_w, bp.bcount_w)):
        assert cnt * ob >= out > (cnt - 1) * ob


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bsize=2, ksize=3), "bsize"),
        (dict(bsize=8, ksize=3, stride=2), "multiple of stride"),
        (dict(stride=0), "stride"),
        (dict(padding=-1), "padding"),
        (dict(ksize=0), "ksize"),
        (dict(bsize=(16, 16, 16)), "bsize"),
        (dict(ksize=2.5), "ksize"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        calc_block_params(20, 20, **kwargs)


def test_empty_output_and_bad_sizes():
    with pytest.raises(ValueError, match="output is empty"):
        calc_block_params(2, 20, bsize=5, ksize=5, stride=1, padding=0)
    with pytest.raises(ValueError, match="map size"):
        calc_block_params(0, 20)
    with pytest.raises(TypeError, match="H must be an int"):
        calc_block_params(20.0, 20)


def test_frozen():
    bp = calc_block_params(20, 20)
    with pytest.raises(AttributeError):
        bp.bsize_h = 3
