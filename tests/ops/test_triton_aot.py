"""The fused Triton kernels (detector.ops.triton_blocks) compiled ahead of time for the GPUs, without one: for sm_80
(A100) and sm_90 (H100, H200), the specializations the default GPU configurations launch, each compiled to PTX and a
cubin (triton's own ptxas) with no compile error and its shared memory within the device's limit per block.

The specializations are recorded, never listed by hand: the detector of each GPU configuration (``trainer=gpu`` on
the default model, and ``experiment=kitti_full``) is built from the real configs on a small grid, its capacity path
forced onto the kernels (``DETECTOR_FUSED=triton``), and every launch recorded and not run
(``triton_blocks.recording(run=False)``: what launches is what matters here; the kernels' values are
tests/ops/test_fused.py's), over the tiles the plan offers (``model.plan.candidates``), both layouts (channels-last,
the default, and NCHW), float32 (tf32 dots) and the trainer's autocast (``bf16-mixed``), an inference forward and a
training step (forward and backward: the dgrad and wgrad kernels). A constexpr the kernels gain is covered as soon
as the code launches it.

Each launch becomes a specialization as triton's JIT makes it on a GPU (its own binder: the pointers' element types
and 16-byte alignment, the ints it specializes - 1 and multiples of 16 -, the constexprs, the launch options),
compiled by ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``. The ints are the small grid's:
a specialization on a map size (``% 16``) follows the recorded values, which a bigger grid or batch may set
otherwise (the unit strides of a layout are the same on any grid).

Cost: a compile takes one to a few seconds of a CPU (ptxas included), and the full product of runs - every tile x
layout x dtype x step of both configurations - launches several hundred distinct specializations, so ``make test``
records each configuration at the six runs of a pairwise covering array (every pair of values of tile, step, layout
and dtype is in some run; the stages' third and later units, which repeat the second's launches, left out) and
compiles, per target, a covering subset of what they launch: every kernel's every constexpr value, pointer types,
unit-stride layout and (per pointer types) tile shape at least once. ``-m slow`` records the full product at the
configured depths and compiles every specialization for both targets. Triton's cache goes to a folder of the test,
never the user's home.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict

from detector.build import build_grid, build_model
from detector.data.structures import Batch
from detector.geometry.boxes import Boxes3D
from detector.ops import fused, triton_blocks
from tests.paths import CONFIGS

triton = pytest.importorskip("triton")
# triton 3.9 asks for TRITON_DEFAULT_FP_FUSION; unset, it compiles as a GPU user's JIT does (fusion on)
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")

# Dynamic shared memory one thread block may use (opt-in: the most a kernel can launch with), bytes: NVIDIA's CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability" (maximum amount of shared memory per thread
# block: 163 KB for 8.0, 227 KB for 9.0), as its tuning guides put it (Ampere: "the A100 GPU enables a single thread
# block to address up to 163 KB of shared memory"; Hopper: up to 227 KB on the H100) - the SM's 164 / 228 KB less
# the 1 KB the system reserves per block. Triton refuses a launch above the device's figure (OutOfResources).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}

# The GPU configurations: the default model under trainer=gpu, and the full-scale experiment (trainer=gpu itself).
GPU_CONFIGS = {"default": ["trainer=gpu"], "kitti_full": ["experiment=kitti_full"]}
GRID_CELLS = 32  # the test grid's side: a multiple of 32, as the configs' grids are
LAYOUTS = ("nhwc", "nchw")
STEPS = ("inference", "training")
# constexprs that only divide the program id (how the grid is cut): their values change a constant, not the code's
# shape, so the covering subset need not take each; the slow test compiles every one
GRID_CONSTEXPRS = ("M_TILES", "CI_TILES")


def _config(overrides: list[str]):  # noqa: ANN202
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=[*overrides, "mask=road_map"])  # the batch's mask: no mask net to train


def _inputs(grid) -> tuple[Batch, torch.Tensor]:  # noqa: ANN001
    """One frame: a random BEV input, a mask with active and inactive tiles at every level, one Car."""
    g = torch.Generator().manual_seed(0)
    bev = torch.rand(1, grid.C, grid.H, grid.W, generator=g)
    mask = torch.zeros(1, 1, grid.H, grid.W)
    mask[..., grid.H // 8 : grid.H // 2, grid.W // 4 : 3 * grid.W // 5] = 1.0
    x = (grid.x_range[0] + grid.x_range[1]) / 2
    boxes = [Boxes3D([[x, 0.0, -1.0, 4.0, 1.7, 1.5, 0.3]])]
    return Batch(torch.zeros(0, 5), boxes, [np.array(["Car"])], [None], mask), bev


def _pairwise(tiles: list[int]) -> list[tuple[int, str, str, int]]:
    """(tile, step, layout, dtype index) of the covering array: each tile's inference at one layout and dtype, its
    training step at the other layout and the other dtype; with three tiles or more every pair of values of the four
    is in some run."""
    runs = []
    for i, tile in enumerate(tiles):
        layout, dtype = i % 2, (i + i // 2) % 2
        runs += [(tile, "inference", LAYOUTS[layout], dtype), (tile, "training", LAYOUTS[1 - layout], 1 - dtype)]
    return runs


def _record(name: str, overrides: list[str], full: bool) -> Iterator[tuple[tuple, list[triton_blocks.Launch]]]:
    """(label, launches) of each run of one GPU configuration, label = (config, tile, layout, dtype, step): every
    combination (``full``) or the pairwise covering array's."""
    cfg = _config(overrides)
    precision = str(cfg.trainer.precision)
    autocast = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0])
    assert autocast is not None, f"trainer.precision={precision}: not a mixed precision this test knows"
    dtypes = (torch.float32, autocast)
    res = float(cfg.bev.resolution)
    with open_dict(cfg):
        cfg.bev.x_range = [0.0, GRID_CELLS * res]
        cfg.bev.y_range = [-GRID_CELLS * res / 2, GRID_CELLS * res / 2]
        if not full:
            cfg.model.backbone.stage_units = [min(int(u), 2) for u in cfg.model.backbone.stage_units]
    grid = build_grid(cfg.bev)
    batch, bev = _inputs(grid)
    tiles = [int(t) for t in cfg.model.plan.candidates]
    runs = ([(t, s, lay, d) for t in tiles for lay in LAYOUTS for d in range(2) for s in STEPS] if full
            else _pairwise(tiles))
    det, built = None, None
    for tile, step, layout, d in runs:
        if built != (tile, layout):
            with open_dict(cfg):
                cfg.model.block_size = cfg.model.head_block_size = tile
                cfg.model.backbone.channels_last = layout == "nhwc"
            torch.manual_seed(0)
            det, built = build_model(cfg.model, cfg.mask, grid), (tile, layout)
        amp = dict(device_type=bev.device.type, dtype=dtypes[d], enabled=d > 0)
        with triton_blocks.recording(run=False) as launches:
            if step == "inference":
                det.eval()
                with torch.no_grad(), torch.autocast(**amp):
                    det(batch, bev=bev)
            else:
                det.train()
                with torch.autocast(**amp):
                    out = det(batch, bev=bev, step=0)
                    loss, _ = det.loss(out, batch)
                loss.backward()
        yield (name, tile, layout, str(dtypes[d]).removeprefix("torch."), step), launches


def _recorded(full: bool) -> dict[tuple, list[triton_blocks.Launch]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DETECTOR_FUSED", "triton")
        mp.delenv("TRITON_INTERPRET", raising=False)
        # the first batch's comparison of the whole network on the kernels with the composition (fused.whole_check)
        # needs the kernels' values, which a recording does not compute: it is taken as passed (on a GPU it runs, and
        # its launches are the network's own), and nothing the recording's checks conclude outlives it
        mp.setattr(fused, "_WHOLE", {("cpu", d): True for d in (torch.float32, torch.bfloat16, torch.float16)})
        mp.setattr(fused, "_CHECKED", {})
        return {label: launches for name, ov in GPU_CONFIGS.items() for label, launches in _record(name, ov, full)}


@pytest.fixture(scope="module")
def pairwise() -> dict[tuple, list[triton_blocks.Launch]]:
    return _recorded(full=False)


@pytest.fixture(scope="module")
def full_product() -> dict[tuple, list[triton_blocks.Launch]]:
    return _recorded(full=True)


class Spec:
    """One launch as triton's JIT specializes it on a GPU of ``arch`` (``JITFunction.run`` up to its compile):
    ``key`` equal for launches that compile to the same code."""

    def __init__(self, launch: triton_blocks.Launch, jit, binder, backend) -> None:  # noqa: ANN001
        self.launch, self.jit = launch, jit
        kwargs = dict(launch.kwargs)
        bound, specialization, options = binder(*launch.args, **kwargs)
        self.options, self.signature, self.constexprs, self.attrs = jit._pack_args(backend, kwargs, bound,
                                                                                   specialization, options)
        self.key = (launch.fn.__name__, str(specialization), str(sorted(self.options.__dict__.items())))

    def describe(self) -> str:
        types = [t for t in self.signature.values() if t.startswith("*")]
        ones = [self.jit.arg_names[k[0]] for k in self.constexprs if self.jit.arg_names[k[0]] not in self.launch.kwargs]
        return (f"{self.launch.fn.__name__}({', '.join(f'{k}={v}' for k, v in sorted(self.launch.kwargs.items()))}; "
                f"pointers {', '.join(types)}; = 1: {', '.join(ones)})")

    def features(self) -> set[tuple]:
        """What the covering subset must hold at least once, per kernel: each constexpr value (the grid's aside),
        the pointer types, the parameters specialized to 1 (a layout's unit strides) and, per pointer types, the
        tile shape (with the types, what the shared memory depends on)."""
        name, kw = self.launch.fn.__name__, self.launch.kwargs
        types = tuple(t for t in self.signature.values() if t.startswith("*"))
        ones = tuple(sorted(self.jit.arg_names[k[0]] for k in self.constexprs if self.jit.arg_names[k[0]] not in kw))
        tiles = tuple(sorted((k, v) for k, v in kw.items() if k.startswith("B") and k[1:] in ("M", "N", "K", "I")))
        return ({("types", name, types), ("ones", name, ones), ("tiles", name, types, tiles)}
                | {("constexpr", name, k, v) for k, v in kw.items() if k not in GRID_CONSTEXPRS})

    def compile(self, arch: int):  # noqa: ANN201
        src = triton.compiler.ASTSource(self.jit, self.signature, self.constexprs, self.attrs)
        return triton.compile(src, target=triton.backends.compiler.GPUTarget("cuda", arch, 32),
                              options=self.options.__dict__)


def specializations(recorded: dict, arch: int) -> dict[tuple, Spec]:
    """The distinct specializations of the recorded launches for ``arch``, by key."""
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(triton.backends.compiler.GPUTarget("cuda", arch, 32))
    jits, out = {}, {}
    for launches in recorded.values():
        for launch in launches:
            if launch.fn not in jits:
                jit = JITFunction(launch.fn)
                jits[launch.fn] = jit, create_function_from_signature(jit.signature, jit.params, backend)
            spec = Spec(launch, *jits[launch.fn], backend)
            out.setdefault(spec.key, spec)
    return out


def covering(specs: dict[tuple, Spec]) -> list[Spec]:
    """A few specializations that hold every feature (:meth:`Spec.features`) of ``specs`` (greedy set cover)."""
    feats = {k: s.features() for k, s in specs.items()}
    left, chosen = set().union(*feats.values()), []
    while left:
        best = max(feats, key=lambda k: len(feats[k] & left))
        chosen.append(specs[best])
        left -= feats[best]
    return chosen


def _compile_all(specs: list[Spec], arch: int, tmp_path, monkeypatch) -> dict[tuple, int]:  # noqa: ANN001
    """Compile each for ``arch``; assert no error and the shared memory within the device's; {key: shared bytes}."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_cache"))
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    failures, shared = [], {}
    for spec in specs:
        what = spec.describe()
        try:
            kernel = spec.compile(arch)
        except Exception as e:  # noqa: BLE001  (every failure is reported below, not the first only)
            failures.append(f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e) else ''}")
            continue
        if not kernel.asm.get("ptx") or not kernel.asm.get("cubin"):
            failures.append(f"{what}: no PTX or no cubin")
        shared[spec.key] = kernel.metadata.shared
        if kernel.metadata.shared > SHARED_LIMIT[arch]:
            failures.append(f"{what}: {kernel.metadata.shared} bytes of shared memory, sm_{arch} has "
                            f"{SHARED_LIMIT[arch]}")
    assert not failures, f"sm_{arch}:\n" + "\n".join(failures)
    return shared


def test_the_recording_is_not_vacuous(pairwise):
    """Every run launches the forward kernel, a training step the dgrad and wgrad kernels too; the autocast runs
    launch bfloat16 kernels, the float32 runs float32 ones with tf32 dots; the runs hold every pair of values of
    (tile, layout, dtype, step); each configuration, tile, layout and dtype brings specializations of its own."""
    tiles = [int(t) for t in _config([]).model.plan.candidates]
    assert len(pairwise) == 2 * len(tiles) * len(GPU_CONFIGS)
    for label, launches in pairwise.items():
        names = {la.fn.__name__ for la in launches}
        assert "_block_conv" in names, label
        assert ({"_dgrad", "_wgrad"} <= names) == (label[4] == "training"), (label, names)
        dtypes = {a.dtype for la in launches for a in la.args if isinstance(a, triton_blocks.Pointer)}
        if label[3] == "float32":
            assert torch.bfloat16 not in dtypes and all(la.kwargs["PREC"] == "tf32" for la in launches), label
        else:
            assert torch.bfloat16 in dtypes and torch.float32 in dtypes, label  # the opmath parts stay float32
    for name in GPU_CONFIGS:
        runs = [lb[1:] for lb in pairwise if lb[0] == name]
        for i, j in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)):
            want = {(a, b) for a in {r[i] for r in runs} for b in {r[j] for r in runs}}
            assert {(r[i], r[j]) for r in runs} == want, (name, i, j)
    for axis, values in ((0, list(GPU_CONFIGS)), (1, tiles), (2, LAYOUTS), (3, ("float32", "bfloat16"))):
        own = [set(specializations({lb: la for lb, la in pairwise.items() if lb[axis] == v}, 90)) for v in values]
        for i, keys in enumerate(own):
            assert keys - set().union(*own[:i], *own[i + 1:]), f"{values[i]!r} adds no specialization of its own"


@pytest.mark.parametrize("arch", sorted(SHARED_LIMIT))
def test_a_covering_subset_compiles(pairwise, arch, tmp_path, monkeypatch):
    """Every constexpr value, pointer types, layout and tile shape of each kernel that the pairwise runs launch,
    compiled for the architecture (PTX and cubin) within its shared memory."""
    specs = specializations(pairwise, arch)
    subset = covering(specs)
    assert {s.launch.fn.__name__ for s in subset} == {s.launch.fn.__name__ for s in specs.values()}
    assert len(subset) < len(specs) / 4  # what keeps make test's time: a few dozen compiles, not hundreds
    _compile_all(subset, arch, tmp_path, monkeypatch)


@pytest.mark.slow  # several hundred specializations per target, one to a few seconds each: tens of minutes
@pytest.mark.parametrize("arch", sorted(SHARED_LIMIT))
def test_every_specialization_compiles(full_product, pairwise, arch, tmp_path, monkeypatch):
    """Every specialization of every run of the GPU configurations, compiled for the architecture; the pairwise
    runs at the configured depths launch what they launch with the stages' later units left out."""
    specs = specializations(full_product, arch)
    same_runs = {label: launches for label, launches in full_product.items() if label in pairwise}
    assert set(specializations(same_runs, arch)) == set(specializations(pairwise, arch))
    _compile_all(list(specs.values()), arch, tmp_path, monkeypatch)
