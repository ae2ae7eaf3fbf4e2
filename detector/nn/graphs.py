"""Inference of the backbone captured as CUDA graphs: one graph per capacity bucket (sparse) and one for dense.

A captured graph replays every kernel of a forward with one launch from the host and no host sync; it needs
fixed shapes and no host read inside, which is what the capacity path gives (:mod:`detector.nn.capacity`):

    run = CapturedBackbone(net)                 # net: a SparseResNet in eval mode, on a CUDA device
    feats = run(x, mask)                        # the plan's one host read picks modes and buckets, then the
                                                # graph of that (shape, modes, buckets) replays (captured on
                                                # first use), then one read of the overflow flag
    feats = run(x, mask, modes=..., caps=...)   # fixed buckets: no read before the replay

    dense = DenseRunner(net, mode="graph")      # the dense baseline captured the same way ("compile": torch.compile
                                                # with mode="reduce-overhead"; "eager": as it is)

Graphs are kept per key ``(shape, dtype, modes, capacities)`` up to ``max_graphs`` (the oldest is dropped). The
outputs of a replay are the graph's own static tensors, overwritten by the next replay of the same graph: copy
what must outlive it. Without CUDA the same objects run eagerly (no capture), so the CPU tests exercise the
bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from .capacity import StageCapacity, forward_capacity, plan_capacities, run_checked
from .capture import capture

__all__ = ["CapturedBackbone", "DenseRunner", "GraphCache", "capture"]


class GraphCache:
    """Captured calls by key, the most recent ``max_graphs`` kept (the oldest dropped); ``capturer``:
    :func:`capture` (inference) or :func:`~detector.nn.capture.capture_training` (forward and backward). A key is
    captured at its ``after``-th use (the earlier ones run ``fn`` as it is: a key seen once is not worth a capture's
    warm-up). Copies of a module that holds one (``deepcopy``, pickling) start empty: a graph belongs to the tensors
    it was captured on."""

    def __init__(self, max_graphs: int = 16, capturer: Callable = capture, after: int = 1) -> None:
        self.max_graphs, self.capturer, self.after = max_graphs, capturer, after
        self.graphs: OrderedDict[tuple, Callable] = OrderedDict()
        self.uses: dict[tuple, int] = {}

    def get(self, key: tuple, fn: Callable, *inputs: torch.Tensor) -> Callable:
        """The graph of ``key``: ``fn`` captured on ``inputs`` at its ``after``-th use (on the CPU ``fn``)."""
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            return g
        self.uses[key] = self.uses.get(key, 0) + 1
        if self.uses[key] < self.after:
            return fn
        del self.uses[key]
        g = self.graphs[key] = self.capturer(fn, *inputs)
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return g

    def clear(self) -> None:
        self.graphs.clear()
        self.uses.clear()

    def __len__(self) -> int:
        return len(self.graphs)

    def __deepcopy__(self, memo: dict) -> GraphCache:
        return GraphCache(self.max_graphs, self.capturer, self.after)

    def __getstate__(self) -> dict:
        return {"max_graphs": self.max_graphs, "capturer": self.capturer, "after": self.after}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_graphs"], state.get("capturer", capture), state.get("after", 1))


class CapturedBackbone:
    """The capacity path of ``net`` (a :class:`~detector.nn.resnet.SparseResNet`, eval mode) captured per
    (shape, dtype, modes, buckets) (module docstring)."""

    def __init__(self, net: torch.nn.Module, max_graphs: int = 16, smallest: int = 8) -> None:
        self.net, self.smallest = net, smallest
        self.graphs = GraphCache(max_graphs)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, modes: Sequence[int | str],
                caps: Sequence[StageCapacity | None]):  # noqa: ANN201
        """:func:`~detector.nn.capacity.forward_capacity` through the graph of this key (captured on first use)."""
        key = (tuple(x.shape), x.dtype, x.device, tuple(modes), tuple(caps))
        net, m, c = self.net, list(modes), list(caps)
        g = self.graphs.get(key, lambda a, b: forward_capacity(net, a, b, m, c), x, mask.to(x.dtype))
        return g(x, mask.to(x.dtype))

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, mask: torch.Tensor, modes: Sequence[int | str] | None = None,
                 caps: Sequence[StageCapacity | None] | None = None) -> list[torch.Tensor]:
        if caps is None:  # the batch's one host read: the plan's counts
            modes, caps = plan_capacities(self.net, x, mask, modes, self.smallest)
        elif modes is None:
            raise ValueError("CapturedBackbone: capacities need their modes")
        return run_checked(self.net, x, mask, modes, caps, forward=self.forward, smallest=self.smallest)


class DenseRunner:
    """The dense baseline of ``net`` for fair ratios: ``mode`` 'eager', 'graph' (captured like the sparse path)
    or 'compile' (``torch.compile(mode="reduce-overhead")``: inductor's kernels in a CUDA graph)."""

    def __init__(self, net: torch.nn.Module, mode: str = "graph") -> None:
        if mode not in ("eager", "graph", "compile"):
            raise ValueError(f"DenseRunner: mode must be 'eager', 'graph' or 'compile', got {mode!r}")
        self.net, self.mode = net, mode
        self.graphs = GraphCache()
        self._compiled = None

    def _dense(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.net(x)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.mode == "eager":
            return self._dense(x)
        if self.mode == "compile":
            if self._compiled is None:
                self._compiled = torch.compile(self._dense, mode="reduce-overhead")
            return self._compiled(x)
        return self.graphs.get((tuple(x.shape), x.dtype, x.device), self._dense, x)(x)
