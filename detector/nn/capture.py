"""One call captured as a CUDA graph: a replay runs every kernel of the call with one launch from the host.

    g = capture(fn, *inputs)     # fn(*inputs) warmed up twice off the capture stream, then captured
    out = g(*new_inputs)         # the new inputs copied into the graph's own, the graph replayed

The inputs must keep their shapes and dtypes, and ``fn`` must make no host read (no ``.item()``, ``nonzero``, a
Python branch on a tensor): the capacity path (:mod:`detector.nn.capacity`) and the dense network qualify. A
replay's outputs are the graph's own tensors, overwritten by its next replay. On a CPU tensor ``capture`` returns
``fn`` itself (no graphs there), so the same callers run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["capture"]


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
