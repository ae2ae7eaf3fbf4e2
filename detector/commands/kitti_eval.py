"""Evaluate KITTI result files against KITTI label files: AP (R40 and R11) for 2D / BEV / 3D and AOS,
easy / moderate / hard, and AP by distance.

    detector-kitti-eval gt=LABEL_DIR results=RESULT_DIR [split=FILE] [out=PATH]
                        [classes=Car,Pedestrian,Cyclist] [distance=true]
    (or: python scripts/kitti_eval.py ...)

LABEL_DIR holds label files ({id}.txt, 15 fields per line); RESULT_DIR result files (the same plus a
16th field, the score). split: an ImageSets file of the frame ids to evaluate (default: every label
file). A labeled frame without a result file counts as a frame without detections (warning with the
count); a result file without a label file is an error. out: write the APs as JSON
({"Car": {"2d": {"R40": {"easy": .., "moderate": .., "hard": ..}, "R11": {..}}, "bev": .., "3d": ..,
"aos": ..}, ..., "distance": {...}}, AP in percent). Exit status 1 with one message on bad input.

The rules are the official devkit's (every field read as float64, a GT counted only above the minimum
2D height, scores at or below -1e7 never assigned, ...): detector/eval/protocol.py states each of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detector.cli import parse_args
from detector.errors import ConfigError, KittiFormatError
from detector.eval.kitti_files import load_eval_inputs
from detector.eval.kitti_metric import evaluate
from detector.eval.protocol import DISTANCE_RANGES, EVAL_CLASSES
from detector.outputs import writable_file

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    args = parse_args(
        argv,
        {
            "gt": None,
            "results": None,
            "split": None,
            "out": None,
            "classes": ",".join(EVAL_CLASSES),
            "distance": True,
        },
        USAGE,
    )
    for key in ("gt", "results"):
        if args[key] is None:
            print(f"error: {key}= is required (see --help)", file=sys.stderr)
            return 2
    classes = tuple(c.strip() for c in args["classes"].split(",") if c.strip())
    unknown = [c for c in classes if c not in EVAL_CLASSES]
    if unknown or not classes:
        print(f"error: classes={args['classes']!r}: choose from {', '.join(EVAL_CLASSES)}", file=sys.stderr)
        return 2
    try:
        if args["out"]:  # checked before the evaluation, not after it
            writable_file(args["out"], "out")
        inputs = load_eval_inputs(args["gt"], args["results"], args["split"])
        ranges = DISTANCE_RANGES if args["distance"] else None
        result = evaluate(inputs.gt, inputs.dt, classes=classes, distance_ranges=ranges)
    except (KittiFormatError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if inputs.missing_results:
        ids = inputs.missing_results
        shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
        print(
            f"warning: {len(ids)} of {len(inputs.frame_ids)} frames have no result file and count as frames "
            f"without detections ({shown})",
            file=sys.stderr,
        )
    if inputs.unused_results:
        n = len(inputs.unused_results)
        print(f"note: {n} result files are not in the split and were not used", file=sys.stderr)
    print(f"Evaluated {len(inputs.frame_ids)} frames.")
    print(result.table())
    if args["out"]:
        out = Path(args["out"])
        out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
