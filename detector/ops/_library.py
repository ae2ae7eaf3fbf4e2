"""Build (JIT, cached) and load the sbnet kernels; register their fake and autograd formulas.

``load()`` (through :func:`build`) compiles ``kernels/ops.cpp`` (the ``TORCH_LIBRARY(sbnet, m)`` schemas) and
``kernels/cpu/*.cpp`` (OpenMP) with :func:`torch.utils.cpp_extension.load`, plus ``kernels/cuda/*.cu``
when ``torch.cuda.is_available()`` and nvcc (``CUDA_HOME``) is found, into a build folder that is kept
between runs (``build/sbnet_kernels/<variant>-torch<version>`` in a source checkout, the user cache for an
installed wheel, or under
``$DETECTOR_KERNELS_BUILD_DIR``); ninja
rebuilds only what changed. It then registers, once, a fake (meta) kernel and an autograd formula for
each op with :mod:`torch.library`. If no compiler is there or the build fails, the functional layer
warns once and the ops run the pure-PyTorch reference (see :mod:`detector.ops.functional`).

``import detector`` calls :func:`load_built`: the library is loaded if it is already built and up to date (no
compiling at import), so that ``torch.export.load`` finds the ops of a saved program.

``DETECTOR_NO_KERNELS=1`` skips the build (reference only). ``make kernels`` calls ``load(verbose=True)``.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

__all__ = ["load", "load_built", "build", "sources", "has_kernels", "unavailable_reason", "kernels_dir", "build_dir"]

_lock = threading.Lock()
_attempted = False
_devices: set[str] = set()  # device types the loaded extension serves
_reason = "not built yet"
_loaded: Path | None = None  # the shared library this process loaded (one sbnet library per process)
_cuda_reason = ""


def kernels_dir() -> Path:
    """The kernel sources: the repository's ``kernels/`` in a source checkout, else the copy an installed
    wheel holds as ``detector/_kernels`` (:func:`detector.resources.project_dir`)."""
    from detector.resources import project_dir

    return project_dir("kernels")


def build_dir(with_cuda: bool) -> Path:
    """Where the extension is built and cached (one sub-folder per CPU-only / CUDA variant):
    ``$DETECTOR_KERNELS_BUILD_DIR``, else ``build/sbnet_kernels`` in a source checkout, else (an installed
    wheel) the user cache, ``$XDG_CACHE_HOME/detector/sbnet_kernels`` (``~/.cache``)."""
    root = os.environ.get("DETECTOR_KERNELS_BUILD_DIR")
    src = kernels_dir()
    if root:
        base = Path(root)
    elif src.name == "kernels" and (src.parent / "pyproject.toml").is_file():
        base = src.parent / "build" / "sbnet_kernels"
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = Path(cache) / "detector" / "sbnet_kernels"
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
    from .formulas import memory_format_of, scatter_backward, tiles_of

    lib = torch.ops.sbnet

    def fmt(channels_last: bool) -> torch.memory_format:
        return torch.channels_last if channels_last else torch.contiguous_format

    @torch.library.register_fake("sbnet::reduce_mask")
    def _(mask, bsize, bstride, boffset, bcount, tol, avgpool):
        k = torch.library.get_ctx().new_dynamic_size()
        return mask.new_empty((k, 3), dtype=torch.int32)

    @torch.library.register_fake("sbnet::block_activity")
    def _(mask, bsize, bstride, boffset, bcount, tol, avgpool):
        return mask.new_empty((mask.shape[0], bcount[0], bcount[1]), dtype=torch.bool)

    # fakes allocate in the layout directly (a .contiguous(memory_format) of a tensor with a data-dependent K
    # may keep its strides under symbolic shapes, and the compiled graph would then expect the wrong layout)
    def empty(shape, like, f):
        return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=f)

    @torch.library.register_fake("sbnet::sparse_gather")
    def _(x, indices, bsize, bstride, boffset):
        f = memory_format_of(x) or torch.contiguous_format
        return empty((indices.shape[0], x.shape[1], bsize[0], bsize[1]), x, f)

    @torch.library.register_fake("sbnet::sparse_gather_backward")
    def _(grad_blocks, indices, input_size, bstride, boffset, channels_last=False):
        return empty(input_size, grad_blocks, fmt(channels_last))

    @torch.library.register_fake("sbnet::sparse_gather_backward_")
    def _(grad_blocks, indices, grad_x, bstride, boffset):
        return None

    @torch.library.register_fake("sbnet::sparse_scatter")
    def _(blocks, indices, base, bstride, boffset, add, relu=False):
        return torch.empty_like(base, memory_format=memory_format_of(base) or torch.contiguous_format)

    @torch.library.register_fake("sbnet::sparse_scatter_")
    def _(blocks, indices, base, bstride, boffset, add, relu=False):
        return None

    @torch.library.register_fake("sbnet::sparse_scatter_backward")
    def _(grad_out, indices, out_tiles, tile, bstride, boffset, add, relu, need_blocks, need_base):
        f = memory_format_of(grad_out) or torch.contiguous_format
        blocks = empty((indices.shape[0], grad_out.shape[1], tile[0], tile[1]), grad_out, f)
        return blocks, torch.empty_like(grad_out, memory_format=f)

    @torch.library.register_fake("sbnet::region_sums")
    def _(a, b, center, offset, size, pixels):
        return a.new_empty((2, a.shape[1]), dtype=torch.float64)

    @torch.library.register_fake("sbnet::region_norm_grad")
    def _(g, z, scale, c0, c1, offset, size, pixels):
        return empty(z.shape, z, memory_format_of(z) or torch.contiguous_format)

    # gather: its gradient is a scatter-add (overlapping halos add up) into zeros like x, in x's layout.
    def gather_setup(ctx, inputs, output):
        x, indices, bsize, bstride, boffset = inputs
        ctx.save_for_backward(indices)
        ctx.geometry = (list(x.shape), list(bstride), list(boffset), memory_format_of(x) == torch.channels_last)

    def gather_backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        input_size, bstride, boffset, channels_last = ctx.geometry
        g = grad.contiguous(memory_format=fmt(channels_last))
        gx = lib.sparse_gather_backward(g, indices, input_size, bstride, boffset, channels_last)
        return gx, None, None, None, None

    torch.library.register_autograd("sbnet::sparse_gather", gather_backward, setup_context=gather_setup)

    # gather_backward is linear in grad_blocks; its adjoint is the gather (double backward).
    def gather_bw_setup(ctx, inputs, output):
        grad_blocks, indices, input_size, bstride, boffset, *_ = inputs
        ctx.save_for_backward(indices)
        ctx.geometry = (list(grad_blocks.shape[2:]), list(bstride), list(boffset))

    def gather_bw_backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        bsize, bstride, boffset = ctx.geometry
        g = grad.contiguous(memory_format=memory_format_of(grad) or torch.contiguous_format)
        return lib.sparse_gather(g, indices, bsize, bstride, boffset), None, None, None, None, None

    torch.library.register_autograd(
        "sbnet::sparse_gather_backward", gather_bw_backward, setup_context=gather_bw_setup
    )

    # scatter: grad wrt blocks = grad_out at the tiles (times relu's on-mask); wrt base = grad_out with the
    # tiles replaced (0 when written; masked by relu when added). relu's mask comes from the output tiles.
    def scatter_setup(ctx, inputs, output):
        blocks, indices, base, bstride, boffset, add, *rest = inputs
        relu = bool(rest[0]) if rest else False
        tile = tuple(blocks.shape[2:])
        ctx.save_for_backward(indices, tiles_of(output, indices, tile) if relu else None)
        ctx.args = (tile, bool(add), relu, memory_format_of(output) or torch.contiguous_format)

    def scatter_backward_formula(ctx, grad):
        indices, out_tiles = ctx.saved_tensors
        tile, add, relu, f = ctx.args
        gb, gbase = scatter_backward(
            grad, indices, out_tiles, tile, add, relu, ctx.needs_input_grad[0], ctx.needs_input_grad[2], f
        )
        return gb, None, gbase, None, None, None, None

    torch.library.register_autograd(
        "sbnet::sparse_scatter", scatter_backward_formula, setup_context=scatter_setup
    )

    # scatter's adjoint is linear in grad_out (relu's on-mask is constant): grad_blocks = on * (grad_out at
    # the tiles), whose adjoint writes on * gg into zeros at the tiles; grad_base = grad_out with the tiles
    # masked, a diagonal map and so its own adjoint (double backward).
    def scatter_bw_setup(ctx, inputs, output):
        grad_out, indices, out_tiles, tile, bstride, boffset, add, relu, need_blocks, need_base = inputs
        ctx.save_for_backward(indices, out_tiles)
        ctx.args = (list(tile), list(bstride), list(boffset), add, relu, need_blocks, need_base, grad_out.shape,
                    memory_format_of(grad_out) or torch.contiguous_format)

    def scatter_bw_backward(ctx, gg_blocks, gg_base):
        indices, out_tiles = ctx.saved_tensors
        tile, bstride, boffset, add, relu, need_blocks, need_base, shape, f = ctx.args
        out = None
        if need_blocks and gg_blocks is not None:
            g = gg_blocks.contiguous(memory_format=f)
            if relu:
                g = g * (out_tiles > 0).to(g.dtype)
            zeros = torch.empty(shape, dtype=g.dtype, device=g.device, memory_format=f).zero_()
            out = lib.sparse_scatter(g, indices, zeros, bstride, boffset, False)
        if need_base and gg_base is not None:
            masked = gg_base if add and not relu else lib.sparse_scatter_backward(
                gg_base.contiguous(memory_format=f), indices, out_tiles, tile, bstride, boffset, add, relu, False, True
            )[1]
            out = masked if out is None else out + masked
        return out, None, None, None, None, None, None, None, None, None

    torch.library.register_autograd(
        "sbnet::sparse_scatter_backward", scatter_bw_backward, setup_context=scatter_bw_setup
    )


def _stale(library: Path, src: Path, with_cuda: bool) -> bool:
    """Whether the cached library is missing or older than a kernel source of its variant (the CPU-only
    library does not depend on cuda/ and emulate/: an edit there leaves it up to date, and ninja would not
    relink it). Decides whether ``import detector`` loads it (:func:`load_built`); :func:`load` leaves the
    rebuild to torch's loader."""
    if not library.exists():
        return True
    skip = set() if with_cuda else {"cuda", "emulate"}
    newest = max(p.stat().st_mtime for p in src.rglob("*")
                 if p.suffix in (".cpp", ".cu", ".h", ".cuh") and not skip & set(p.relative_to(src).parts[:-1]))
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
    if _stale(out / f"{name}.so", src, with_cuda):
        print(f"detector.ops: building sbnet kernels ({variant}) in {out} (first use: about a minute on CPU, "
              "several with CUDA)", flush=True)
    elif verbose:
        print(f"detector.ops: sbnet kernels ({variant}) cached in {out}; checking they are up to date",
              flush=True)
    library = out / f"{name}.so"
    if _loaded is not None and _loaded != library:
        # the other variant is loaded here (import detector) and a second TORCH_LIBRARY(sbnet) cannot load: compile
        # this one in a child process that loads none at import (make kernels-cuda on a machine without a GPU)
        code = f"from detector.ops import _library; _library.build(with_cuda={with_cuda}, verbose={verbose})"
        env = dict(os.environ, DETECTOR_NO_KERNELS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        return library
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
    return library


def load(verbose: bool = False) -> bool:
    """Build (if needed) and load the extension; True when the compiled ops are available.

    Safe to call many times: the first call does the work, later ones return its outcome. On failure
    records the reason (printed when ``verbose``; :func:`unavailable_reason` tells it, and the
    functional layer warns once with it).
    """
    global _attempted, _cuda_reason, _loaded
    if _devices:  # loaded: no lock (torch.compile cannot trace one)
        return True
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
            library = build(with_cuda, verbose)
        except Exception as exc:  # missing sources or compiler, a compile or load error: all mean fallback
            if verbose:
                print(exc, flush=True)
            lines = str(exc).strip().splitlines()
            return _fail(f"build failed: {type(exc).__name__}: {lines[-1] if lines else ''}", verbose)
        _register_python_side()
        _loaded = library
        _devices.add("cpu")
        if with_cuda:
            _devices.add("cuda")
        if verbose:
            print(f"detector.ops: sbnet kernels ready ({time.perf_counter() - start:.1f} s)", flush=True)
        return True


def load_built() -> bool:
    """Load the extension if it is already built and up to date, without compiling or running ninja; True when
    the compiled ops are available afterwards. ``import detector`` calls it, so that a saved ``.pt2`` program
    (which calls ``torch.ops.sbnet.*``) loads with ``torch.export.load`` in a fresh interpreter. A missing or
    stale build is left to :func:`load` (first use of the ops, ``make kernels``): importing never compiles."""
    global _attempted, _cuda_reason, _loaded
    if _devices:
        return True
    if os.environ.get("DETECTOR_NO_KERNELS", "") not in ("", "0"):
        return False
    with_cuda, cuda_reason = _cuda_wanted()
    library = build_dir(with_cuda) / f"sbnet_kernels_{'cuda' if with_cuda else 'cpu'}.so"
    with _lock:
        if _devices or _attempted:
            return bool(_devices)
        try:
            if _stale(library, kernels_dir(), with_cuda):
                return False
            torch.ops.load_library(str(library))
        except (OSError, RuntimeError, ValueError):  # unreadable sources, a library that does not load: load() decides
            return False
        _register_python_side()
        _attempted, _cuda_reason, _loaded = True, cuda_reason, library
        _devices.add("cpu")
        if with_cuda:
            _devices.add("cuda")
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
