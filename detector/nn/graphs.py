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

__all__ = ["CapturedBackbone", "DenseRunner", "capture"]


class _Graph:
    """One captured call: static inputs, the graph, static outputs."""

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor], warmup: int = 2) -> None:
        self.inputs = [t.clone() for t in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (allocator, lazy inits, triton compiles)
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):  # noqa: ANN204
        for s, t in zip(self.inputs, inputs, strict=True):
            s.copy_(t)
        self.graph.replay()
        return self.outputs


def capture(fn: Callable, *inputs: torch.Tensor, warmup: int = 2) -> Callable:
    """``fn(*inputs)`` captured as a CUDA graph (replayed by calling the result with new inputs of the same
    shapes); on a CPU tensor, ``fn`` itself."""
    if not inputs[0].is_cuda:
        return fn
    return _Graph(fn, inputs, warmup)


class CapturedBackbone:
    """The capacity path of ``net`` (a :class:`~detector.nn.resnet.SparseResNet`, eval mode) captured per
    (shape, dtype, modes, buckets) (module docstring)."""

    def __init__(self, net: torch.nn.Module, max_graphs: int = 16, smallest: int = 8) -> None:
        self.net, self.max_graphs, self.smallest = net, max_graphs, smallest
        self.graphs: OrderedDict[tuple, Callable] = OrderedDict()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, modes: Sequence[int | str],
                caps: Sequence[StageCapacity | None]):  # noqa: ANN201
        """:func:`~detector.nn.capacity.forward_capacity` through the graph of this key (captured on first use)."""
        key = (tuple(x.shape), x.dtype, tuple(modes), tuple(caps))
        g = self.graphs.get(key)
        if g is None:
            net, m, c = self.net, list(modes), list(caps)
            g = capture(lambda a, b: forward_capacity(net, a, b, m, c), x, mask.to(x.dtype))
            self.graphs[key] = g
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
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
        self.graphs: dict[tuple, Callable] = {}
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
        key = (tuple(x.shape), x.dtype)
        if key not in self.graphs:
            self.graphs[key] = capture(self._dense, x)
        return self.graphs[key](x)
