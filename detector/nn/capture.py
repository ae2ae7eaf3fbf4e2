"""One call captured as a CUDA graph: a replay runs every kernel of the call with one launch from the host.

    g = capture(fn, *inputs)     # fn(*inputs) warmed up twice off the capture stream, then captured
    out = g(*new_inputs)         # the new inputs copied into the graph's own, the graph replayed

    g = capture_training(module, *inputs)   # module's forward and its backward, two graphs in one autograd node
    out = g(*new_inputs); loss(out).backward()  # (torch.cuda.make_graphed_callables); parameters' gradients
                                                # accumulate as usual, buffers (BN running statistics) update per call

The inputs must keep their shapes and dtypes, and ``fn`` must make no host read (no ``.item()``, ``nonzero``, a
Python branch on a tensor): the capacity path (:mod:`detector.nn.capacity`) and the dense network qualify. A
replay's outputs are the graph's own tensors, overwritten by its next replay. On a CPU tensor ``capture`` returns
``fn`` itself (no graphs there), so the same callers run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["capture", "capture_training"]


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


def _autocast_uncached():  # noqa: ANN202
    """Within an autocast region, the same autocast without its weight-cast cache (graphs cannot capture it);
    elsewhere nothing."""
    import contextlib

    if torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


def capture_training(module: torch.nn.Module, *inputs: torch.Tensor, warmup: int = 3) -> Callable:
    """``module`` (in its current training state, no hooks) captured forward and backward on ``inputs``: a call
    runs the forward graph and adds one autograd node whose backward replays the backward graph. The warm-up calls
    (``warmup``, off the capture stream) would update the module's buffers (batch norm's running statistics):
    they are put back as they were, so each later call updates them once, as an eager step does. Under autocast
    the calls run without its cache. On a CPU tensor, ``module`` itself."""
    if not inputs[0].is_cuda:
        return module
    saved = [b.detach().clone() for b in module.buffers()]
    with _autocast_uncached():
        graphed = torch.cuda.make_graphed_callables(module, tuple(inputs), num_warmup_iters=warmup,
                                                    allow_unused_input=True)
    with torch.no_grad():
        for b, s in zip(module.buffers(), saved, strict=True):
            b.copy_(s)

    def run(*args: torch.Tensor):  # noqa: ANN202
        with _autocast_uncached():
            return graphed(*args)

    return run
