"""Export a trained checkpoint's inference network (BEV tensor [+ mask] -> heatmap + regression).

    detector-export ckpt_path=CKPT [format=torch|onnx] [out=PATH] [mask=input|net|none]
                    [batch=2] [active=0.3] [opset=18] [check=true]
    (or: python scripts/export.py ...)

format=torch: a torch.export program (.pt2) with the sbnet ops in the graph, dynamic batch and number of active
blocks; load it with torch.export.load(PATH) after import detector (which loads the built kernels: run
`make kernels` first, or torch's loader fails with an opaque "error when deserializing"), or
detector.export.load_program(PATH) (builds the kernels first if needed; when they cannot be loaded, one line naming
the file and `make kernels`). format=onnx: an ONNX model stock onnxruntime runs (the sbnet ops in standard
operators; pip install .[export]). mask: where the computation mask comes from - the checkpoint's choice by default
(input: a data mask is an input; net: the mask network is inside; none: dense). An ``auto`` execution plan is frozen
on the example input (batch frames, about `active` share of 16-px tiles active); check=true compares the export with
the eager model on that input. Exit status 1 with one message on bad input.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from detector.cli import parse_args
from detector.errors import CheckpointError, is_user_error, one_line

USAGE = __doc__


def run(args: dict) -> Path:
    from detector.build import load_detector
    from detector.errors import ConfigError
    from detector.export import (
        DeployNet,
        OnnxRunner,
        check_onnx_export,
        example_inputs,
        export_onnx,
        export_program,
        freeze_modes,
        mask_source,
    )
    from detector.outputs import writable_file

    if args["format"] not in ("torch", "onnx"):
        raise ConfigError(f"format={args['format']!r}: choose torch or onnx")
    if args["format"] == "onnx":  # before any work or folder: what the export needs
        check_onnx_export(int(args["opset"]))
    out = Path(args["out"] or Path(args["ckpt_path"]).with_suffix(".pt2" if args["format"] == "torch" else ".onnx"))
    if not Path(args["ckpt_path"]).is_file():
        raise CheckpointError(f"{args['ckpt_path']}: checkpoint not found")
    writable_file(out, "out")
    model, cfg = load_detector(args["ckpt_path"])
    model.eval()
    source = args["mask"] or mask_source(model, bool(cfg.model.sparse))
    bev, mask = example_inputs(model, int(args["batch"]), float(args["active"]))
    if source == "net":
        with torch.no_grad():
            mask = model.mask_net.computation_mask(model.mask_net(bev), bev.shape[-2:])
    modes = None if source == "none" else freeze_modes(model, bev, mask)
    net = DeployNet(model, source, modes)
    t0 = time.perf_counter()
    program = export_program(net, bev, mask)
    if args["format"] == "torch":
        torch.export.save(program, str(out))
        run_export = program.module()
    else:
        export_onnx(program, out, int(args["opset"]))
        run_export = OnnxRunner(out)
    print(f"exported {args['ckpt_path']} -> {out} ({args['format']}, mask {source}, plan {modes}) "
          f"in {time.perf_counter() - t0:.1f} s")
    if args["check"]:
        inputs = (bev, mask) if net.takes_mask else (bev,)
        with torch.no_grad():
            ref, got = net(*inputs), run_export(*inputs)
        err = max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True))
        print(f"max |export - eager| on the example input: {err:.2e}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, {"ckpt_path": None, "format": "torch", "out": None, "mask": None, "batch": 2,
                             "active": 0.3, "opset": 18, "check": True}, USAGE)
    if args["ckpt_path"] is None:
        print("error: ckpt_path= is required (see --help)", file=sys.stderr)
        return 1
    try:
        run(args)
    except Exception as e:
        if not is_user_error(e):
            raise
        print(one_line(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
