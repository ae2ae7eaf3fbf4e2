"""What a sparse unit keeps for its backward is block-sized: it grows with the active blocks and not with the map.

Counted with ``torch.autograd.graph.saved_tensors_hooks``: the distinct storages autograd saves while a unit in
training mode (batch statistics) runs on a hand-made mask, parameters left out (they are alive anyway). Two rules
follow from "the backward keeps the active blocks only":

- doubling the active blocks (a second tile far from the first, so that no halo is shared) doubles the bytes;
- doubling the empty area of the map (the same tiles on a map twice as wide) leaves the bytes unchanged.

A map-sized tensor saved anywhere (the unit's input map for a weight gradient, its output map for the ReLU's
backward, a mask at the map's size) breaks the second rule. Both execution backends are checked: the composition
of the gather/scatter kernels and oneDNN's convolutions (the CPU's), and the fused Triton kernels (a GPU's; here
interpreted on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from detector.nn.chain import SparseConvChain

T = 8  # output tile
UNITS = {
    # a stage's later unit: stride 1, identity shortcut, written in place into its input
    "identity": dict(in_channels=8, channels=(8, 8), ksizes=(3, 3), strides=(1, 1), shortcut="identity"),
    # a stage's first unit: stride 2, projection shortcut
    "projection": dict(in_channels=8, channels=(16, 16), ksizes=(3, 3), strides=(2, 1), shortcut="projection"),
    # the stem, the neck, the head: no shortcut
    "none": dict(in_channels=4, channels=(8,), ksizes=(3,), strides=(1,), shortcut="none"),
}


def _mask(H: int, W: int, tiles: list[tuple[int, int]], stride: int) -> torch.Tensor:
    """Ones on the input pixels of the given output tiles (tile rows/columns at the unit's output)."""
    m = torch.zeros(2, 1, H, W)
    s = T * stride
    for ty, tx in tiles:
        m[0, :, ty * s : (ty + 1) * s, tx * s : (tx + 1) * s] = 1
    return m


def saved_bytes(kind: str, H: int, W: int, tiles: list[tuple[int, int]]) -> int:
    torch.manual_seed(0)
    unit = SparseConvChain(**UNITS[kind], block_size=T).train()
    params = {p.untyped_storage().data_ptr() for p in unit.parameters()}
    x = torch.randn(2, unit.in_channels, H, W).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    mask = _mask(H, W, tiles, unit.stride)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    src = x * 1.0  # a non-leaf input the unit owns (an identity unit writes into it)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unit(src, mask=mask, blocks=None, inplace=kind == "identity")
    out.square().sum().backward()  # the saved tensors give a backward
    assert x.grad is not None and torch.isfinite(x.grad).all()
    return sum(seen.values())


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("DETECTOR_FUSED", request.param)
    return request.param


@pytest.mark.parametrize("kind", list(UNITS))
def test_saved_bytes_follow_the_active_blocks(kind, backend):
    stride = 2 if kind == "projection" else 1
    size = 6 * T * stride  # a 6 x 6 grid of output tiles
    one = saved_bytes(kind, size, size, [(0, 0)])
    two = saved_bytes(kind, size, size, [(0, 0), (4, 4)])
    assert one > 0
    assert 1.9 <= two / one <= 2.1, (one, two)


@pytest.mark.parametrize("kind", list(UNITS))
def test_saved_bytes_ignore_the_empty_area(kind, backend):
    stride = 2 if kind == "projection" else 1
    size = 6 * T * stride
    narrow = saved_bytes(kind, size, size, [(1, 1), (4, 2)])
    wide = saved_bytes(kind, size, 2 * size, [(1, 1), (4, 2)])
    tall = saved_bytes(kind, 2 * size, size, [(1, 1), (4, 2)])
    assert narrow == wide == tall, (narrow, wide, tall)
