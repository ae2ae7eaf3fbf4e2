"""One pass of a conv chain over gathered blocks: convolutions with VALID padding, batch norm, ReLU.

:class:`BlockPass` is the body of a sparse :class:`~detector.nn.chain.SparseConvChain` between its one
gather and its one scatter. Its named pieces:

- :meth:`BlockPass.unknown` - does BN slot ``j`` still need batch moments (statistics passes)?
- :meth:`BlockPass.moments` - moments of BN slot ``j``'s input over the tile regions' in-map pixels;
- :meth:`BlockPass.norm` - BN slot ``j`` applied to ``z`` (known, synchronized, native or region moments);
- :meth:`BlockPass.conv_norm` - a convolution followed by its BN (folded into the conv in eval mode);
- :meth:`BlockPass.relu_zero` - ReLU, with block pixels outside the level's map zeroed first when a
  ``k > 1`` convolution follows (they are the dense twin's zero padding);
- :meth:`BlockPass.run` - the whole chain, pre- or post-activation, with the shortcut.

It reads its chain through the :class:`Chain` protocol (no import of :mod:`detector.nn.chain`).

BN slot ``j`` normalizes with ``known[j]`` when given, else with the moments of this pass's blocks. With
``collect``, a pass stops at the first chain slot whose batch moments are unknown and returns
``(None, moments)`` for it (and for the post-activation projection's BN when that one is unknown too):
that is how the chunked path (:mod:`detector.nn.chunked`) gathers exact statistics chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .geometry import ChainGeometry, ConvSpec, LevelMasks, zero_pixels
from .norm import (
    Moments,
    blocks_batch_norm,
    needs_sync,
    region_moments,
    running_scale_shift,
    scale_shift,
    sync_moments,
    uses_batch_stats,
)

__all__ = ["BlockPass", "Chain"]


class Chain(Protocol):
    """What a pass reads of its chain (a :class:`~detector.nn.chain.SparseConvChain`)."""

    name: str
    convs: Sequence[nn.Conv2d]
    bns: Sequence[nn.BatchNorm2d]
    specs: tuple[ConvSpec, ...]
    stride: int
    preact: bool
    shortcut: Literal["identity", "projection", "none"]
    proj: nn.Conv2d | None
    proj_bn: nn.BatchNorm2d | None
    slot_levels: tuple[int, ...]

    @property
    def slots(self) -> list[nn.BatchNorm2d]: ...


class BlockPass:
    """The chain ``chain`` run once on gathered blocks of geometry ``geo`` (module docstring)."""

    def __init__(
        self,
        chain: Chain,
        geo: ChainGeometry,
        masks: list[LevelMasks],
        known: list[Moments | None],
        collect: bool,
    ) -> None:
        self.chain, self.geo, self.masks, self.known, self.collect = chain, geo, masks, known, collect
        self.slots: list[nn.BatchNorm2d] = chain.slots
        self.new: dict[int, Moments] = {}  # moments computed by this pass, by slot

    def _level(self, j: int) -> int:
        return self.chain.slot_levels[j]

    def unknown(self, j: int) -> bool:
        """Whether slot ``j`` normalizes with batch moments that are neither known nor computed yet."""
        return uses_batch_stats(self.slots[j]) and self.known[j] is None and j not in self.new

    def moments(self, j: int, z: torch.Tensor) -> Moments:
        """Slot ``j``'s moments of ``z`` over the tile regions (kept in :attr:`new`)."""
        level = self._level(j)
        m = region_moments(z, self.geo.levels[level], self.masks[level])
        self.new[j] = m
        return m

    def norm(self, j: int, z: torch.Tensor) -> torch.Tensor:
        """BN slot ``j`` applied to ``z`` (whole blocks, halo included)."""
        bn = self.slots[j]
        if not uses_batch_stats(bn):
            s, t = running_scale_shift(bn)
            return torch.addcmul(t.view(1, -1, 1, 1), z, s.view(1, -1, 1, 1))
        m = self.known[j] or self.new.get(j)
        level = self._level(j)
        lvl, lm = self.geo.levels[level], self.masks[level]
        if m is None and not self.collect and needs_sync(bn):  # DDP: statistics of all processes
            m = self.new[j] = sync_moments(bn, region_moments(z, lvl, lm), z)
        if m is None:  # this pass's own moments (a collecting pass stops before it gets here)
            y, m = blocks_batch_norm(bn, z, lvl, lm)
            if m is not None:  # else nn.BatchNorm2d's kernel updated the running statistics itself
                self.new[j] = m
            return y
        s, t = scale_shift(bn, m.mean, m.var)
        return torch.addcmul(t.view(1, -1, 1, 1), z, s.view(1, -1, 1, 1))

    def conv_norm(self, conv: nn.Conv2d, j: int, a: torch.Tensor, stride: int) -> torch.Tensor:
        """``norm(j, conv(a))`` with VALID padding; eval-mode BN folded into the convolution."""
        bn = self.slots[j]
        if uses_batch_stats(bn):
            return self.norm(j, F.conv2d(a, conv.weight, None, stride))
        s, t = running_scale_shift(bn)
        return F.conv2d(a, conv.weight * s.view(-1, 1, 1, 1), t, stride)

    def relu_zero(self, b: torch.Tensor, level: int, next_k: int) -> torch.Tensor:
        """ReLU, with the block pixels outside the level's map zeroed first when a k > 1 conv follows
        (in place: ``b`` comes from a conv, an affine map or batch_norm, none of which saves it)."""
        outside = self.masks[level].outside
        if next_k > 1 and outside is not None:
            zero_pixels(b, outside)
        return F.relu_(b)

    def _collect(self, j: int, z: torch.Tensor) -> tuple[None, dict[int, Moments]]:
        self.moments(j, z)
        return None, self.new

    def run(self, xb: torch.Tensor, skip_identity: bool = False) -> tuple[torch.Tensor | None, dict[int, Moments]]:
        """The chain on blocks ``xb [K, C, e_0, e_0]``: the output tiles and this pass's moments.

        With ``skip_identity`` (post-activation identity unit) the last BN's output before the shortcut
        and ReLU is returned (the residual scatter then does ``relu(x + tile)``); a pre-activation
        identity unit's tiles are always without ``x`` (the scatter adds it).
        """
        chain, geo, collect = self.chain, self.geo, self.collect
        convs, specs, L = chain.convs, chain.specs, len(chain.convs)
        (th, tw), S = geo.tile, chain.stride
        p0h, p0w = geo.levels[0].offset
        if chain.preact:
            if collect and self.unknown(0):
                return self._collect(0, xb)
            a0 = self.relu_zero(self.norm(0, xb), 0, specs[0].ksize)
            a = a0
            for i in range(L - 1):
                if collect and self.unknown(i + 1):
                    return self._collect(i + 1, F.conv2d(a, convs[i].weight, None, specs[i].stride))
                a = self.relu_zero(self.conv_norm(convs[i], i + 1, a, specs[i].stride), i + 1, specs[i + 1].ksize)
            z = F.conv2d(a, convs[L - 1].weight, None, specs[L - 1].stride)
            if chain.shortcut == "projection":
                a0s = a0[:, :, p0h : p0h + S * th : S, p0w : p0w + S * tw : S]
                z = z.add_(F.conv2d(a0s, chain.proj.weight))  # z: a fresh conv output nobody saved
            return z, self.new  # identity: added to x by the scatter

        sc = None
        if chain.shortcut == "projection":  # the projection's BN comes first (DDP: the collectives' order)
            js = L
            if not collect or self.unknown(js):
                xs = xb[:, :, p0h : p0h + S * th : S, p0w : p0w + S * tw : S]
                if collect:
                    self.moments(js, F.conv2d(xs, chain.proj.weight))
                else:
                    sc = self.conv_norm(chain.proj, js, xs, 1)
        a = xb
        for i in range(L):
            if collect and self.unknown(i):
                return self._collect(i, F.conv2d(a, convs[i].weight, None, specs[i].stride))
            b = self.conv_norm(convs[i], i, a, specs[i].stride)
            if i < L - 1:
                a = self.relu_zero(b, i + 1, specs[i + 1].ksize)
        if chain.shortcut == "identity":
            if skip_identity:
                return b, self.new
            sc = xb[:, :, p0h : p0h + th, p0w : p0w + tw]
        # b is a fresh conv / affine / batch_norm output that no backward needs: add and ReLU in place
        return F.relu_(b.add_(sc) if sc is not None else b), self.new
