"""Build (JIT, cached) and load the sbnet kernels; register their fake and autograd formulas.

``load()`` (through :func:`build`) compiles ``kernels/ops.cpp`` (the ``TORCH_LIBRARY(sbnet, m)`` schemas) and
``kernels/cpu/*.cpp`` (OpenMP) with :func:`torch.utils.cpp_extension.load`, plus ``kernels/cuda/*.cu``
when ``torch.cuda.is_available()`` and nvcc (``CUDA_HOME``) is found, into a build folder that is kept
between runs (``build/sbnet_kernels/<variant>-torch<version>`` in the repository, or under
``$DETECTOR_KERNELS_BUILD_DIR``); ninja
rebuilds only what changed. It then registers, once, a fake (meta) kernel and an autograd formula for
each op with :mod:`torch.library`. If no compiler is there or the build fails, the functional layer
warns once and the ops run the pure-PyTorch reference (see :mod:`detector.ops.functional`).

``DETECTOR_NO_KERNELS=1`` skips the build (reference only). ``make kernels`` calls ``load(verbose=True)``.
"""

from __future__ import annotations

import glob
import os
import shutil
import threading
import time
from pathlib import Path

import torch

__all__ = ["load", "build", "sources", "has_kernels", "unavailable_reason", "kernels_dir", "build_dir"]

_lock = threading.Lock()
_attempted = False
_devices: set[str] = set()  # device types the loaded extension serves
_reason = "not built yet"
_cuda_reason = ""


def kernels_dir() -> Path:
    """The ``kernels/`` source folder at the repository root."""
    return Path(__file__).resolve().parents[2] / "kernels"


def build_dir(with_cuda: bool) -> Path:
    """Where the extension is built and cached (one sub-folder per CPU-only / CUDA variant)."""
    root = os.environ.get("DETECTOR_KERNELS_BUILD_DIR")
    base = Path(root) if root else Path(__file__).resolve().parents[2] / "build" / "sbnet_kernels"
    return base / f"{'cuda' if with_cuda else 'cpu'}-torch{torch.__version__}"


def _cuda_wanted() -> tuple[bool, str]:
    """Whether to compile the CUDA sources, and why not."""
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not Path(CUDA_HOME, "bin", "nvcc").exists():
        return False, "nvcc not found (set CUDA_HOME)"
    return True, ""


def _register_python_side() -> None:
    """Fake kernels and autograd formulas of the sbnet ops (called once, after the library loaded)."""
    lib = torch.ops.sbnet

    @torch.library.register_fake("sbnet::reduce_mask")
    def _(mask, bsize, bstride, boffset, bcount, tol, avgpool):
        k = torch.library.get_ctx().new_dynamic_size()
        return mask.new_empty((k, 3), dtype=torch.int32)

    @torch.library.register_fake("sbnet::sparse_gather")
    def _(x, indices, bsize, bstride, boffset):
        return x.new_empty((indices.shape[0], x.shape[1], bsize[0], bsize[1]))

    @torch.library.register_fake("sbnet::sparse_gather_backward")
    def _(grad_blocks, indices, input_size, bstride, boffset):
        return grad_blocks.new_empty(input_size)

    @torch.library.register_fake("sbnet::sparse_scatter")
    def _(blocks, indices, base, bstride, boffset, add):
        return torch.empty_like(base, memory_format=torch.contiguous_format)

    @torch.library.register_fake("sbnet::sparse_scatter_")
    def _(blocks, indices, base, bstride, boffset, add):
        return None

    # gather: its gradient is a scatter-add (overlapping halos add up) into zeros like x.
    def gather_setup(ctx, inputs, output):
        x, indices, bsize, bstride, boffset = inputs
        ctx.save_for_backward(indices)
        ctx.geometry = (list(x.shape), list(bstride), list(boffset))

    def gather_backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        input_size, bstride, boffset = ctx.geometry
        return lib.sparse_gather_backward(grad, indices, input_size, bstride, boffset), None, None, None, None

    torch.library.register_autograd("sbnet::sparse_gather", gather_backward, setup_context=gather_setup)

    # gather_backward is linear in grad_blocks; its adjoint is the gather (double backward).
    def gather_bw_setup(ctx, inputs, output):
        grad_blocks, indices, input_size, bstride, boffset = inputs
        ctx.save_for_backward(indices)
        ctx.geometry = (list(grad_blocks.shape[2:]), list(bstride), list(boffset))

    def gather_bw_backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        bsize, bstride, boffset = ctx.geometry
        return lib.sparse_gather(grad, indices, bsize, bstride, boffset), None, None, None, None

    torch.library.register_autograd(
        "sbnet::sparse_gather_backward", gather_bw_backward, setup_context=gather_bw_setup
    )

    # scatter: grad wrt blocks = gather of grad_out at the tiles; wrt base = grad_out (tiles zeroed
    # when the tiles were written rather than added).
    def scatter_setup(ctx, inputs, output):
        blocks, indices, base, bstride, boffset, add = inputs
        ctx.save_for_backward(indices)
        ctx.geometry = (list(blocks.shape), list(bstride), list(boffset), bool(add))

    def scatter_backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        blocks_shape, bstride, boffset, add = ctx.geometry
        grad_blocks = grad_base = None
        if ctx.needs_input_grad[0]:
            grad_blocks = lib.sparse_gather(grad, indices, blocks_shape[2:], bstride, boffset)
        if ctx.needs_input_grad[2]:
            if add:
                grad_base = grad
            else:
                zeros = grad.new_zeros(blocks_shape)
                grad_base = lib.sparse_scatter(zeros, indices, grad, bstride, boffset, False)
        return grad_blocks, None, grad_base, None, None, None

    torch.library.register_autograd("sbnet::sparse_scatter", scatter_backward, setup_context=scatter_setup)


def _stale(library: Path, src: Path) -> bool:
    """Whether the cached library is missing or older than a kernel source (only for the message:
    torch's loader decides what to rebuild)."""
    if not library.exists():
        return True
    newest = max(p.stat().st_mtime for p in src.rglob("*") if p.suffix in (".cpp", ".cu", ".h", ".cuh"))
    return library.stat().st_mtime < newest


def _fail(reason: str, verbose: bool) -> bool:
    """Record why the kernels are unavailable (the functional layer warns once with it)."""
    global _reason
    _reason = reason
    if verbose:
        print(f"detector.ops: sbnet kernels unavailable: {reason}; ops use the pure-PyTorch reference",
              flush=True)
    return False


def _ninja_on_path() -> None:
    """torch's loader runs ``ninja`` from PATH; a venv that is not activated has the pip ``ninja``
    package's binary outside PATH, so add its folder when no ninja is found."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build then fails with torch's own "Ninja is required" message
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def sources(with_cuda: bool) -> list[str]:
    """The extension's source files: schemas, CPU kernels and (``with_cuda``) CUDA kernels."""
    src = kernels_dir()
    files = [str(src / "ops.cpp")] + sorted(glob.glob(str(src / "cpu" / "*.cpp")))
    if with_cuda:
        files += sorted(glob.glob(str(src / "cuda" / "*.cu")))
    return files


def build(with_cuda: bool, verbose: bool = False) -> Path:
    """Compile (ninja: only what changed) and load the extension; returns the shared library's path.

    Raises on any failure. ``with_cuda=True`` needs nvcc (``CUDA_HOME``) and a CUDA build of torch but
    no GPU: ``make kernels-cuda`` uses it as the CUDA compile check.
    """
    from torch.utils.cpp_extension import load as cpp_load

    _ninja_on_path()
    src = kernels_dir()
    files = sources(with_cuda)
    missing = [f for f in files[:1] if not Path(f).exists()]
    if missing or len(files) == 1:
        raise FileNotFoundError(f"kernel sources not found under {src}")
    out = build_dir(with_cuda)
    out.mkdir(parents=True, exist_ok=True)
    name = "sbnet_kernels_cuda" if with_cuda else "sbnet_kernels_cpu"
    variant = "CPU+CUDA" if with_cuda else "CPU"
    if _stale(out / f"{name}.so", src):
        print(f"detector.ops: building sbnet kernels ({variant}) in {out} (first use: about a minute on CPU, "
              "several with CUDA)", flush=True)
    elif verbose:
        print(f"detector.ops: sbnet kernels ({variant}) cached in {out}; checking they are up to date",
              flush=True)
    cpp_load(
        name=name,
        sources=files,
        extra_include_paths=[str(src)],
        extra_cflags=["-O3", "-fopenmp"],
        extra_cuda_cflags=["-O3"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=verbose,
    )
    return out / f"{name}.so"


def load(verbose: bool = False) -> bool:
    """Build (if needed) and load the extension; True when the compiled ops are available.

    Safe to call many times: the first call does the work, later ones return its outcome. On failure
    records the reason (printed when ``verbose``; :func:`unavailable_reason` tells it, and the
    functional layer warns once with it).
    """
    global _attempted, _cuda_reason
    with _lock:
        if _attempted:
            return bool(_devices)
        _attempted = True
        if os.environ.get("DETECTOR_NO_KERNELS", "") not in ("", "0"):
            return _fail("DETECTOR_NO_KERNELS is set", verbose)
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            return _fail("no C++ compiler found (set CXX)", verbose)
        with_cuda, _cuda_reason = _cuda_wanted()
        start = time.perf_counter()
        try:
            build(with_cuda, verbose)
        except Exception as exc:  # missing sources or compiler, a compile or load error: all mean fallback
            if verbose:
                print(exc, flush=True)
            lines = str(exc).strip().splitlines()
            return _fail(f"build failed: {type(exc).__name__}: {lines[-1] if lines else ''}", verbose)
        _register_python_side()
        _devices.add("cpu")
        if with_cuda:
            _devices.add("cuda")
        if verbose:
            print(f"detector.ops: sbnet kernels ready ({time.perf_counter() - start:.1f} s)", flush=True)
        return True


def has_kernels(device_type: str) -> bool:
    """Whether the compiled ops serve tensors on ``device_type`` ('cpu', 'cuda'); builds on first call."""
    load()
    return device_type in _devices


def unavailable_reason(device_type: str) -> str:
    """Why the compiled ops do not serve ``device_type`` (empty when they do)."""
    if device_type in _devices:
        return ""
    if _devices and device_type == "cuda":
        return f"extension built without CUDA: {_cuda_reason}"
    if _devices:
        return f"no sbnet kernels for device type {device_type!r}"
    return _reason
