"""The cost model of the execution plan: estimated time of a conv chain run dense or sparse.

Estimates are sums of a few terms whose constants are properties of the machine, not of the network:

- a dense chain on an ``N x H x W`` map: per convolution ``N Ho Wo Cin Cout k^2 * dense_mac``, plus two
  elementwise passes (BN, ReLU) over its output ``* pass_``, the projection and residual add likewise,
  plus ``dense_unit`` (fixed cost of a layer call);
- a sparse chain on ``K`` active blocks of output tile ``T``: per convolution ``K e_out^2 Cin Cout k^2 *
  block_mac(T)`` (``e`` the block extent at that level, halo included: the convolutions run on the halos
  too, and small spatial sizes convolve less efficiently, hence one constant per tile), three passes over
  each level's block pixels (BN, ReLU, zeroing outside the map), the gather and scatter of
  ``K (e_in^2 Cin + T^2 Cout)`` elements ``* move``, plus ``sparse_unit`` (fixed cost of a sparse unit:
  index reduction, level masks, bookkeeping) and the map it writes into: a zero map for a projection or
  no shortcut, a copy of the input map for a stage's first identity unit (the later ones write in place).

In training every per-element term is tripled (the backward convolves and moves twice as much); the
fixed per-unit costs are measured forward + backward.

The network runs on block lists (:mod:`detector.nn.capacity`; its inference captured as a CUDA graph on a GPU). A
training step is priced as above on the lists' rows (unfused convolutions, batch norm passes, gather and scatter),
inference with the fused ops' constants: per list row ``macs * fused_mac(T)`` (the fused gather + convolution +
epilogue, measured as one) plus the scatter of its output tile ``* move``, and the fixed costs of a unit measured
the way it runs - captured in a CUDA graph on a GPU, where a graph replay removes most of a layer call's
launch and host cost - for a sparse unit (``capacity_unit``) and a dense one (``dense_unit_graph``). Its
blocks are the list's rows (on a GPU its bucket), not the count: padding rows are launched too.

The constants come from :func:`calibrate` - a short measurement (about a second) on this machine, device
and dtype - cached in a JSON file keyed by machine, torch, threads, device, dtype and the calibration's
shape set (:func:`load_or_calibrate`). A file written elsewhere (another machine, torch, shape set) or
unreadable is recomputed with one warning. Given the file, the plan is a pure function of its inputs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import time
import warnings
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from detector.machine import cpu_model
from detector.resources import cache_dir

__all__ = ["CostModel", "dense_macs", "sparse_macs", "calibrate", "load_or_calibrate", "cost_key",
           "default_cost_file", "machine_busy", "CALIBRATION_SHAPES"]

CALIBRATION_SHAPES = ("v4: conv3x3 32->32 on 1x128x128 and on (128/T)^2 blocks of T+2 for T in 4,8,16,32 (plain and "
                      "fused on a block list); chain 8ch 16x16 on a block list (eager, captured)")
TILES = (4, 8, 16, 32)


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work (see the module docstring); ``block_mac`` per calibrated tile size."""

    dense_mac: float
    block_mac: tuple[tuple[int, float], ...]
    move: float
    pass_: float
    dense_unit: float
    sparse_unit: float
    dense_unit_train: float
    sparse_unit_train: float
    # inference on block lists (module docstring); a model without them (a config's hand-written cost) prices it
    # by the per-element terms above (gather, convolutions, passes, scatter) and sparse_unit
    fused_mac: tuple[tuple[int, float], ...] = ()
    capacity_unit: float | None = None
    dense_unit_graph: float | None = None

    def __post_init__(self) -> None:
        vals = [self.dense_mac, self.move, self.pass_, self.dense_unit, self.sparse_unit, self.dense_unit_train,
                self.sparse_unit_train, *(v for _, v in self.block_mac), *(v for _, v in self.fused_mac),
                *(v for v in (self.capacity_unit, self.dense_unit_graph) if v is not None)]
        if not self.block_mac or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in vals):
            raise ValueError(f"CostModel: every constant must be a finite number >= 0, got {self}")

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        d = dict(d)
        for k in ("block_mac", "fused_mac"):
            if k in d:
                d[k] = tuple((int(t), float(v)) for t, v in d[k])
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict:
        return {**asdict(self), "block_mac": [list(p) for p in self.block_mac],
                "fused_mac": [list(p) for p in self.fused_mac]}

    def distortion(self) -> str | None:
        """Why these constants cannot be a quiet machine's, or None: a unit's fixed cost in inference (forward
        only) above its fixed cost in training (forward + backward of the same unit). Seen when another process
        stalled the inference measurements by orders of magnitude, which then priced every sparse and dense stage of
        a plan at seconds."""
        for kind in ("dense", "sparse"):
            infer, train = getattr(self, f"{kind}_unit"), getattr(self, f"{kind}_unit_train")
            if infer > train:
                return (f"a {kind} unit's fixed cost in inference ({1e3 * infer:.3g} ms) is above its forward + "
                        f"backward ({1e3 * train:.3g} ms)")
        return None

    def mac_per_tile(self, tile: int, fused: bool = False) -> float:
        """``block_mac`` (``fused``: ``fused_mac``) of the calibrated tile nearest to ``tile`` (ties: the
        smaller tile)."""
        table = self.fused_mac if fused and self.fused_mac else self.block_mac
        return min(table, key=lambda p: (abs(p[0] - tile), p[0]))[1]

    # ------------------------------------------------------------------------------------ estimates
    def dense(self, chain, N: int, H: int, W: int, training: bool) -> float:
        """Estimated seconds of ``chain`` (a SparseConvChain) run dense on an ``N x H x W`` map (in inference as the
        network runs it: inside a captured graph on a GPU)."""
        fixed = self.dense_unit_train if training else self.dense_unit
        if not training and self.dense_unit_graph is not None:
            fixed = self.dense_unit_graph
        return (3 if training else 1) * _dense_work(self, chain, N, H, W) + fixed

    def sparse(self, chain, N: int, H: int, W: int, tile: int, blocks: int, base: str, training: bool) -> float:
        """Estimated seconds of ``chain`` run sparse on ``blocks`` rows of a block list of output ``tile`` (module
        docstring).

        ``base``: the map the tiles are written into - "zeros" (a fresh zero map), "copy" (a copy of the
        input map: a stage's first identity unit) or "inplace" (the stage's own intermediate)."""
        if not training and self.fused_mac:
            per_block, map_work = _capacity_work(self, chain, N, H, W, tile, base)
            fixed = self.capacity_unit if self.capacity_unit is not None else self.sparse_unit
            return blocks * per_block + map_work + fixed
        per_block, map_work = _sparse_work(self, chain, N, H, W, tile, base)
        work = blocks * per_block + map_work
        return (3 if training else 1) * work + (self.sparse_unit_train if training else self.sparse_unit)


# The plan prices every stage's options on every batch; what does not depend on the active blocks is computed once
# per (chain, cost model, shape) and kept beside the chain (weakly: a dropped model takes its entries along). A
# chain's geometry and channels are fixed at construction.
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _memoized(fn):
    @functools.wraps(fn)
    def cached(*args):
        chain, key = (args[1], args) if isinstance(args[0], CostModel) else (args[0], args)
        per_chain = _MEMO.setdefault(chain, {})
        key = (fn.__name__, *(a for a in key if a is not chain))
        if key not in per_chain:
            per_chain[key] = fn(*args)
        return per_chain[key]
    return cached


@_memoized
def _dense_work(cost: CostModel, chain, N: int, H: int, W: int) -> float:
    work = dense_macs(chain, N, H, W) * cost.dense_mac
    h, w = H, W
    for spec, conv in zip(chain.specs, chain.convs, strict=True):
        h = (h + 2 * spec.padding - spec.ksize) // spec.stride + 1
        w = (w + 2 * spec.padding - spec.ksize) // spec.stride + 1
        work += N * h * w * conv.out_channels * 2 * cost.pass_
    px_out = N * h * w * chain.out_channels
    if chain.shortcut == "projection":
        work += px_out * cost.pass_
    if chain.shortcut != "none":
        work += px_out * cost.pass_
    return work


@_memoized
def _sparse_work(cost: CostModel, chain, N: int, H: int, W: int, tile: int, base: str) -> tuple[float, float]:
    """(work per active block, work of the map the tiles are written into) of :meth:`CostModel.sparse`."""
    geo = chain.geometry(H, W, tile)
    lv = geo.levels
    area = [lv_.extent[0] * lv_.extent[1] for lv_ in lv]
    per_block = _sparse_macs_per_block(chain, H, W, tile) * cost.mac_per_tile(tile)
    for i, conv in enumerate(chain.convs):
        per_block += 3 * area[i + 1] * conv.out_channels * cost.pass_
    per_block += (area[0] * chain.in_channels + tile * tile * chain.out_channels) * cost.move
    Ho, Wo = lv[-1].map_size
    if base == "zeros":
        return per_block, N * Ho * Wo * chain.out_channels * cost.pass_
    if base == "copy":
        return per_block, N * H * W * chain.in_channels * cost.pass_
    if base != "inplace":
        raise ValueError(f"CostModel.sparse: base must be zeros, copy or inplace, got {base!r}")
    return per_block, 0.0


@_memoized
def _capacity_work(cost: CostModel, chain, N: int, H: int, W: int, tile: int, base: str) -> tuple[float, float]:
    """(work per list row, work of the map the tiles are written into) on the capacity path."""
    per_block = _sparse_macs_per_block(chain, H, W, tile) * cost.mac_per_tile(tile, fused=True)
    per_block += tile * tile * chain.out_channels * cost.move
    return per_block, _sparse_work(cost, chain, N, H, W, tile, base)[1]


# ------------------------------------------------------------------------------------------ MAC counts
def _conv_inputs(chain) -> list[int]:
    """Input channels of each convolution of ``chain`` (a list: slicing its ModuleList would build a module)."""
    return [chain.in_channels] + [c.out_channels for c in chain.convs][:-1]


@_memoized
def dense_macs(chain, N: int, H: int, W: int) -> int:
    """Multiply-accumulates of ``chain`` (a SparseConvChain) run dense on an ``N x H x W`` map (its
    convolutions and the projection shortcut)."""
    macs, h, w = 0, H, W
    cins = _conv_inputs(chain)
    for spec, cin, conv in zip(chain.specs, cins, chain.convs, strict=True):
        h = (h + 2 * spec.padding - spec.ksize) // spec.stride + 1
        w = (w + 2 * spec.padding - spec.ksize) // spec.stride + 1
        macs += N * h * w * conv.out_channels * cin * spec.ksize**2
    if chain.shortcut == "projection":
        macs += N * h * w * chain.out_channels * chain.in_channels
    return macs


def sparse_macs(chain, H: int, W: int, tile: int, blocks: int) -> int:
    """Multiply-accumulates of ``chain`` run sparse on ``blocks`` active blocks of output ``tile`` on an
    ``H x W`` map: every convolution over its whole block extent, halos included (the halos are the price
    of VALID convolutions on gathered blocks), the projection over the output tile's extent."""
    return blocks * _sparse_macs_per_block(chain, H, W, tile)


@_memoized
def _sparse_macs_per_block(chain, H: int, W: int, tile: int) -> int:
    lv = chain.geometry(H, W, tile).levels
    area = [v.extent[0] * v.extent[1] for v in lv]
    cins = _conv_inputs(chain)
    per_block = sum(area[i + 1] * cin * conv.out_channels * spec.ksize**2
                    for i, (spec, cin, conv) in enumerate(zip(chain.specs, cins, chain.convs, strict=True)))
    if chain.shortcut == "projection":
        per_block += area[-1] * chain.in_channels * chain.out_channels
    return per_block


# ------------------------------------------------------------------------------------------ calibration
def _fastest(runs: dict[str, object], rounds: int = 25) -> dict[str, float]:
    """The fastest of ``rounds`` runs of each callable after two warm-ups, the callables interleaved round by
    round (on a loaded machine every measurement then sees the same load; the minimum is what load distorts
    least)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in runs.values():
        fn()
        fn()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def calibrate(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> CostModel:
    """Measure the constants on this machine (the fastest of 25 interleaved runs each, a few seconds on a CPU)."""
    from detector.ops import reduce_mask, sparse_gather, sparse_scatter
    from detector.ops.capacity import reduce_mask_capacity
    from detector.ops.fused import conv_blocks, conv_scatter

    from .capture import capture
    from .chain import SparseConvChain  # the real unit, for the fixed per-unit costs

    dev = torch.device(device)
    cl = torch.channels_last
    g = torch.Generator().manual_seed(0)
    C, S = 32, 128

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype).contiguous(memory_format=cl if len(shape) == 4 else
                                                                          torch.contiguous_format)

    w, x, big = rand(C, C, 3, 3), rand(1, C, S, S), rand(1, C, 2 * S, 2 * S)
    blocks = {t: rand((S // t) ** 2, C, t + 2, t + 2) for t in TILES}
    unit = SparseConvChain(C, (C,), (3,), (1,), block_size=16).to(dev, dtype).eval()
    geo = unit.geometry(S, S)
    idx = reduce_mask(torch.ones(1, 1, S, S, device=dev), geo.block)
    tiles = rand(idx.shape[0], C, 16, 16)
    # fixed per-unit costs: a one-conv 8-channel chain on one 16 x 16 block, forward and forward + backward
    small = SparseConvChain(8, (8,), (3,), (1,), block_size=16).to(dev, dtype)
    xs, ones = rand(1, 8, 16, 16), torch.ones(1, 1, 16, 16, device=dev, dtype=dtype)

    def infer(mask):
        small.eval()
        with torch.no_grad():
            small(xs, mask=mask)

    def train(mask):
        small.train()
        small(xs.clone().requires_grad_(True), mask=mask).sum().backward()

    # the capacity path: a 3x3 convolution on a full list of each tile's blocks read from the map (gather, bias
    # and ReLU fused), and the fixed cost of a two-convolution unit on a one-block list (list, convolution,
    # convolution + scatter) captured as that path runs it; the dense unit captured likewise
    lists = {t: reduce_mask_capacity(torch.ones(1, 1, S, S, device=dev), unit.geometry(S, S, t).block, (S // t) ** 2)
             for t in TILES}
    bias = rand(C)
    one = rand(1, 8, 16, 16)
    w8, b8, w8b = rand(8, 8, 3, 3), rand(8), rand(8, 8, 1, 1)
    small_geo = small.geometry(16, 16)

    def capacity_unit(a, m):
        bl = reduce_mask_capacity(m, small_geo.block, 1)
        lv = small_geo.levels
        y = conv_blocks(a, bl, w8, b8, origin=(lv[0].region, lv[0].offset), extent=lv[0].extent, relu=True,
                        zero=(lv[1].region, lv[1].offset, lv[1].map_size))
        return conv_scatter(y, bl, w8b, b8, torch.zeros_like(a), tile=(16, 16), relu=True, inplace=True)

    def dense_unit(a):
        return small(a)

    small.eval()
    with torch.no_grad():
        cap_graph = capture(capacity_unit, one, ones)
        dense_graph = capture(dense_unit, one)

    runs = {"dense": lambda: F.conv2d(x, w, padding=1), "relu": lambda: torch.relu(big),
            "move": lambda: (sparse_gather(x, idx, geo.block), sparse_scatter(tiles, idx, x, geo.block, add=False)),
            "dense_unit": lambda: infer(None), "sparse_unit": lambda: infer(ones),
            "dense_unit_train": lambda: train(None), "sparse_unit_train": lambda: train(ones)}
    for t, b in blocks.items():
        runs[f"block{t}"] = lambda b=b: F.conv2d(b, w)
    for t, bl in lists.items():
        lv = unit.geometry(S, S, t).levels
        runs[f"fused{t}"] = lambda bl=bl, lv=lv: conv_blocks(x, bl, w, bias, origin=(lv[0].region, lv[0].offset),
                                                            extent=lv[0].extent, relu=True)
    runs["capacity_unit"] = lambda: cap_graph(one, ones)
    runs["dense_unit_graph"] = lambda: dense_graph(one)
    with torch.no_grad():
        ms = _fastest({k: v for k, v in runs.items() if "train" not in k})
    with torch.enable_grad():  # the caller may be planning under no_grad (inference)
        ms.update(_fastest({k: v for k, v in runs.items() if "train" in k}))
    moved = idx.shape[0] * (geo.levels[0].extent[0] * geo.levels[0].extent[1] + 16 * 16) * C
    return CostModel(
        dense_mac=ms["dense"] / (S * S * C * C * 9),
        block_mac=tuple((t, ms[f"block{t}"] / ((S // t) ** 2 * t * t * C * C * 9)) for t in TILES),
        move=ms["move"] / moved, pass_=ms["relu"] / big.numel(), dense_unit=ms["dense_unit"],
        sparse_unit=ms["sparse_unit"], dense_unit_train=ms["dense_unit_train"],
        sparse_unit_train=ms["sparse_unit_train"],
        fused_mac=tuple((t, ms[f"fused{t}"] / (lists[t].capacity * _conv_out(unit, S, t) * C * C * 9)) for t in TILES),
        capacity_unit=ms["capacity_unit"], dense_unit_graph=ms["dense_unit_graph"])


def _conv_out(unit, S: int, tile: int) -> int:
    """Output pixels of a block of ``unit``'s first convolution at ``tile`` (its level-1 extent)."""
    e = unit.geometry(S, S, tile).levels[1].extent
    return e[0] * e[1]


# ------------------------------------------------------------------------------------------------ cache
def cost_key(device: str | torch.device, dtype: torch.dtype) -> dict:
    """What a calibration depends on: machine, torch, threads, device, dtype, the shape set."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
    return {"machine": f"{platform.machine()} {name}, {os.cpu_count()} CPUs", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": dev.type, "dtype": str(dtype).removeprefix("torch."),
            "shapes": CALIBRATION_SHAPES}


def default_cost_file(device: str | torch.device, dtype: torch.dtype) -> Path:
    """``$DETECTOR_CACHE_DIR`` (default ``~/.cache/detector``) ``/plan_cost_<device>_<dtype>.json``."""
    return cache_dir() / f"plan_cost_{torch.device(device).type}_{str(dtype).removeprefix('torch.')}.json"


def machine_busy(device: str | torch.device) -> str | None:
    """Why a CPU calibration now would be distorted, or None: other processes keep the cores busy (the
    1-minute load average above the CPU count less one, i.e. more runnable work than the cores left beside
    this process). A core shared with another process stretches every OpenMP region, which inflates the
    fixed per-unit costs most (tens of milliseconds instead of a fraction of one). CUDA: never busy."""
    if torch.device(device).type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    return f"load {load:.1f} on {cpus} CPUs" if load > max(cpus - 1, 1) else None


def load_or_calibrate(path: str | Path | None, device: str | torch.device, dtype: torch.dtype) -> CostModel:
    """The cached cost model at ``path`` (default :func:`default_cost_file`) if it was calibrated under this
    :func:`cost_key`; else (missing: silently; foreign or unreadable: with one warning) calibrate and
    rewrite the file (atomically; an unwritable place only warns). A calibration on a busy machine
    (:func:`machine_busy`) or with distorted constants (:meth:`CostModel.distortion`; a cached one is
    recalibrated) is used but not written, with one warning."""
    path = Path(path) if path is not None else default_cost_file(device, dtype)
    key = cost_key(device, dtype)
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            if saved.get("key") != key:
                diff = sorted(k for k in key if saved.get("key", {}).get(k) != key[k]) if isinstance(
                    saved.get("key"), dict) else ["key"]
                raise ValueError(f"calibrated under another {', '.join(diff)}")
            cached = CostModel.from_dict(saved["cost"])
            if (why := cached.distortion()) is not None:
                raise ValueError(f"distorted calibration: {why}")
            return cached
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
            warnings.warn(f"plan cost model {path}: {e}; recalibrating", RuntimeWarning, stacklevel=2)
    busy = machine_busy(device)
    cost = calibrate(device, dtype)
    busy = busy or cost.distortion()
    if busy:  # a calibration under someone else's load misprices every fixed cost: use it, don't keep it
        warnings.warn(f"plan cost model: calibrated while the machine was busy ({busy}); the plan uses it for "
                      f"this run but it is not cached in {path} (measured again next time)", RuntimeWarning,
                      stacklevel=2)
        return cost
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "cost": cost.to_dict()}, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"plan cost model: cannot write {path} ({e}); it will be measured again next time",
                      RuntimeWarning, stacklevel=2)
    return cost
