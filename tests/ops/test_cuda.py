"""The sbnet ops, sparse layers and detector on a GPU; every op test also runs on the CPU (its twin).

The `gpu`-marked cases skip without a CUDA device (`pytest -m gpu` selects them; `make gpu-check` runs
them). Op results are compared with the pure-PyTorch reference on the CPU: values are multiples of 1/4,
which every dtype holds and adds exactly, so forward and backward must be equal bit for bit in
float32, float16 and bfloat16 whatever the summation order. The CUDA build itself is compile-checked by
tests/ops/test_cuda_compile.py, and its element bodies run on the CPU in tests/ops/test_cuda_bodies.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import detector.ops as ops
from detector.ops import _library, calc_block_params, reference
from tests.ops import cases
from tests.paths import REPO

HAS_CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
DTYPES = [d for d in cases.DTYPES if d != torch.float64]  # float64: the CPU op tests
LAYOUTS = list(cases.LAYOUTS)
CASES = ("halo2", "stride2")
GEOMETRIES = cases.select(*CASES)


@pytest.fixture
def device(request):
    dev = request.param
    if dev == "cuda":
        _library.load()
        if not _library.has_kernels("cuda"):
            pytest.fail(f"CUDA is available but the sbnet CUDA kernels are not: {_library.unavailable_reason('cuda')}")
    return dev


def _to(t, device, layout):
    """A copy of t on device in the layout (always a new tensor, also on the CPU)."""
    return t.to(device, copy=True).contiguous(memory_format=cases.memory_format(layout))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("geom", cases.params(*CASES))
def test_ops_equal_the_reference(device, layout, dtype, geom):
    bp = calc_block_params(*geom)
    gen = torch.Generator().manual_seed(0)
    mask = ((torch.rand((2, 1, bp.in_h, bp.in_w), generator=gen) ** 4) * 8).floor().div(8).to(dtype)
    for avgpool in (False, True):
        idx = ops.reduce_mask(mask.to(device), bp, 0.25, avgpool)
        assert idx.device.type == device
        # row-major like the CPU's (CUDA's nonzero is column-major): the ops then take it as it is, unchecked
        assert idx.is_contiguous() and ops.functional._known_valid(idx, (2, bp.bcount_h, bp.bcount_w))
        assert torch.equal(idx.cpu(), reference.reduce_mask(mask, bp, 0.25, avgpool))
        flags = ops.block_activity(mask.to(device), bp, 0.25, avgpool)
        assert flags.device.type == device
        assert torch.equal(flags.cpu(), reference.block_activity(mask, bp, 0.25, avgpool))
    idx = cases.indices(bp, 2, 0.7, 1)
    x = cases.quarters((2, 5, bp.in_h, bp.in_w), dtype, 2)
    blocks = ops.sparse_gather(_to(x, device, layout), idx.to(device), bp)
    assert blocks.is_contiguous(memory_format=cases.memory_format(layout))
    assert torch.equal(blocks.cpu(), reference.sparse_gather(x, idx, bp))
    tiles = cases.quarters((idx.shape[0], 5, *bp.obsize), dtype, 3)
    base = cases.quarters((2, 5, bp.out_h, bp.out_w), dtype, 4)
    for add in (False, True):
        for relu in (False, True):
            expected = reference.sparse_scatter(tiles, idx, base, bp, add, relu)
            out = ops.sparse_scatter(_to(tiles, device, layout), idx.to(device), _to(base, device, layout), bp,
                                     add, relu)
            assert out.is_contiguous(memory_format=cases.memory_format(layout)) and torch.equal(out.cpu(), expected)
            inplace = _to(base, device, layout)
            ops.sparse_scatter_(_to(tiles, device, layout), idx.to(device), inplace, bp, add, relu)
            assert torch.equal(inplace.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_equals_the_reference_gradient(device, layout, dtype):
    bp = calc_block_params(*GEOMETRIES[0])
    idx = cases.indices(bp, 2, 0.7, 5)
    x = cases.quarters((2, 4, bp.in_h, bp.in_w), dtype, 6)
    g = cases.quarters((idx.shape[0], 4, *bp.bsize), dtype, 7)
    x_ref = x.clone().requires_grad_()
    reference.sparse_gather(x_ref, idx, bp).backward(g)
    xd = _to(x, device, layout).requires_grad_()
    ops.sparse_gather(xd, idx.to(device), bp).backward(_to(g, device, layout))
    assert torch.equal(xd.grad.cpu(), x_ref.grad)

    tiles = cases.quarters((idx.shape[0], 4, *bp.obsize), dtype, 8)
    base = cases.quarters((2, 4, bp.out_h, bp.out_w), dtype, 9)
    go = cases.quarters(base.shape, dtype, 10)
    for add in (False, True):
        for relu in (False, True):
            t_ref, b_ref = tiles.clone().requires_grad_(), base.clone().requires_grad_()
            reference.sparse_scatter(t_ref, idx, b_ref, bp, add, relu).backward(go)
            for inplace in (False, True):
                t, b = _to(tiles, device, layout).requires_grad_(), _to(base, device, layout).requires_grad_()
                if inplace:  # the in-place variant under autograd writes into a non-leaf
                    out = ops.sparse_scatter_(t, idx.to(device), b * 1, bp, add, relu)
                else:
                    out = ops.sparse_scatter(t, idx.to(device), b, bp, add, relu)
                out.backward(_to(go, device, layout))
                assert torch.equal(t.grad.cpu(), t_ref.grad), (add, relu, inplace)
                assert torch.equal(b.grad.cpu(), b_ref.grad), (add, relu, inplace)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_float64(device, layout):
    bp = calc_block_params(9, 8, bsize=(5, 4), ksize=3, stride=1, padding=1)
    idx = cases.indices(bp, 2, 0.6, 3).to(device)
    opts = {"dtype": torch.float64, "device": device}
    x = torch.randn((2, 2, 9, 8), **opts).contiguous(memory_format=cases.memory_format(layout)).requires_grad_()
    fast = device == "cpu"  # the CPU kernels' full gradcheck is in the CPU op tests
    assert torch.autograd.gradcheck(lambda t: ops.sparse_gather(t, idx, bp), (x,), fast_mode=fast)
    tiles = torch.randn((idx.shape[0], 2, *bp.obsize), **opts).contiguous(memory_format=cases.memory_format(layout))
    base = torch.randn((2, 2, 9, 8), **opts).contiguous(memory_format=cases.memory_format(layout))
    for add in (False, True):
        for relu in (False, True):
            def scatter(b, s, add=add, relu=relu):
                return ops.sparse_scatter(b, idx, s, bp, add, relu)

            assert torch.autograd.gradcheck(scatter, (tiles.requires_grad_(), base.requires_grad_()), fast_mode=fast)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_deterministic_under_use_deterministic_algorithms(device, layout, deterministic):
    H, W, C = (200, 176, 32) if device == "cuda" else (50, 44, 8)
    bp = calc_block_params(H, W, bsize=16, ksize=5, stride=1, padding=2)
    gen = torch.Generator().manual_seed(11)
    mask = (torch.rand((2, 1, H, W), generator=gen) > 0.97).float().to(device)
    x0 = torch.randn((2, C, H, W), generator=gen).to(device).contiguous(memory_format=cases.memory_format(layout))
    g = torch.randn((2, C, H, W), generator=gen).to(device)

    def run():
        x = x0.clone().requires_grad_()
        idx = ops.reduce_mask(mask, bp, 0.5)
        out = ops.sparse_scatter(ops.sparse_gather(x, idx, bp)[:, :, 2:-2, 2:-2] * 1.5, idx, x, bp, True, True)
        (out * g).sum().backward()
        return idx, out.detach(), x.grad

    first = deterministic(run, threads=(None, None))  # twice
    assert first[0].shape[0] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)], indirect=True)
def test_cuda_adjoint_equals_the_cpu_kernel_bit_for_bit(device, layout):
    """Both devices add overlapping halos in the same phase order: float32 gradients agree exactly."""
    bp = calc_block_params(*GEOMETRIES[0])
    idx = cases.indices(bp, 2, 0.8, 12)
    g = torch.randn((idx.shape[0], 4, *bp.bsize), generator=torch.Generator().manual_seed(13))
    grads = []
    for dev in ("cpu", "cuda"):
        x = torch.zeros((2, 4, bp.in_h, bp.in_w), device=dev).contiguous(memory_format=cases.memory_format(layout))
        x.requires_grad_()
        ops.sparse_gather(x, idx.to(dev), bp).backward(_to(g, dev, layout))
        grads.append(x.grad.cpu())
    assert torch.equal(grads[0], grads[1])


@pytest.fixture
def exact_cuda():
    """float64 layers on the GPU with TF32 off, restored afterwards."""
    was = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = was


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)], indirect=True)
def test_sparse_unit_equals_its_dense_twin_on_gpu(device, layout, exact_cuda):
    from detector.nn.resnet import SparseResidualUnit

    torch.manual_seed(0)
    T, H, W = 8, 40, 36
    unit = SparseResidualUnit(16, 16, bottleneck=True, block_size=T).double().to(device).eval()
    with torch.no_grad():
        for bn in (m for m in unit.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
    twin = copy.deepcopy(unit)
    x = torch.randn((2, 16, H, W), dtype=torch.float64, device=device)
    x = x.contiguous(memory_format=cases.memory_format(layout))
    with torch.no_grad():
        dense = twin.forward_dense(x.clone())
        ones = unit(x.clone(), mask=torch.ones((2, 1, H, W), dtype=torch.float64, device=device))
        torch.testing.assert_close(ones, dense, atol=1e-10, rtol=0)
        # a mask of whole output tiles: those tiles are active, and there the output is the dense one
        tiles = torch.rand((2, 1, -(-H // T), -(-W // T)), generator=torch.Generator().manual_seed(1)) < 0.4
        mask = tiles.double().repeat_interleave(T, 2).repeat_interleave(T, 3)[..., :H, :W].to(device)
        sparse = unit(x.clone(), mask=mask)
    on = mask.expand_as(dense) > 0
    assert 0 < on.double().mean() < 1
    torch.testing.assert_close(sparse[on], dense[on], atol=1e-10, rtol=0)


def _small_detector_and_batch(device):
    import numpy as np

    from detector.data.structures import Frame, collate_frames
    from detector.geometry.boxes import Boxes3D
    from detector.geometry.voxelize import BevGrid
    from detector.models.detector import BevDetector
    from detector.models.targets import BoxCoder
    from detector.nn.resnet import SparseResNet
    from tests.conftest import make_calib

    grid = BevGrid((0.0, 25.6), (-12.8, 12.8), (-2.5, 1.0), 0.2, 0.5)
    torch.manual_seed(0)
    backbone = SparseResNet(grid.C, stem_channels=8, stage_units=(1, 1, 1), stage_channels=(8, 12, 16),
                            stage_strides=(2, 2, 2), bottleneck=False, block_size=8)
    model = BevDetector(grid, backbone=backbone, coder=BoxCoder(["Car"]), neck_channels=8, head_channels=8,
                        out_stride=4, head_block_size=16, mask_dilation_m=2.0, sparse=True)
    rng = np.random.default_rng(0)
    boxes = Boxes3D(torch.tensor([[8.0, 2.0, -0.9, 4.0, 1.7, 1.5, 0.4], [18.0, -5.0, -0.8, 3.8, 1.6, 1.45, -2.0]]))
    frames = []
    for i in range(2):
        pts = np.column_stack([rng.uniform(0, 25.6, 3000), rng.uniform(-12.8, 12.8, 3000),
                               rng.uniform(-2.4, 0.9, 3000), rng.random(3000)]).astype(np.float32)
        frames.append(Frame(f"{i:06d}", pts, make_calib(), boxes, np.array(["Car", "Car"])))
    batch = collate_frames(frames)
    batch.mask = torch.zeros(2, 1, grid.H, grid.W)
    batch.mask[..., 16:112, :] = 1.0  # a road band
    return model.to(device), batch.to(device)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)], indirect=True)
def test_detector_forward_backward_on_gpu(device, exact_cuda):
    model, batch = _small_detector_and_batch(device)
    model.train()
    out = model(batch)
    assert out.heatmap.device.type == device and 0 < out.sparsity < 1
    loss, _ = model.loss(out, batch)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    model.eval()
    with torch.no_grad():  # all-ones mask: the sparse detector is its dense twin
        ones = torch.ones_like(batch.mask)
        batch.mask = None
        dense = model(batch)
        batch.mask = ones
        sparse = model(batch)
    torch.testing.assert_close(sparse.heatmap, dense.heatmap, rtol=1e-4, atol=1e-4)


# Each bad call runs in a child process, so that a crash fails this case with the child's output (Python's
# faulthandler trace, and the native backtrace: gdb's where gdb is installed, else a SIGSEGV handler preloaded
# into a rerun) instead of ending the whole run.
# Found this way (H200, 2026-12-04): the x-3d, bsize-zero and both layout cases segfaulted, x-int and
# indices-on-cpu raised. The native frames: c10::str -> operator<<(ostream&, ArrayRef<long>) ->
# std::ostream::_M_insert<long> *inside the sbnet library* - that machine's compiler (/opt/gcc) links parts of
# libstdc++ statically, so the library had its own copy of the stream's number formatting, whose locale facets
# are not the process's. Every number in a kernel message is now formatted by std::to_string (sbnet::num,
# sbnet::dims in kernels/common.h); dtypes, devices and strings stream safely.
BAD_CUDA_CALLS = {
    "indices-on-cpu": ("torch.ops.sbnet.sparse_gather(x, idx, *geo)",
                       "sbnet::sparse_gather: indices are on cpu but the data is on cuda"),
    "x-3d": ("torch.ops.sbnet.sparse_gather(x[0], idx.cuda(), *geo)",
             "sbnet::sparse_gather: x must be 4-D [N, C, H, W], got [3, "),
    "x-int": ("torch.ops.sbnet.sparse_gather(x.int(), idx.cuda(), *geo)",
              "sbnet::sparse_gather: x must be float16, bfloat16, float32 or float64, got Int"),
    "bsize-zero": ("torch.ops.sbnet.sparse_gather(x, idx.cuda(), [0, 5], geo[1], geo[2])",
                   "sbnet::sparse_gather: block size must be positive, got [0, 5]"),
    "x-transposed": ("torch.ops.sbnet.sparse_gather(x.transpose(2, 3), idx.cuda(), *geo)",
                     "sbnet::sparse_gather: x must be contiguous in NCHW or channels-last"),
    "blocks-not-channels-last": (
        "torch.ops.sbnet.sparse_scatter_(torch.zeros((idx.shape[0], 3, *bp.obsize), device='cuda'), idx.cuda(), "
        "x.contiguous(memory_format=torch.channels_last), bp.obsize, [0, 0], True, False)",
        "sbnet::sparse_scatter_: blocks must be channels-last like its map"),
}

# A SIGSEGV/SIGABRT handler printing the native frames (glibc's backtrace; no gdb needed), for LD_PRELOAD.
_BACKTRACE_C = r"""
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
static void on_fault(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(128 + sig);
}
__attribute__((constructor)) static void install(void) {
  signal(SIGSEGV, on_fault);
  signal(SIGABRT, on_fault);
  signal(SIGBUS, on_fault);
}
"""


def _native_backtrace(argv: list[str], root, tmp) -> str:
    """The native frames of a crashing child: gdb's backtrace, else a rerun with a preloaded handler, its
    frames in the sbnet library resolved with addr2line (file:line)."""
    import re
    import shutil
    import subprocess

    if shutil.which("gdb"):
        gdb = subprocess.run(["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *argv], cwd=root,
                             capture_output=True, text=True, timeout=300)
        return "--- gdb ---\n" + gdb.stdout[-6000:] + gdb.stderr[-2000:]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "(no gdb and no C compiler: no native backtrace)"
    src, lib = tmp / "bt.c", tmp / "libbt.so"
    src.write_text(_BACKTRACE_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(lib), str(src)], check=True, timeout=60)
    env = dict(os.environ, LD_PRELOAD=str(lib))
    res = subprocess.run([a for a in argv if a not in ("-X", "faulthandler")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if "(" in ln and "[0x" in ln]
    out = [f"--- native backtrace (rc {res.returncode}) ---", *lines[:40]]
    if shutil.which("addr2line"):  # file:line for our library's frames: "path/lib.so(+0x1234) [0x...]"
        for ln in lines[:40]:
            m = re.match(r"(.*sbnet[^(]*\.so)\(([^)]*)\)", ln)
            if m and "+0x" in m.group(2) and not m.group(2).split("+")[0]:
                a2l = subprocess.run(["addr2line", "-C", "-f", "-i", "-e", m.group(1), m.group(2).split("+")[1]],
                                     capture_output=True, text=True, timeout=60)
                out.append(f"  {m.group(2)}: " + " / ".join(a2l.stdout.split("\n"))[:400])
    return "\n".join(out)


@pytest.mark.parametrize("call", list(BAD_CUDA_CALLS))
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)], indirect=True)
def test_cuda_bad_input_names_the_op_and_argument(device, call, tmp_path):
    import subprocess
    import sys

    expr, message = BAD_CUDA_CALLS[call]
    code = (
        "import torch\n"
        "from detector.ops import _library, calc_block_params\n"
        "from tests.ops.test_cuda import GEOMETRIES\nfrom tests.ops.cases import indices\n"
        "_library.load()\n"
        "bp = calc_block_params(*GEOMETRIES[0])\n"
        "idx = indices(bp, 2, 0.7, 15)\n"
        "x = torch.zeros((2, 3, bp.in_h, bp.in_w), device='cuda')\n"
        "geo = (bp.bsize, bp.bstride, bp.boffset)\n"
        "try:\n"
        f"    {expr}\n"
        "    print('NO ERROR RAISED')\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError:', str(e).splitlines()[0])\n"
    )
    root = REPO
    argv = [sys.executable, "-X", "faulthandler", "-c", code]
    res = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    if res.returncode != 0:  # a crash: its native backtrace too
        out = out[-3000:] + "\n" + _native_backtrace(argv, root, tmp_path)
    assert res.returncode == 0, f"the bad call crashed the process (rc {res.returncode}):\n{out[-8000:]}"
    assert f"RuntimeError: {message}" in res.stdout, out[-4000:]
