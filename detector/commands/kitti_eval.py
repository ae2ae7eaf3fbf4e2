"""Evaluate result files against label files: KITTI's AP (R40 and R11) for 2D / BEV / 3D and AOS, easy / moderate /
hard, and AP by distance; or, for the LiDAR-only layout, BEV and 3D AP overall and by distance band.

    detector-kitti-eval gt=LABEL_DIR results=RESULT_DIR [split=FILE] [out=PATH]
                        [classes=Car,Pedestrian,Cyclist] [iou=CLASS:IOU,...] [distance=true] [layout=auto]
    (or: python scripts/kitti_eval.py ...)

LABEL_DIR holds label files ({id}.txt), RESULT_DIR result files (the same plus a score), in one of two layouts
(layout=auto tells them apart by the field count of their first line; kitti or lidar chooses):
    kitti   15 fields a label line, a 16th the score (KITTI's format; evaluate.py's eval/label_2 and eval/data on a
            KITTI root)
    lidar   x y z dx dy dz heading class, a ninth field the score (a LiDAR-only root's evaluation folders:
            docs/custom-data.md); scored as evaluation scores them (detector/eval/lidar_metric.py, rule L1-L4)
split: an ImageSets file of the frame ids to evaluate (default: every label file). A labeled frame without a result
file counts as a frame without detections (warning with the count); a result file without a label file is an error.
classes: the classes scored. iou: a class's minimum IoU for a match, e.g. iou=Car:0.7,Truck:0.7 (KITTI layout:
Car 0.7, Pedestrian 0.5, Cyclist 0.5 unless given, another class scored only with one; LiDAR-only: the defaults of
configs/data/lidar.yaml's data.classes). out: write the APs as JSON ({"Car": {"2d": {"R40": {"easy": .., "moderate":
.., "hard": ..}, "R11": {..}}, "bev": .., "3d": .., "aos": ..}, ..., "distance": {...}}, AP in percent; LiDAR-only:
"bev" and "3d", level "overall"). Exit status 1 with one message on bad input.

The KITTI rules are the official devkit's (every field read as float64, a GT counted only above the minimum 2D
height, scores at or below -1e7 never assigned, ...): detector/eval/protocol.py states each of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detector.cli import parse_args
from detector.errors import ConfigError, KittiFormatError
from detector.eval.kitti_files import LAYOUTS, detect_layout, load_eval_inputs
from detector.eval.kitti_metric import evaluate
from detector.eval.protocol import DISTANCE_RANGES, EVAL_CLASSES, MIN_OVERLAP
from detector.outputs import writable_file

USAGE = __doc__


def parse_iou(text: str) -> dict[str, float]:
    """``Car:0.7,Truck:0.7`` as {class: minimum IoU}; a malformed pair or a value outside [0, 1) is a
    :class:`ConfigError` naming ``iou=``."""
    out = {}
    for pair in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = pair.partition(":")
        try:
            iou = float(value)
        except ValueError:
            iou = None
        if not sep or not name.strip() or iou is None:
            raise ConfigError(f"iou={text!r}: expected CLASS:IOU pairs separated by commas, e.g. iou=Car:0.7,Truck:0.7")
        if not 0 <= iou < 1:
            raise ConfigError(f"iou={text!r}: the minimum IoU of {name.strip()} must be in [0, 1), got {iou}")
        out[name.strip()] = iou
    return out


def lidar_default_ious() -> dict[str, float]:
    """The minimum IoU per class of a LiDAR-only dataset (``data.classes`` of configs/data/lidar.yaml)."""
    from omegaconf import OmegaConf

    from detector.resources import config_dir

    return {str(k): float(v) for k, v in OmegaConf.load(config_dir() / "data" / "lidar.yaml").classes.items()}


def min_overlaps(layout: str, classes: tuple[str, ...], iou: dict[str, float]) -> dict[str, float]:
    """The minimum IoU of each class scored: ``iou`` over the layout's defaults (KITTI's three; LiDAR-only:
    configs/data/lidar.yaml's ``data.classes``). A class without one is a :class:`ConfigError` saying how to give it."""
    defaults = lidar_default_ious() if layout == "lidar" else dict(MIN_OVERLAP)
    overlaps = {**defaults, **iou}
    missing = [c for c in classes if c not in overlaps]
    if missing:
        raise ConfigError(f"classes={','.join(classes)}: choose from {', '.join(defaults)}, or give another class its "
                          f"minimum IoU, e.g. iou={missing[0]}:0.7")
    return {c: overlaps[c] for c in classes}


def score(inputs, layout: str, overlaps: dict[str, float], distance: bool):
    """``(result, table text)`` of the paired frames for the classes of ``overlaps``: the KITTI metric, or the
    LiDAR-only one evaluation uses."""
    ranges = DISTANCE_RANGES if distance else None
    if layout == "lidar":
        from detector.eval.lidar_metric import evaluate_lidar, lidar_table

        result = evaluate_lidar(inputs.gt, inputs.dt, overlaps, distance_ranges=ranges)
        return result, lidar_table(result)
    result = evaluate(inputs.gt, inputs.dt, classes=tuple(overlaps), distance_ranges=ranges, min_overlap=overlaps)
    return result, result.table()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(
        argv,
        {
            "gt": None,
            "results": None,
            "split": None,
            "out": None,
            "classes": ",".join(EVAL_CLASSES),
            "iou": "",
            "distance": True,
            "layout": "auto",
        },
        USAGE,
    )
    for key in ("gt", "results"):
        if args[key] is None:
            print(f"error: {key}= is required (see --help)", file=sys.stderr)
            return 2
    classes = tuple(c.strip() for c in args["classes"].split(",") if c.strip())
    if not classes:
        print(f"error: classes={args['classes']!r}: name at least one class", file=sys.stderr)
        return 2
    if args["layout"] not in LAYOUTS:
        print(f"error: layout={args['layout']!r}: choose {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    try:
        layout = detect_layout(args["gt"], args["results"]) if args["layout"] == "auto" else args["layout"]
    except KittiFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        overlaps = min_overlaps(layout, classes, parse_iou(args["iou"]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args["out"]:  # checked before the evaluation, not after it
            writable_file(args["out"], "out")
        inputs = load_eval_inputs(args["gt"], args["results"], args["split"], layout)
        result, table = score(inputs, layout, overlaps, args["distance"])
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
    what = " (LiDAR-only layout: BEV and 3D AP, overall and by distance band from the sensor)" if layout == "lidar" \
        else ""
    print(f"Evaluated {len(inputs.frame_ids)} frames{what}.")
    print(table)
    if args["out"]:
        out = Path(args["out"])
        out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
