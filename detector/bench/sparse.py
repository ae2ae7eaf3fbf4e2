"""Sparse-block benchmark: dense vs sparse, a 3x3 convolution and a bottleneck residual unit, on CPU.

    python scripts/bench_sparse.py [quick=false] [out=benchmarks/sparse_cpu.json] [md=] [batch=1]
        [stages=1,2,3,4] [sparsity=0.5,0.75,0.9,0.95,0.99] [blocks=8,16,32] [layers=conv3x3,bottleneck]
        [passes=fwd,fwd+bwd] [reps=3] [threads=1] [layout=nhwc] [spconv=true] [peer_threads=1,2]
        [device=cpu] [dtype=float32]

Layers, at the four stage sizes of SBNet's LiDAR backbone on our KITTI BEV grid (PIXOR layout, input
800 x 704, stage outputs at strides 2..16 with 96/192/256/384 channels; see detector.nn.resnet):

    stage 1: 400 x 352 x  96    stage 2: 200 x 176 x 192    stage 3: 100 x 88 x 256    stage 4: 50 x 44 x 384

- ``conv3x3``: one 3x3 conv-BN-ReLU C -> C (a one-conv SparseConvChain vs its dense twin);
- ``bottleneck``: one post-activation bottleneck unit C -> C/4 -> C/4 -> C with identity shortcut
  (SparseResidualUnit vs its dense twin, same weights).

Maps are channels-last (``layout=nhwc``, default) for dense and sparse alike: oneDNN's dense convolution
is fastest that way on this CPU, and the compiled ops gather/scatter NHWC block rows natively;
``layout=nchw`` runs both on NCHW maps. ``device=cuda`` / ``dtype=bfloat16`` run on a GPU / in bf16
(``make gpu-check``); times are then taken after ``torch.cuda.synchronize()``.

Masks: at each block size, a random ``(1 - sparsity)`` fraction of the layer's output tiles is chosen
(at least one) and the mask covers them, every pixel of each: the unit's output is defined on those pixels
(the active pixels, also what the peers get), and it runs the tiles its mask activates (``blocks_active``;
``actual_sparsity`` follows from it). The sparse time is the whole layer call with the mask (active
blocks, gather, convolutions, BN/ReLU, scatter). ``fwd``: eval mode under ``torch.no_grad()`` (BN folded
into the convolutions on both sides); ``speedup`` is the layer's normal path, a unit whose caller keeps
its input (it writes a copy); ``sparse_inplace_ms`` / ``speedup_inplace`` give the path the backbone takes
for the stage's own intermediates (the unit writes into its input; in ``fwd+bwd`` too, on a non-leaf
input made before the timer starts). ``fwd+bwd``: training mode (batch statistics), forward and backward
of a fixed output gradient, input gradient included. Every time is the best of ``reps`` after a warm-up
(the median is recorded too). Each row reports the best block size; ``speedup`` = dense / sparse at that
block size, ``ideal`` = 1 / (1 - actual block sparsity), ``auto_speedup`` = dense / min(dense, sparse)
(what ``block_size="auto"`` may reach by choosing dense). Time shares of the sparse path's phases
(list: the block list and its tiles' mask; unit: everything on the list - gather, convolutions, BN/ReLU, scatter)
are timed phase by phase at that block size, with their backward in ``fwd+bwd`` rows.

Threads: 1 by default (``threads=0``: torch's default). On a shared 2-core machine two OpenMP threads
stall in every parallel region whenever the other core is busy; the sparse path, with many small
operations, suffers most, and the numbers stop meaning anything. One thread gives repeatable ratios.

The allocator matters on this machine: large fresh allocations pay page faults, and glibc's
``MALLOC_MMAP_MAX_=0`` (exported by the Makefile) keeps them on the heap. Dense and sparse always run
in the same process under the same setting; the setting is printed and recorded in every row.

Correctness: in forward rows every timed call's output (warm-ups included) is compared with a float64
reference composed from ``torch.nn.functional`` (:func:`dense_reference`): the dense twin at every pixel,
the sparse unit at the active pixels. A part with any wrong call (error above
:data:`TOLERANCE` x max(1, max |reference|), or not finite) keeps no time: the row says ``WRONG``, how
many calls and by how much (:class:`Check`).

Peers (``spconv=true``, conv3x3 forward rows): spconv's ``SubMConv2d`` on the same active pixels, same
channels and dtype, timed with its rulebook built in each call and with
the rulebook of a first call reused, beside the dense twin and our unit, at each of ``peer_threads``
(CPU; on a GPU once); each call checked against a dense 3x3 convolution of the masked map
(:func:`spconv_peer`). spconv is not a project dependency (``pip install spconv==2.3.8`` into the
environment that runs this): where it does not import or run, its cells say ``skipped`` and a note why.

``quick=true``: stages 1 and 4, 50 % and 90 %, block 16, two reps, dense timed only in the layout
the full runs found faster (NHWC forward, NCHW forward+backward): a smoke test of about two minutes.
Writes JSON (a list of rows) to ``out`` and a markdown table to ``md`` (default: ``out`` with ``.md``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model
from detector.nn.chain import SparseConvChain, chain_capacity
from detector.nn.resnet import SparseResidualUnit

USAGE = __doc__
DEFAULTS = {
    "quick": False,
    "out": "benchmarks/sparse_cpu.json",
    "md": "",
    "batch": 1,
    "stages": "1,2,3,4",
    "sparsity": "0.5,0.75,0.9,0.95,0.99",
    "blocks": "8,16,32",
    "layers": "conv3x3,bottleneck",
    "passes": "fwd,fwd+bwd",
    "reps": 3,
    "threads": 1,
    "layout": "nhwc",
    "spconv": True,
    "peer_threads": "1,2",
    "device": "cpu",
    "dtype": "float32",
}
STAGES = {1: (400, 352, 96), 2: (200, 176, 192), 3: (100, 88, 256), 4: (50, 44, 384)}
PHASES = ("list", "unit")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(
    fn: Callable[..., object],
    reps: int,
    setup: Callable[[], object] | None = None,
    check: Callable[[object], None] | None = None,
) -> tuple[float, float]:
    """(best, median) milliseconds of ``reps`` calls after one warm-up call; ``setup()`` (untimed) makes
    each call's argument; ``check(output)`` (untimed) is given the output of every call, the warm-up's too."""
    arg = () if setup is None else (setup(),)
    out = fn(*arg)
    if check is not None:
        check(out)
    del out
    ts = []
    for _ in range(reps):
        arg = () if setup is None else (setup(),)
        _sync()
        t0 = time.perf_counter()
        out = fn(*arg)
        _sync()
        ts.append((time.perf_counter() - t0) * 1e3)
        if check is not None:
            check(out)
        del out
    return min(ts), statistics.median(ts)


# ------------------------------------------------------------------ correctness of every timed call
# Largest accepted max abs error at the checked sites, relative to max(1, max |reference|): float32 with
# float32 accumulation; TF32 (cuDNN's default for float32 convolutions on a GPU) and bfloat16 round more.
TOLERANCE = {"float32": 1e-3, "tf32": 1e-2, "bfloat16": 5e-2, "float16": 1e-2}


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    name = str(dtype).removeprefix("torch.")
    if name == "float32" and device.type == "cuda" and torch.backends.cudnn.allow_tf32:
        name = "tf32"
    return TOLERANCE[name]


@dataclass
class Check:
    """The errors of checked calls against their reference: how many calls, how many wrong (error above
    ``tol``, or not finite), the largest error. A timing is only a speed when every call was right."""

    tol: float
    calls: int = 0
    wrong: int = 0
    max_abs_err: float = 0.0

    def add(self, err: float) -> None:
        err = err if math.isfinite(err) else math.inf
        self.calls += 1
        self.wrong += not err <= self.tol
        self.max_abs_err = max(self.max_abs_err, err)

    @property
    def ok(self) -> bool:
        return self.calls > 0 and self.wrong == 0

    def verdict(self) -> str:
        if not self.calls:
            return "unchecked"
        if self.ok:
            return "ok"
        return f"WRONG {self.wrong}/{self.calls} calls, max abs err {self.max_abs_err:.3g}"

    def as_dict(self) -> dict[str, object]:
        e = self.max_abs_err
        return {"ok": self.ok, "calls": self.calls, "wrong": self.wrong,
                "max_abs_err": float(f"{e:.3g}") if math.isfinite(e) else "inf", "tol": float(f"{self.tol:.3g}")}


def site_error(values: torch.Tensor, ref: torch.Tensor) -> float:
    """max |values - ref| (``[P, C]`` each); infinite when the shapes differ or a value is not finite."""
    if tuple(values.shape) != tuple(ref.shape):
        return math.inf
    if not values.numel():
        return 0.0
    err = (values.double() - ref).abs().max().item()
    return err if math.isfinite(err) else math.inf


def at_sites(out: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """``[P, C]``: a map ``out [N, C, H, W]`` (either layout) at ``coords [P, 3]`` = (n, y, x)."""
    c = coords.long()
    return out.permute(0, 2, 3, 1)[c[:, 0], c[:, 1], c[:, 2]]


def new_check(ref: torch.Tensor, rel_tol: float) -> Check:
    """A :class:`Check` whose tolerance is ``rel_tol`` x max(1, max |ref|)."""
    return Check(rel_tol * max(1.0, ref.abs().max().item() if ref.numel() else 0.0))


def map_checker(chk: Check, ref: torch.Tensor, coords: torch.Tensor | None = None) -> Callable[[object], None]:
    """The function :func:`timed` calls with each output map: its error against the float64 reference map
    ``ref`` at ``coords`` (None: every pixel) goes to ``chk``."""
    ref_at = ref if coords is None else at_sites(ref, coords)

    def check(out: object) -> None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.shape):
            chk.add(math.inf)
        else:
            chk.add(site_error(out if coords is None else at_sites(out, coords), ref_at))

    return check


def dense_reference(unit: SparseConvChain, x: torch.Tensor) -> torch.Tensor:
    """The eval-mode output of a post-activation unit on the whole map, in float64, composed here from
    ``torch.nn.functional`` (convolution, BN with its running statistics, ReLU) by the ResNet v1 rule:
    ``a = relu(bn_i(conv_i(a)))`` for all but the last convolution, ``out = relu(bn(conv(a)) + shortcut)``
    with shortcut ``x`` (identity) or 0 (none). The sparse path must equal it at its active sites."""
    if unit.preact or unit.shortcut not in ("none", "identity"):
        raise ValueError(f"dense_reference: no rule here for {unit.name} (preact or projection)")
    x64 = x.double()
    a = x64
    L = len(unit.convs)
    for i, (conv, bn) in enumerate(zip(unit.convs, unit.bns, strict=True)):
        z = F.conv2d(a, conv.weight.double(), None, conv.stride, conv.padding)
        z = F.batch_norm(z, bn.running_mean.double(), bn.running_var.double(), bn.weight.double(),
                         bn.bias.double(), False, 0.0, bn.eps)
        a = F.relu(z) if i < L - 1 else z
    return F.relu(a + x64 if unit.shortcut == "identity" else a)


def subm_reference(x: torch.Tensor, sites: torch.Tensor, weight: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """``[P, C_out]``, float64: a submanifold 3x3 convolution, computed densely - the convolution
    (cross-correlation, padding 1) of the map masked to its active ``sites [N, 1, H, W]`` with ``weight
    [C_out, C_in, 3, 3]``, read at ``coords [P, 3]``: a site sums its active neighbours only."""
    masked = x.double() * sites.double()
    return at_sites(F.conv2d(masked, weight.double(), padding=1), coords)


def peer_entry(best_median: tuple[float, float], chk: Check) -> dict[str, object]:
    """A timed call as a result: its best and median ms when every checked call was right, else no time
    (a wrong output is never a speed), and the check."""
    ok = chk.ok
    return {"ms": round(best_median[0], 3) if ok else None,
            "ms_median": round(best_median[1], 3) if ok else None, "check": chk.as_dict(),
            "verdict": chk.verdict()}


SPCONV_MISSING = ("spconv does not import here ({why}); `pip install spconv==2.3.8` (CPU) or a CUDA wheel "
                  "(spconv-cu12x) adds the row; it is not a project dependency")


def spconv_peer(x: torch.Tensor, sites: torch.Tensor, coords: torch.Tensor, reps: int, tol: float) -> dict:
    """spconv's ``SubMConv2d`` (C -> C, 3x3, no bias) on the active pixels ``coords`` of ``x`` in its
    device and dtype, timed with the rulebook (indice pairs) built in every call (``with_rulebook``) and
    reusing the pairs of a first call (``rulebook_reused``); every call's output checked against
    :func:`subm_reference`. ``{"skipped": why}`` when spconv does not import or run here."""
    try:
        import spconv.pytorch as spconv  # optional benchmark dependency, never a project one
    except Exception as exc:
        return {"skipped": SPCONV_MISSING.format(why=f"{type(exc).__name__}: {exc}")}
    try:
        N, C, H, W = x.shape
        # spconv reads the indices' raw buffer, ignoring strides: nonzero()'s result is not contiguous
        coords = coords.int().contiguous()
        feats = at_sites(x, coords).contiguous()
        conv = spconv.SubMConv2d(C, C, 3, bias=False, indice_key="subm").to(x.device, x.dtype)
        ref = subm_reference(x, sites, conv.weight.detach().permute(0, 3, 1, 2), coords)  # [out, kh, kw, in]
        key = coords.long()
        lin = (key[:, 0] * H + key[:, 1]) * W + key[:, 2]
        order = lin.argsort()
        lin_sorted = lin[order]
        results = {}
        with torch.no_grad():
            first = conv(spconv.SparseConvTensor(feats, coords, [H, W], N))
            # the reused rulebook belongs to the first output's indices: the features in their order
            first_feats = at_sites(x, first.indices).contiguous()
            for name, call in (
                ("with_rulebook", lambda: conv(spconv.SparseConvTensor(feats, coords, [H, W], N))),
                ("rulebook_reused", lambda: conv(first.replace_feature(first_feats))),
            ):
                chk = new_check(ref, tol)

                def check(y, chk=chk) -> None:
                    # the output's sites must be the input's (in any order); each compared with the reference
                    oc = y.indices.long()
                    ol = (oc[:, 0] * H + oc[:, 1]) * W + oc[:, 2]
                    oo = ol.argsort()
                    if ol.shape != lin.shape or not torch.equal(ol[oo], lin_sorted):
                        chk.add(math.inf)
                    else:
                        chk.add(site_error(y.features[oo], ref[order]))

                results[name] = peer_entry(timed(call, reps, check=check), chk)
        return results
    except Exception as exc:  # e.g. a build without kernels for this device or dtype: a note, not a failure
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        return {"skipped": f"spconv failed here ({type(exc).__name__}: {first_line})"}


def make_layer(layer: str, C: int, block: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if layer == "conv3x3":
        unit = SparseConvChain(C, (C,), (3,), (1,), shortcut="none", block_size=block, name="conv3x3")
    else:
        unit = SparseResidualUnit(C, C, bottleneck=True, block_size=block)
    with torch.no_grad():  # realistic BN statistics: not the identity
        for bn in unit.slots:
            bn.running_mean.uniform_(-0.1, 0.1)
            bn.running_var.uniform_(0.5, 1.5)
    return unit


def block_params(m: SparseConvChain, H: int, W: int):
    return m.geometry(H, W).block


def random_tile_mask(bp, N: int, sparsity: float, seed: int) -> tuple[torch.Tensor, int]:
    """A mask covering a random (1 - sparsity) share of the output tiles (every pixel of each chosen tile, at
    the input resolution), and how many tiles it covers."""
    total = N * bp.num_blocks
    k = max(1, round((1.0 - sparsity) * total))
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(total, generator=g)[:k]
    n, rest = chosen // bp.num_blocks, chosen % bp.num_blocks
    by, bx = rest // bp.bcount_w, rest % bp.bcount_w
    th, tw = bp.obsize_h * bp.stride_h, bp.obsize_w * bp.stride_w
    tiles = torch.zeros(N, bp.bcount_h, bp.bcount_w)
    tiles[n, by, bx] = 1.0
    mask = tiles.repeat_interleave(th, 1).repeat_interleave(tw, 2)[:, None, : bp.in_h, : bp.in_w]
    return mask.contiguous(), k


def sparse_phases(m, x, mask, bp, backward: bool, reps: int) -> dict[str, float]:
    """Best-of-reps milliseconds of each phase of the sparse path (with its backward if asked): making the block list
    (``reduce_mask``'s rule, the tiles' mask) and the unit on it (gather, convolutions, BN/ReLU, scatter)."""
    binary = m.binary(mask)
    blocks = m.active_blocks(binary)
    out: dict[str, float] = {"list": timed(lambda: m.active_blocks(binary), reps)[0]}
    if not backward:
        with torch.no_grad():
            out["unit"] = timed(lambda: chain_capacity(m, x, blocks, binary, tile=blocks.block.obsize), reps)[0]
        return out
    g = None

    def unit_fb():
        nonlocal g
        xr = x.detach().requires_grad_(True)
        y = chain_capacity(m, xr, blocks, binary, tile=blocks.block.obsize)
        g = torch.randn_like(y) if g is None else g
        y.backward(g)

    out["unit"] = timed(unit_fb, reps)[0]
    return out


def withhold_wrong(row: dict, checks: dict[str, Check]) -> None:
    """Record each part's check in ``row["check"]`` and take out every time a wrong output would stand
    behind: a wrong dense twin voids the row's ratios, a wrong sparse call its sparse times."""
    row["check"] = {k: c.as_dict() for k, c in checks.items()}
    void = []
    if not checks["dense"].ok:
        void += ["dense_ms", "dense_ms_median", "dense_ms_nchw", "dense_ms_nhwc", "speedup", "auto_speedup",
                 "speedup_inplace"]
    if not checks["sparse"].ok:
        void += ["sparse_ms", "sparse_ms_median", "sparse_ms_by_block", "speedup", "auto_speedup"]
    if "sparse_inplace" in checks and not checks["sparse_inplace"].ok:
        void += ["sparse_inplace_ms", "speedup_inplace"]
    for key in void:
        if key in row:
            row[key] = None


def peers(m, x_dense, x, mask, ref, sites, coords, reps: int, tol: float, threads: list[int],
          dense_cache: dict, stage: int) -> list[dict]:
    """The conv3x3 forward row's peers at each thread count (0: leave the threads as they are): the dense
    twin (``x_dense``: the layout the row found faster; timed once per stage and thread count), our unit
    at the row's block size, spconv's SubMConv2d on the same active pixels (:func:`spconv_peer`); every call
    checked. Each is timed at that thread count, in turn, in this process."""
    before = torch.get_num_threads()
    out = []
    try:
        for t in threads:
            if t:
                torch.set_num_threads(t)
            if (stage, t) not in dense_cache:
                chk = new_check(ref, tol)
                dense_cache[stage, t] = peer_entry(
                    timed(lambda: _eval(m, x_dense), reps, check=map_checker(chk, ref)), chk)
            chk = new_check(ref, tol)
            ours = peer_entry(timed(lambda: _eval(m, x, mask=mask), reps, check=map_checker(chk, ref, coords)), chk)
            out.append({"threads": t or None, "dense": dense_cache[stage, t], "ours": ours,
                        "spconv_subm": spconv_peer(x, sites, coords, reps, tol)})
    finally:
        torch.set_num_threads(before)
    return out


def _eval(m, x, **kw):
    with torch.no_grad():
        return m(x, **kw)


def environment() -> dict[str, object]:
    cpu = cpu_model()
    return {
        "allocator": allocator_env(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": cpu,
        "python": platform.python_version(),
    }


def run(args: dict) -> list[dict]:
    quick = args["quick"]
    stages = [1, 4] if quick else [int(s) for s in args["stages"].split(",")]
    sparsities = [0.5, 0.9] if quick else [float(s) for s in args["sparsity"].split(",")]
    blocks = [16] if quick else [int(b) for b in args["blocks"].split(",")]
    reps = 2 if quick else args["reps"]
    layers = args["layers"].split(",")
    passes = args["passes"].split(",")
    N = args["batch"]
    device, dtype = torch.device(args["device"]), getattr(torch, args["dtype"])
    env = environment()
    env["device"], env["dtype"] = str(device), args["dtype"]
    load0 = os.getloadavg()[0]
    print(
        f"allocator {env['allocator']} | sparse maps {args['layout']}"
        f" | threads {env['threads']} | torch {env['torch']} | {env['cpu']} | load {load0:.2f}",
        flush=True,
    )
    from detector.ops import _library

    if not _library.has_kernels(device.type):
        print(
            f"WARNING: compiled sbnet kernels unavailable ({_library.unavailable_reason(device.type)}); "
            "timing the pure-PyTorch reference",
            flush=True,
        )
    print(" ".join(HEADER), flush=True)
    tol = env["check_rel_tol"] = tolerance(dtype, device)
    # the peers' thread counts (CPU); on a GPU one entry, the host's threads do not matter
    peer_threads = [int(t) for t in str(args["peer_threads"]).split(",")] if device.type == "cpu" else [0]
    dense_peer: dict[tuple[int, int], dict] = {}
    rows = []
    for stage in stages:
        H, W, C = STAGES[stage]
        torch.manual_seed(stage)
        x_nchw = torch.randn(N, C, H, W).to(device, dtype)
        g_nchw = torch.randn(N, C, H, W).to(device, dtype)
        maps = {
            "nchw": (x_nchw, g_nchw),
            "nhwc": tuple(t.contiguous(memory_format=torch.channels_last) for t in (x_nchw, g_nchw)),
        }
        x, g = maps[args["layout"]]
        for layer in layers:
            for pas in passes:
                backward = pas == "fwd+bwd"
                m = make_layer(layer, C, blocks[0]).to(device, dtype).train(backward)
                # forward rows: every timed call checked against the float64 reference (fwd+bwd: training-mode
                # BN normalizes by the statistics of the pixels it computes, by definition not the dense twin's)
                ref = None if backward else dense_reference(m, x_nchw)

                def call(x_, g_, m=m, backward=backward, **kw):
                    if not backward:
                        with torch.no_grad():
                            return m(x_, **kw)
                    for p in m.parameters():
                        p.grad = None
                    xr = x_.detach().requires_grad_(True)
                    y = m(xr, **kw)
                    y.backward(g_)
                    return y

                # the dense twin in both layouts, its best is the baseline (quick: only the layout that
                # the full runs found faster on this CPU - NHWC forward, NCHW forward+backward)
                layouts = [("nchw" if backward else "nhwc")] if quick else list(maps)
                dense_chk = Check(0.0) if ref is None else new_check(ref, tol)
                dense_fn = None if ref is None else map_checker(dense_chk, ref)
                dense = {lay: timed(lambda xg=maps[lay], call=call: call(*xg), reps, check=dense_fn)
                         for lay in layouts}
                dense_layout = min(dense, key=lambda k: dense[k][0])
                dense_ms, dense_med = dense[dense_layout]
                for sp in sparsities:
                    best = None
                    per_block = {}
                    sparse_chk = Check(0.0) if ref is None else new_check(ref, tol)
                    for b in blocks:
                        m.block_size = b
                        bp = block_params(m, H, W)
                        mask, k = random_tile_mask(bp, N, sp, seed=1000 * stage + b)
                        mask = mask.to(device, dtype)
                        # the tiles the unit runs: those its mask activates (all of the chosen ones)
                        k = m.active_blocks(mask).count
                        # the active pixels: where the unit's output is defined, and what spconv gets
                        sites = (mask > m.tol).to(dtype)
                        coords = sites[:, 0].nonzero()
                        fn = None if ref is None else map_checker(sparse_chk, ref, coords)
                        ms, med = timed(lambda call=call, mask=mask, x=x, g=g: call(x, g, mask=mask), reps, check=fn)
                        per_block[b] = ms
                        if best is None or ms < best[1]:
                            best = (b, ms, med, mask, k, bp, sites, coords)
                    b, sparse_ms, sparse_med, mask, k, bp, sites, coords = best
                    m.block_size = b
                    actual = 1.0 - k / (N * bp.num_blocks)
                    phases = sparse_phases(m, x, mask, bp, backward, reps)
                    total = sum(phases.values())
                    row = {
                        "layer": layer,
                        "stage": stage,
                        "H": H,
                        "W": W,
                        "C": C,
                        "sparsity": sp,
                        "pass": pas,
                        "batch": N,
                        "dense_ms": round(dense_ms, 3),
                        "sparse_ms": round(sparse_ms, 3),
                        "speedup": round(dense_ms / sparse_ms, 3),
                        "ideal": round(1.0 / (1.0 - actual), 3),
                        # the physical bound: the active tiles' blocks, halo included, at the dense rate
                        "bound": round(
                            (bp.obsize_h * bp.obsize_w) / ((1.0 - actual) * bp.bsize_h * bp.bsize_w), 3
                        ),
                        "auto_speedup": round(dense_ms / min(dense_ms, sparse_ms), 3),
                        "block_size": b,
                        "blocks_active": k,
                        "blocks_total": N * bp.num_blocks,
                        "active_pixels": int(coords.shape[0]),
                        "actual_sparsity": round(actual, 4),
                        "sparse_ms_by_block": {str(kk): round(v, 3) for kk, v in per_block.items()},
                        "dense_layout": dense_layout,
                        **{f"dense_ms_{lay}": round(v[0], 3) for lay, v in dense.items()},
                        "sparse_layout": args["layout"],
                        "dense_ms_median": round(dense_med, 3),
                        "sparse_ms_median": round(sparse_med, 3),
                        "phase_ms": {p: round(phases[p], 3) for p in PHASES},
                        "shares": {p: round(phases[p] / total, 3) for p in PHASES},
                        **env,
                    }
                    checks = {"dense": dense_chk, "sparse": sparse_chk}
                    if layer == "bottleneck":  # the unit writing into its own input (an intermediate it owns)
                        if backward:

                            def owned(x=x):
                                xr = x.detach().requires_grad_(True)
                                return xr * 1.0  # a non-leaf, as a stage's intermediate is

                            def step(xo, m=m, mask=mask, g=g):
                                for p in m.parameters():
                                    p.grad = None
                                m(xo, mask=mask, inplace=True).backward(g)
                        else:

                            def owned(x=x):
                                return x.clone()

                            def step(xo, m=m, mask=mask):
                                with torch.no_grad():
                                    return m(xo, mask=mask, inplace=True)

                        checks["sparse_inplace"] = Check(0.0) if ref is None else new_check(ref, tol)
                        fn = None if ref is None else map_checker(checks["sparse_inplace"], ref, coords)
                        ms = timed(step, reps, setup=owned, check=fn)[0]
                        row["sparse_inplace_ms"] = round(ms, 3)
                        row["speedup_inplace"] = round(dense_ms / ms, 3)
                    if ref is not None:
                        withhold_wrong(row, checks)
                    if layer == "conv3x3" and not backward and args["spconv"]:
                        row["peers"] = peers(m, maps[dense_layout][0], x, mask, ref, sites, coords, reps, tol,
                                             peer_threads, dense_peer, stage)
                    rows.append(row)
                    print(fmt_row(row), flush=True)
                    for pr in row.get("peers", ()):
                        print(fmt_peer(row, pr), flush=True)
    load1 = os.getloadavg()[0]
    for r in rows:
        r["load_avg_start"], r["load_avg_end"] = round(load0, 2), round(load1, 2)
    return rows


HEADER = (
    "layer",
    "stage",
    "H x W x C",
    "sparsity",
    "pass",
    "block",
    "dense ms",
    "sparse ms",
    "speedup",
    "in-place",
    "ideal",
    "bound",
    "auto",
    "reduce/gather/conv/scatter %",
    "check",
)
PEER_HEADER = (
    "stage",
    "sparsity",
    "active pixels",
    "threads",
    "dense ms",
    "ours ms (block)",
    "spconv ms, rulebook built",
    "spconv ms, rulebook reused",
    "spconv reused / ours",
)


_SUFFIX = {"nchw": "c", "nhwc": "h"}


def _num(v: float | None, spec: str, suffix: str = "") -> str:
    """A time or ratio; ``WRONG`` where the check withheld it (a wrong output is never a speed)."""
    return "WRONG" if v is None else f"{v:{spec}}{suffix}"


def _inplace(r: dict) -> str:
    return _num(r["speedup_inplace"], ".2f", "x") if "speedup_inplace" in r else "-"


def row_verdict(r: dict) -> str:
    """``ok``, ``-`` (fwd+bwd rows: not checked), or which part was wrong, in how many calls, by how much."""
    if "check" not in r:
        return "-"
    bad = [f"{part} {c['wrong']}/{c['calls']} calls wrong, max abs err {c['max_abs_err']}"
           for part, c in r["check"].items() if not c["ok"]]
    return "WRONG: " + "; ".join(bad) if bad else "ok"


def fmt_row(r: dict) -> str:
    sh = "/".join(f"{100 * r['shares'][p]:.0f}" for p in PHASES)
    return (
        f"{r['layer']:10s} {r['stage']:1d} {r['H']:3d}x{r['W']:3d}x{r['C']:3d} {r['sparsity']:5.2f} "
        f"{r['pass']:7s} {r['block_size']:3d} {_num(r['dense_ms'], '9.1f')}{_SUFFIX[r['dense_layout']]} "
        f"{_num(r['sparse_ms'], '9.1f')} "
        f"{_num(r['speedup'], '6.2f', 'x')} {_inplace(r):>7s} {r['ideal']:6.1f}x {r['bound']:6.1f}x "
        f"{_num(r['auto_speedup'], '6.2f', 'x')}  {sh}  {row_verdict(r)}"
    )


def _peer_ms(e: dict) -> str:
    if "skipped" in e:
        return "skipped"
    return e["verdict"] if e["ms"] is None else f"{e['ms']:.1f}"


def peer_cells(r: dict, pr: dict) -> list[str]:
    """One peer entry of a conv3x3 forward row as the cells of :data:`PEER_HEADER`."""
    sp = pr["spconv_subm"]
    built, reused = ({"skipped": sp["skipped"]},) * 2 if "skipped" in sp else (sp["with_rulebook"],
                                                                                sp["rulebook_reused"])
    ours, ratio = pr["ours"], "-"
    if ours["ms"] is not None and reused.get("ms") is not None:
        ratio = f"{reused['ms'] / ours['ms']:.2f}x"
    return [str(r["stage"]), f"{r['sparsity']:.2f}", str(r["active_pixels"]), str(pr["threads"] or "-"),
            _peer_ms(pr["dense"]), f"{_peer_ms(ours)} ({r['block_size']})", _peer_ms(built), _peer_ms(reused), ratio]


def fmt_peer(r: dict, pr: dict) -> str:
    return "  peers: " + " | ".join(f"{h} {c}" for h, c in zip(PEER_HEADER, peer_cells(r, pr), strict=True))


def markdown(rows: list[dict], command: str) -> str:
    r0 = rows[0]
    lines = [
        f"# Sparse-block benchmark ({r0.get('device', 'cpu')}, {r0.get('dtype', 'float32')})",
        "",
        f"Command: `{command}`",
        "",
        f"CPU: {r0['cpu']}; torch {r0['torch']}, {r0['threads']} threads; "
        f"allocator {r0['allocator']} "
        f"(dense and sparse under the same setting, same process); batch {r0['batch']}; "
        f"load average {r0['load_avg_start']} at start, {r0['load_avg_end']} at end (shared machine).",
        "",
        f"Sparse maps {r0['sparse_layout']}; dense timed on NCHW and NHWC maps, the faster one is the "
        "baseline (`dense ms` suffix: c = NCHW, h = NHWC). Best of the repetitions; "
        "`speedup` = dense / sparse at the best block size (the unit writes a copy of its input: its "
        "caller keeps it); `in-place` = the unit writing into its input, as the backbone's stages do for "
        "their own intermediates (bottleneck; fwd+bwd on a non-leaf input made before the timer); "
        "`bound` = the physical bound: dense / (active tiles x (tile + halo)^2 / tile^2); "
        "`ideal` = 1 / (1 - actual block sparsity); `auto` = dense / min(dense, sparse) "
        "(block_size='auto' may choose dense). Shares: phases of the sparse path timed separately "
        "(with backward in fwd+bwd rows). fwd = eval mode, no grad; fwd+bwd = training mode. "
        "`check` (fwd rows): the output of every timed call, warm-ups included - dense at every pixel, "
        "sparse (every block size tried, and in place) at the active pixels (the mask's: every pixel of "
        "the chosen tiles) - against a "
        "float64 reference composed from torch.nn.functional (convolution, BN with running statistics, "
        f"ReLU, shortcut); wrong = max abs error above {r0['check_rel_tol']:g} x max(1, max |reference|), "
        "or not finite; "
        "a wrong part's times are withheld (`WRONG`). fwd+bwd rows are not checked (`-`): training-mode "
        "BN normalizes by the statistics of the pixels it computes, by definition not the dense twin's. "
        "Generated by scripts/bench_sparse.py.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for r in rows:
        sh = " / ".join(f"{100 * r['shares'][p]:.0f}" for p in PHASES)
        lines.append(
            f"| {r['layer']} | {r['stage']} | {r['H']}x{r['W']}x{r['C']} | {r['sparsity']:.2f} | "
            f"{r['pass']} | {r['block_size']} | {_num(r['dense_ms'], '.1f')} {_SUFFIX[r['dense_layout']]} | "
            f"{_num(r['sparse_ms'], '.1f')} | {_num(r['speedup'], '.2f', 'x')} | {_inplace(r)} | "
            f"{r['ideal']:.1f}x | {r['bound']:.1f}x | {_num(r['auto_speedup'], '.2f', 'x')} | {sh} | "
            f"{row_verdict(r)} |"
        )
    lines += peers_markdown(rows)
    return "\n".join(lines) + "\n"


def peers_markdown(rows: list[dict]) -> list[str]:
    """The peers section: the table of the conv3x3 forward rows' peers and what makes them comparable."""
    pr_rows = [(r, pr) for r in rows if r.get("peers") for pr in r["peers"]]
    if not pr_rows:
        return []
    r0 = pr_rows[0][0]
    where = "a GPU" if r0.get("device", "cpu").startswith("cuda") else "the CPU"
    lines = [
        "",
        "## Peers: spconv's SubMConv2d on the same active pixels",
        "",
        f"The conv3x3 forward rows again, on {where}, with spconv's submanifold convolution beside our unit "
        f"and the dense twin, each timed in turn in this process at each thread count (`threads`; then back "
        f"to the table's {r0['threads']}), best of the repetitions after a warm-up. The same input map, the "
        "same active pixels (the mask's: every pixel of the row's chosen tiles, `active pixels`), the same channels "
        f"(C -> C, 3x3, no bias), the same dtype ({r0.get('dtype', 'float32')}), the same allocator "
        f"settings ({r0['allocator']}). Ours: the row's unit at its block size "
        "(conv-BN-ReLU, BN folded into the convolution; the mask's reduction, the gather, the convolution and "
        "the scatter into a fresh map all inside the timed call; each tile reads its halo from the whole "
        "input). spconv (pip package spconv, not a project dependency): `SubMConv2d` on the active pixels' "
        "features (no BN or ReLU; a pixel sums its active neighbours only), timed with its rulebook (the "
        "indice pairs) built in every call, and reusing the pairs of a first call (`indice_key`). "
        "Every call's output is checked: ours and dense against the float64 reference above at the active "
        "pixels / everywhere; spconv's against a dense 3x3 convolution (torch.nn.functional.conv2d, "
        "float64) of the map masked to the active pixels, with spconv's weight, read at those pixels (the "
        "output's pixels must be the input's). A cell with any wrong call gives `WRONG k/n calls` and the "
        "largest error instead of a time. `spconv reused / ours` > 1: ours is faster.",
        "",
        "| " + " | ".join(PEER_HEADER) + " |",
        "|" + "---|" * len(PEER_HEADER),
    ]
    lines += ["| " + " | ".join(peer_cells(r, pr)) + " |" for r, pr in pr_rows]
    notes = dict.fromkeys(pr["spconv_subm"]["skipped"] for _, pr in pr_rows if "skipped" in pr["spconv_subm"])
    lines += [""] + [f"spconv skipped: {n}." for n in notes] if notes else []
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, DEFAULTS, USAGE)
    if args["threads"] > 0:
        torch.set_num_threads(args["threads"])
    rows = run(args)
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    md = Path(args["md"]) if args["md"] else out.with_suffix(".md")
    command = "python scripts/bench_sparse.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md.write_text(markdown(rows, command.strip()))
    print(f"wrote {out} and {md}")
