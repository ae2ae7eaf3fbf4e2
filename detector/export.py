"""Export the detector's inference network: a ``torch.export`` program (``.pt2``) and an ONNX model.

:class:`DeployNet` is what is exported: BEV tensor ``[B, C, H, W]`` (+ the computation mask ``[B, 1, H, W]``
when the mask comes from the data) -> heatmap logits and regression, through the detector's own
:meth:`~detector.models.detector.BevDetector.capacity_maps` (the sbnet ops in the graph) on lists of exactly
the active blocks, with the execution plan frozen at export (``block_size=auto`` is planned once on the example
input). The batch size and the number of active blocks are dynamic; the BEV grid is fixed. Decoding (top-k, NMS)
stays in Python.

- ``.pt2``: :func:`export_program`; ``torch.export.load`` loads it after ``import detector`` (which loads the
  built sbnet kernels: the program calls ``torch.ops.sbnet.*``; run ``make kernels`` first, or torch's loader
  fails with an opaque "error when deserializing"); :func:`load_program` builds them first if needed and, when
  they cannot be loaded, says so in one line naming the file and ``make kernels``.
- ONNX: :func:`export_onnx` converts the program with :mod:`detector.ops.onnx`'s translations of the sbnet
  ops into standard operators (stock onnxruntime runs it; ``pip install .[export]``).

Mask sources: ``input`` (a data-side mask: road map, ground), ``net`` (the mask network inside the program),
``none`` (dense: the same weights on the whole grid).
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from detector.errors import CheckpointError, ConfigError
from detector.models.detector import BevDetector, DetectorOutput, masks_at_strides
from detector.nn.plan import AUTO

__all__ = ["DeployNet", "mask_source", "example_inputs", "freeze_modes", "export_program", "compile_net",
           "graph_breaks", "load_program", "program_sbnet_ops", "missing_sbnet_ops", "export_onnx", "OnnxRunner",
           "program_forward"]

SOURCES = ("input", "net", "none")


def mask_source(model: BevDetector, sparse: bool) -> str:
    """Where the exported network's computation mask comes from, as the detector's forward decides it."""
    if not sparse:
        return "none"
    return "net" if model.mask_net is not None else "input"


class DeployNet(nn.Module):
    """``forward(bev[, mask]) -> (heatmap, regression)``: the detector's inference maps, plan frozen."""

    def __init__(self, model: BevDetector, source: str, modes: Sequence[int | str] | None) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"DeployNet: mask source must be one of {SOURCES}, got {source!r}")
        if source == "net" and model.mask_net is None:
            raise ConfigError("export: mask source 'net' needs a checkpoint trained with a mask net")
        if source != "none" and (modes is None or AUTO in modes):
            raise ValueError("DeployNet: a sparse network needs the execution modes frozen (no 'auto')")
        self.model = model.eval()
        self.source = source
        self.modes = list(modes) if modes is not None else None

    def forward(self, bev: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        if self.source == "none":
            return m.head(m.neck(m.backbone(bev)))
        if self.source == "net":
            mask = m.mask_net.computation_mask(m.mask_net(bev), bev.shape[-2:])
        mask = mask.to(bev.dtype)
        heat, reg, _, _ = m.capacity_maps(bev, mask, masks_at_strides(mask, m.neck.strides), self.modes,
                                          [None] * len(self.modes))  # lists of the active blocks: a dynamic count
        return heat, reg

    @property
    def takes_mask(self) -> bool:
        return self.source == "input"


def example_inputs(model: BevDetector, batch: int = 2, active: float = 0.3, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A BEV tensor (sparse occupancy-like values) and a mask of about ``active`` share of 16-px tiles."""
    g = torch.Generator().manual_seed(seed)
    bev = (torch.rand(batch, model.grid.C, model.grid.H, model.grid.W, generator=g) > 0.9).float()
    coarse = (torch.rand(batch, 1, -(-model.grid.H // 16), -(-model.grid.W // 16), generator=g) < active).float()
    mask = coarse.repeat_interleave(16, 2).repeat_interleave(16, 3)[:, :, : model.grid.H, : model.grid.W]
    return bev, mask.contiguous()


def freeze_modes(model: BevDetector, bev: torch.Tensor, mask: torch.Tensor) -> list[int | str]:
    """The execution modes (tile or dense per sparse stage); an ``auto`` setting is planned on this input."""
    with torch.no_grad():
        modes, _, _ = model.capacity_plan(tuple(bev.shape), mask, masks_at_strides(mask, model.neck.strides))
    return list(modes)


def _kernels() -> None:
    from detector.ops import _library

    if not _library.load():
        raise RuntimeError(f"export: the sbnet kernels are needed ({_library.unavailable_reason('cpu')})")


def export_program(net: DeployNet, bev: torch.Tensor, mask: torch.Tensor | None,
                   max_batch: int = 256) -> torch.export.ExportedProgram:
    """``torch.export`` of ``net`` on the example input; dynamic batch (1 ... ``max_batch``) and K."""
    _kernels()
    if bev.shape[0] < 2:  # an example of batch 1 would specialize the program to batch 1
        bev, mask = bev.repeat(2, 1, 1, 1), None if mask is None else mask.repeat(2, 1, 1, 1)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    args = (bev, mask) if net.takes_mask else (bev,)
    dims = ({0: batch}, {0: batch}) if net.takes_mask else ({0: batch},)
    with torch.no_grad():  # a no_grad region inside would otherwise become a wrapper the loader refuses
        return torch.export.export(net, args, dynamic_shapes=dims)


def compile_net(net: nn.Module, **kwargs) -> Callable:
    """``torch.compile(net)``: the block counts (reduce_mask's K, the level masks' ``nonzero``) are data-dependent
    shapes, captured in the graph (``capture_dynamic_output_shape_ops``, set here) instead of breaking it.

    A sparse network (any :class:`DeployNet` but the dense one, or another module) is compiled with inductor's
    ``layout_optimization`` off. On the CPU inductor forces channels-last inputs on every convolution and takes
    the output's strides from the fake convolution, but torch's fake convolution returns NCHW strides when a size
    is unbacked (``torch._subclasses.fake_impls.conv``: no hint, no memory-format choice), while the real oneDNN
    convolution of channels-last blocks ``[K, C, bh, bw]`` returns channels-last: the compiled graph then fails its
    stride assertion (it would read the blocks in the wrong layout without it). Without the layout optimization
    inductor gives every convolution the input layout the fake one predicts, which the real one then returns
    (the maps stay channels-last: the backbone makes them so; the block convolutions run on NCHW copies). The
    minimal case without our ops: ``conv2d(x[m.nonzero()[:, 0]].contiguous(memory_format=channels_last), w)``."""
    _kernels()
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    dense = isinstance(net, DeployNet) and net.source == "none"
    if kwargs.get("backend", "inductor") == "inductor" and not dense:
        kwargs["options"] = {"layout_optimization": False, **(kwargs.get("options") or {})}
    return torch.compile(net, **kwargs)


def graph_breaks(net: nn.Module, *inputs: torch.Tensor) -> tuple[int, int, list[str]]:
    """``torch._dynamo.explain`` of ``net`` on ``inputs`` (no grad) as :func:`compile_net` traces it: graphs,
    graph breaks and their reasons."""
    _kernels()
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    with torch.no_grad():
        ex = torch._dynamo.explain(net)(*inputs)
    return ex.graph_count, ex.graph_break_count, [b.reason for b in ex.break_reasons]


def program_sbnet_ops(path: str | Path) -> set[str]:
    """The sbnet ops (``torch.ops.sbnet.<name>``) that a saved ``.pt2`` program calls, read from the serialized
    graphs in its archive (nothing is deserialized)."""
    names: set[str] = set()
    with zipfile.ZipFile(path) as archive:
        for entry in archive.namelist():
            if entry.endswith(".json"):
                names.update(m.decode() for m in re.findall(rb'"torch\.ops\.sbnet\.(\w+)\.', archive.read(entry)))
    return names


def missing_sbnet_ops(names: Iterable[str]) -> list[str]:
    """Those of ``names`` that are not registered as ``torch.ops.sbnet.<name>`` in this process (the kernels'
    library, which defines their schemas, is not loaded)."""
    return sorted(n for n in set(names) if not hasattr(torch.ops.sbnet, n))


def load_program(path: str | Path) -> torch.export.ExportedProgram:
    """A saved ``.pt2`` program. The sbnet ops it calls are checked first (the kernels are built and loaded if
    needed): without them torch's loader fails with an opaque "error when deserializing"; here a
    :class:`~detector.errors.CheckpointError` names the file, the missing ops and the fix (``make kernels``)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such .pt2 program")
    try:
        needed = program_sbnet_ops(path)
    except zipfile.BadZipFile:
        raise CheckpointError(f"{path}: not a .pt2 program (torch.export.save writes a zip archive)") from None
    if needed and missing_sbnet_ops(needed):
        from detector.ops import _library

        _library.load()
        missing = missing_sbnet_ops(needed)
        if missing:
            reason = _library.unavailable_reason("cpu")
            raise CheckpointError(
                f"{path}: the program calls sbnet ops that are not registered ({', '.join(missing)}"
                + (f"; {reason}" if reason else "") + "): run `make kernels` first, then load it again "
                "(`import detector` loads the built kernels)")
    return torch.export.load(str(path))


def check_onnx_export(opset: int) -> None:
    """What an ONNX export needs, checked before any work: an opset the sbnet translations support, and the onnx
    and onnxscript packages. Raises :class:`ConfigError`."""
    from detector.ops import onnx as sbnet_onnx

    if opset < sbnet_onnx.MIN_OPSET:
        raise ConfigError(f"export: ONNX opset {opset} is too old; the sbnet translations need opset >= "
                          f"{sbnet_onnx.MIN_OPSET}")
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        raise ConfigError("export: format=onnx needs onnx and onnxscript (pip install .[export])") from None


def export_onnx(program: torch.export.ExportedProgram, out: str | Path, opset: int = 18) -> Path:
    """The program as an ONNX model (the sbnet ops in standard operators, :mod:`detector.ops.onnx`)."""
    from detector.ops import onnx as sbnet_onnx

    check_onnx_export(opset)
    onnx_program = torch.onnx.export(program, dynamo=True, custom_translation_table=sbnet_onnx.table(),
                                     opset_version=opset, verbose=False)
    out = Path(out)
    onnx_program.save(str(out))
    return out


class OnnxRunner:
    """An ONNX model on onnxruntime's CPU provider: ``runner(bev[, mask]) -> (heatmap, regression)``."""

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError("onnxruntime is not installed (pip install .[export])") from None
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.path = Path(path)
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def __call__(self, bev: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        feeds = {self.names[0]: bev.detach().cpu().contiguous().numpy()}  # onnxruntime reads C-order arrays
        if len(self.names) > 1:
            feeds[self.names[1]] = mask.detach().cpu().to(bev.dtype).numpy()
        heat, reg = self.session.run(None, feeds)
        return torch.from_numpy(heat), torch.from_numpy(reg)


def program_forward(model: BevDetector, run: Callable[..., tuple[torch.Tensor, torch.Tensor]], source: str
                    ) -> Callable:
    """A stand-in for ``model(batch)`` in evaluation that runs ``run`` (a program or an ONNX session) on the
    batch's BEV tensor and mask: the same :class:`DetectorOutput` for decoding, with the computation mask used (a
    program that predicts its own, source ``net``: the model's mask net gives the same one, for the sparsity)."""

    def forward(batch) -> DetectorOutput:
        bev = model.voxelize(batch)
        mask = None
        if source == "input":
            mask = batch.mask.to(bev) if batch.mask is not None else torch.ones_like(bev[:, :1])
        heat, reg = run(bev, mask) if mask is not None else run(bev)
        if source == "net":
            mask = model.mask_net.computation_mask(model.mask_net(bev), bev.shape[-2:])
        sparsity = 0.0 if mask is None else float(1.0 - mask.mean())
        return DetectorOutput(heat.to(bev.device), reg.to(bev.device), mask, None, sparsity)

    return forward


def exported_forward(model: BevDetector, sparse: bool, backend: str, out_dir: str | Path) -> Callable:
    """``model(batch)`` for evaluation with ``backend`` ``export`` (a ``.pt2`` program) or ``onnx`` (onnxruntime):
    the model is exported into ``out_dir`` first (plan frozen on the example input), then each batch runs
    through the exported network; decoding stays the model's."""
    if backend not in ("export", "onnx"):
        raise ConfigError(f"backend={backend!r}: choose eager, export or onnx")
    model = model.cpu().eval()
    source = mask_source(model, sparse)
    bev, mask = example_inputs(model)
    if source == "net":
        with torch.no_grad():
            mask = model.mask_net.computation_mask(model.mask_net(bev), bev.shape[-2:])
    net = DeployNet(model, source, None if source == "none" else freeze_modes(model, bev, mask))
    program = export_program(net, bev, mask)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if backend == "export":
        torch.export.save(program, str(out_dir / "model.pt2"))
        run = load_program(out_dir / "model.pt2").module()
    else:
        run = OnnxRunner(export_onnx(program, out_dir / "model.onnx"))
    print(f"evaluating through the {backend} backend ({out_dir}; mask {source}, plan {net.modes})")

    def no_grad_run(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return run(*inputs)

    return program_forward(model, no_grad_run, source)
