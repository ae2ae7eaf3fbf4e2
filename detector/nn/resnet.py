"""Sparse residual units and the SparseResNet BEV backbone (PIXOR layout, SBNet execution).

Every unit is a :class:`~detector.nn.chain.SparseConvChain`: dense given no mask, the mask's function given one,
with the same weights. See :mod:`detector.nn.chain` for the semantics (the dense unit where the mask is set; elsewhere
the input behind an identity shortcut, zero otherwise) and the sparse execution (one gather, VALID convs, one
scatter).

Backbone defaults follow PIXOR (Yang et al., 2018) - the network SBNet (Ren et al., 2018) sparsified
for LiDAR BEV detection:

- stem: two 3x3 conv-BN-ReLU with 32 channels at the input resolution (PIXOR's "block 1");
- four stages of bottleneck units, ``(3, 6, 6, 3)`` units, output channels ``(96, 192, 256, 384)``
  (bottleneck width = channels / 4: PIXOR's 24/48/64/96), each stage starting with a stride-2 unit with
  a projection shortcut. PIXOR downsamples at every stage, so on the KITTI BEV grid (800 x 704) the
  stage outputs are 400 x 352, 200 x 176, 100 x 88 and 50 x 44 - the four sizes SBNet benchmarks.
  (``stage_strides`` is configurable, e.g. ``(1, 2, 2, 2)`` for a first stage at the stem's resolution.)

The mask enters at the input resolution; each stride-2 stage start consumes the mask at its input
resolution (an output tile is active if its receptive field touches the mask), then the mask is
max-pooled by 2 (ceil mode) for the rest of the stage and the next stages. All stride-1 units of a
stage share one ``reduce_mask``.

``block_size`` (output tile per side) is one value for all stages or one per stage (stem first):
an int, ``"dense"`` (that stage runs dense), or ``"auto"`` (the execution plan picks dense or one of the
planner's candidate tiles per batch from the shapes, the active blocks and a cost model: deterministic,
the same on every DDP rank; see :mod:`detector.nn.plan`). A stage that runs dense applies the same mask: every
choice gives the same output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from detector.errors import ConfigError

from .capacity import forward_capacity, plan_capacities, stage_capacity
from .chain import SparseConvChain
from .geometry import binary_mask, mask_at_stride
from .plan import AUTO, DENSE, Planner, StageInput, check_setting, measure

__all__ = ["SparseResidualUnit", "SparseStage", "SparseResNet", "AUTO", "DENSE", "downsample_mask"]


class SparseResidualUnit(SparseConvChain):
    """A ResNet unit: basic (3x3, 3x3) or bottleneck (1x1, 3x3, 1x1), post- or pre-activation.

    The stride sits on the first 3x3 convolution (ResNet v1.5 for the bottleneck). The shortcut is the
    identity when ``stride == 1`` and ``in_channels == out_channels``, else a 1x1 projection with
    stride (``projection=True`` forces a projection). ``mid_channels`` (bottleneck width) defaults to
    ``out_channels // 4``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        bottleneck: bool = True,
        stride: int = 1,
        preact: bool = False,
        projection: bool | None = None,
        mid_channels: int | None = None,
        block_size: int | tuple[int, int] = 16,
        tol: float = 0.5,
    ) -> None:
        if stride not in (1, 2):
            raise ValueError(f"SparseResidualUnit: stride must be 1 or 2, got {stride}")
        if projection is None:
            projection = stride != 1 or in_channels != out_channels
        if bottleneck:
            mid = mid_channels if mid_channels is not None else max(1, out_channels // 4)
            channels, ksizes, strides = (mid, mid, out_channels), (1, 3, 1), (1, stride, 1)
        else:
            channels, ksizes, strides = (out_channels, out_channels), (3, 3), (stride, 1)
        super().__init__(
            in_channels,
            channels,
            ksizes,
            strides,
            preact=preact,
            shortcut="projection" if projection else "identity",
            block_size=block_size,
            tol=tol,
            name=f"SparseResidualUnit({'bottleneck' if bottleneck else 'basic'}, "
            f"{in_channels}->{out_channels}, "
            f"stride {stride}{', preact' if preact else ''})",
        )


def downsample_mask(mask: torch.Tensor) -> torch.Tensor:
    """Max-pool by 2 (ceil mode): the mask at a stride-2 unit's output resolution."""
    return mask_at_stride(mask, 2)


class SparseStage(nn.Module):
    """A list of units (or one conv chain) that share a block size and a mask resolution after the first.

    :meth:`forward` runs the units on the stage's mask - sparse, or dense with ``dense=True`` (the same values: the
    mask defines what each unit computes, :mod:`detector.nn.chain`) - and returns the output and the binary mask
    at the output resolution (max-pooled after a stride-2 first unit); no mask: the dense network.
    """

    def __init__(self, units: Sequence[SparseConvChain]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, dense: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        first = self.units[0]
        if mask is None:
            for u in self.units:
                x = u(x)
            return x, None
        m = first.binary(mask)
        if dense:
            x = first(x, mask=m, dense=True)
            m = mask_at_stride(m, first.stride)
            for u in self.units[1:]:
                x = u(x, mask=m, dense=True)
            return x, m
        x, m, _, _ = stage_capacity(self, x, m, first.block_size)
        return x, m


class SparseResNet(nn.Module):
    """PIXOR-style residual BEV backbone, dense or sparse with the same weights (module docstring).

    ``forward(x [N, in_channels, H, W], mask [N, 1, H, W] | None) -> list`` of the stages' feature maps
    (``len(stage_units)`` tensors with ``out_channels[i]`` channels at stride ``strides[i]``).
    """

    def __init__(
        self,
        in_channels: int,
        *,
        stem_channels: int = 32,
        stage_units: Sequence[int] = (3, 6, 6, 3),
        stage_channels: Sequence[int] = (96, 192, 256, 384),
        stage_strides: Sequence[int] = (2, 2, 2, 2),
        bottleneck: bool = True,
        preact: bool = False,
        block_size: int | str | Sequence[int | str] = 16,
        tol: float = 0.5,
        channels_last: bool = True,
        planner: Planner | None = None,
        checkpoint_stages: Sequence[str] = (),
    ) -> None:
        super().__init__()
        n = len(stage_units)
        if not (n == len(stage_channels) == len(stage_strides)) or n == 0:
            raise ConfigError(
                "SparseResNet: stage_units, stage_channels and stage_strides must have the same length >= 1"
            )
        if any(u < 1 for u in stage_units):
            raise ConfigError(f"SparseResNet: every stage needs >= 1 unit, got {list(stage_units)}")
        sizes = [block_size] * (n + 1) if isinstance(block_size, (int, str)) else list(block_size)  # any sequence
        if len(sizes) != n + 1:
            raise ConfigError(
                f"SparseResNet: block_size needs {n + 1} entries (stem, then each stage), got {len(sizes)}"
            )
        for b in sizes:
            check_setting(b, "SparseResNet: block_size entries")
        self.block_sizes: list[int | str] = sizes
        self.channels_last = channels_last
        self.tol = float(tol)
        self.planner = planner if planner is not None else Planner()
        common = dict(tol=tol)
        first_tile = lambda b: b if isinstance(b, int) else 16  # noqa: E731  (auto/dense set at run time)
        stem = SparseConvChain(
            in_channels,
            (stem_channels, stem_channels),
            (3, 3),
            (1, 1),
            shortcut="none",
            block_size=first_tile(sizes[0]),
            name="SparseResNet.stem",
            **common,
        )
        stages = [SparseStage([stem])]
        cin = stem_channels
        for s in range(n):
            units = []
            for u in range(stage_units[s]):
                units.append(
                    SparseResidualUnit(
                        cin,
                        stage_channels[s],
                        bottleneck=bottleneck,
                        stride=stage_strides[s] if u == 0 else 1,
                        preact=preact,
                        block_size=first_tile(sizes[s + 1]),
                        **common,
                    )
                )
                cin = stage_channels[s]
            stages.append(SparseStage(units))
        self.stages = nn.ModuleList(stages)  # stages[0] is the stem
        self.out_channels = tuple(stage_channels)
        strides, acc = [], 1
        for s in stage_strides:
            acc *= s
            strides.append(acc)
        self.strides = tuple(strides)
        if isinstance(checkpoint_stages, str) or any(n not in self.stage_names for n in checkpoint_stages):
            raise ConfigError(f"model.checkpoint_stages: a list of stage names among {self.stage_names}, got "
                              f"{checkpoint_stages!r}")
        self.checkpoint_stages = frozenset(checkpoint_stages)

    @property
    def stage_names(self) -> list[str]:
        return ["stem"] + [f"stage{i}" for i in range(1, len(self.stages))]

    def plan_inputs(self, x_shape: tuple[int, ...], mask: torch.Tensor,
                    settings: list[int | str] | None = None) -> list[StageInput]:
        """The plan inputs of every stage (:func:`detector.nn.plan.measure`) for an input of ``x_shape`` and
        its ``mask`` (in the input's dtype); the masks per stage are those :meth:`forward` passes (max-pooled
        after stride 2); no cost model is needed when no stage is 'auto'."""
        settings = self.block_sizes if settings is None else settings
        N, (H, W) = x_shape[0], x_shape[-2:]
        mask = binary_mask(mask, self.tol)  # as forward_capacity runs it: the same counts, the strided masks shared
        prune = self.planner.prune(mask.device, mask.dtype, self.training) if AUTO in settings else None
        out = []
        for name, stage, setting in zip(self.stage_names, self.stages, settings, strict=True):
            units = list(stage.units)
            mask = mask_at_stride(mask, units[0].stride)  # the stage's mask at its output resolution
            inp = measure(name, setting, units, (N, H, W), mask, self.planner.candidates, prune)
            out.append(replace(inp, recompute=name in self.checkpoint_stages))
            H, W = out[-1].rest_hw
        return out

    def extra_repr(self) -> str:
        return (f"block_sizes={self.block_sizes} (stem, then each stage; auto: the planner's per batch), "
                f"tol={self.tol}, channels_last={self.channels_last}"
                + (f", checkpoint_stages={sorted(self.checkpoint_stages)}" if self.checkpoint_stages else ""))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                modes: list[int | str] | None = None, times: dict[str, float] | None = None) -> list[torch.Tensor]:
        """``modes``: the plan's choice per stage (stem first), e.g. from a plan made for the whole
        detector; None: the configured block sizes, 'auto' ones planned here. ``times``: if given, each
        stage's wall seconds are added to it under ``backbone/<stage>`` (synchronizing on CUDA)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(
                f"SparseResNet: x must be a [N, C, H, W] tensor, got {getattr(x, 'shape', type(x))}"
            )
        if mask is not None:
            if (
                not isinstance(mask, torch.Tensor)
                or mask.dim() != 4
                or mask.shape[1] != 1
                or (mask.shape[0] != x.shape[0] or mask.shape[2:] != x.shape[2:])
            ):
                raise ValueError(
                    f"SparseResNet: mask must be [N, 1, H, W] matching x {tuple(x.shape)}, "
                    f"got {tuple(getattr(mask, 'shape', ()))}"
                )
            mask = mask.to(x.dtype)
        if mask is None:  # the dense network
            return forward_capacity(self, x, None, [DENSE] * len(self.stages), [None] * len(self.stages), times)[0]
        modes, caps = plan_capacities(self, x, mask, modes)  # the plan's and the counts' one read
        return forward_capacity(self, x, mask, modes, caps, times)[0]
