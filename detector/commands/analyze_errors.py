"""Which errors dominate an evaluation: each false positive and each missed object classified (missed, found but
loose, duplicate, loose, mislocated, other class, background), by distance band, with pictures of the worst.

    detector-analyze-errors run=EVAL_DIR [root=DATASET_ROOT] [score_threshold=0.3] [out=DIR]
                            [classes=Car,...] [iou=CLASS:IOU,...] [level=auto] [pictures=6]
    detector-analyze-errors gt=LABEL_DIR results=RESULT_DIR [...]
    (or: python scripts/analyze_errors.py ...)

run: the folder scripts/evaluate.py wrote (its ``label_2/``: the ground truth scored, ``data/``: the detections;
``metrics.json``) - or gt= and results= as for scripts/kitti_eval.py. Both layouts, told apart as kitti_eval tells
them (KITTI: 15/16 fields a line, camera frame; LiDAR-only: x y z dx dy dz heading class [score], LiDAR frame).
score_threshold: the detections that count (those scored at least it; the files hold every box decoded, e.g. at
>= 0.1). classes: the classes analysed (default: those the evaluation scored, from RUN/metrics.json; else those of
the layout's scored classes - Car, Pedestrian, Cyclist; LiDAR-only: configs/data/lidar.yaml's data.classes - that the
result files name); iou: a class's minimum BEV IoU, as kitti_eval's. level: KITTI records' level - moderate (auto),
easy, hard, or distance (every height, as AP by distance); LiDAR-only records: overall. loose_iou (0.5) and
background_iou (0.1): the bounds of the kinds.
root: the dataset root evaluated (KITTI-format or LiDAR-only): with it, the points inside each box are counted and
the worst ``pictures`` errors of each kind are drawn (bird's-eye crops of crop= metres around the error, which lies
at the centre: the points, the ground truth filled, the detections outlined with their scores); fov_only keeps the
points in the camera's view, as evaluation does. out: where errors.json and pictures/ go (default RUN/errors; a
folder holding other files is refused).

Prints a table per class (counted GT, found, each kind of error by distance band 0-30 / 30-50 / 50+ m) and one
summary line per class to compare between runs; errors.json holds the settings, the counts and every error (frame,
kind, class, distance, band, size, score, best IoU and its record, points inside). The rule of each kind:
detector/eval/error_analysis.py. Exit status 1 with one message on bad input.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from detector.cli import parse_args
from detector.errors import ConfigError, KittiFormatError
from detector.eval.kitti_files import LAYOUTS, detect_layout, load_eval_inputs
from detector.eval.protocol import EVAL_CLASSES

USAGE = __doc__
RESULT_NAME = "errors.json"


def _classes(text: str, layout: str, inputs, run: Path | None) -> tuple[str, ...]:
    """The classes of ``classes=``; else those the evaluation scored (its metrics.json), else the layout's scored
    classes that the result files name (else that the label files name)."""
    from detector.commands.kitti_eval import lidar_default_ious

    given = tuple(c.strip() for c in text.split(",") if c.strip())
    if given:
        return given
    try:
        scored = json.loads((run / "metrics.json").read_text()) if run is not None else {}
    except (OSError, ValueError):
        scored = {}
    if isinstance(scored, dict) and (found := tuple(k for k in scored if not k.startswith("_") and k != "distance")):
        return found
    known = tuple(lidar_default_ious()) if layout == "lidar" else EVAL_CLASSES
    for frames in (inputs.dt, inputs.gt):
        named = {str(n) for f in frames for n in f.name}
        if found := tuple(c for c in known if c in named):
            return found
    return known[:1]


def _out_dir(path: Path) -> Path:
    """``path`` as this command's output folder: new, empty, or one it wrote before (its errors.json; its old
    pictures are removed). Anything else is a :class:`ConfigError` naming ``out=``."""
    from detector.outputs import writable_dir

    if path.is_dir() and any(path.iterdir()):
        if not (path / RESULT_NAME).is_file():
            raise ConfigError(f"out={path}: the folder holds other files (no {RESULT_NAME}); choose a new or empty "
                              "folder")
        for old in (path / "pictures").glob("*.png"):
            old.unlink()
    return writable_dir(path, "out")


def _decode_threshold(run: Path | None) -> float | None:
    """The score threshold the evaluation decoded at (its metrics.json ``_run.decode``), None where unknown."""
    if run is None or not (run / "metrics.json").is_file():
        return None
    try:
        return float(json.loads((run / "metrics.json").read_text())["_run"]["decode"]["score_threshold"])
    except (ValueError, KeyError, TypeError):
        return None


class _Scenes:
    """The frames of the dataset root, read once each: points (the camera's view where ``fov_only``), calibration,
    and the LiDAR-frame boxes of the evaluation's records."""

    def __init__(self, root: str, frame_ids, gt, dt, fov_only: bool):
        from detector.data.lidar import open_root

        self.root = open_root(root)
        self.index = {f: i for i, f in enumerate(frame_ids)}
        self.gt, self.dt, self.fov_only = gt, dt, fov_only
        self.cache: dict[str, tuple] = {}

    def frame(self, frame_id: str):
        """(points, GT boxes and names (DontCare left out), detection boxes, names and scores) of a frame."""
        if frame_id not in self.cache:
            from detector.data.dataset import camera_view

            f = self.root.read_frame(frame_id)
            points = camera_view(f.points, f.calib, f.image_size) if self.fov_only else f.points
            i = self.index[frame_id]
            gt, dt = self.gt[i], self.dt[i]
            objects = np.flatnonzero(gt.name != "DontCare")
            self.cache[frame_id] = (points, self.boxes(gt, f.calib), objects, self.boxes(dt, f.calib), dt)
        return self.cache[frame_id]

    @staticmethod
    def boxes(records, calib):
        """Every record's LiDAR-frame box (DontCare's placeholder too, never drawn or counted)."""
        from detector.data.kitti_camera import labels_to_boxes
        from detector.data.lidar_labels import LidarLabels
        from detector.geometry.boxes import Boxes3D

        if isinstance(records, LidarLabels):
            return Boxes3D(records.boxes)
        if calib is None:
            raise ConfigError("root= is a LiDAR-only root but the evaluation's records are KITTI ones (camera frame): "
                              "give the KITTI root that was evaluated")
        return labels_to_boxes(records, calib)

    def box(self, e):
        points, gt_boxes, _, dt_boxes, _ = self.frame(e.frame)
        return points, (gt_boxes if e.side == "gt" else dt_boxes)[e.record]


def count_points(analysis, scenes: _Scenes) -> None:
    """Set each error's ``points``: the root's points inside its box (the camera's view where fov_only)."""
    from detector.geometry.boxes import points_in_boxes_sparse

    for e in analysis.errors:
        points, box = scenes.box(e)
        e.points = int(len(points_in_boxes_sparse(points, box)[0]))


def draw_pictures(analysis, scenes: _Scenes, folder: Path, per_kind: int, crop: float) -> list[Path]:
    """The ``per_kind`` worst errors of each kind (:func:`~detector.eval.error_analysis.worst`), each a bird's-eye
    crop of ``crop`` metres centred on it (:func:`detector.viz.bev_image`): ``folder/<kind>_<rank>_<frame>_<cls>.png``.
    """
    from detector.eval.error_analysis import KINDS, worst
    from detector.geometry.voxelize import BevGrid
    from detector.viz import bev_image, write_png

    written = []
    half = max(1.0, round(crop / 2, 1))
    for kind, label in KINDS.items():
        for rank, e in enumerate(worst(analysis.of(kind=kind), per_kind), 1):
            points, gt_boxes, objects, dt_boxes, dt = scenes.frame(e.frame)
            _, box = scenes.box(e)
            cx, cy = (round(float(v), 1) for v in box.tensor[0, :2])
            grid = BevGrid((cx - half, cx + half), (cy - half, cy + half), (-10.0, 10.0), 0.1, 20.0)
            gt_names = [str(n) for n in scenes.gt[scenes.index[e.frame]].name[objects]]
            score = "" if e.score is None else f" score {e.score:.2f}"
            title = f"{e.frame} {label}: {e.cls}{score}, IoU {e.best_iou:.2f}, {e.distance:.0f} m (centre)"
            img = bev_image(points, grid, gt_boxes[objects.tolist()] if len(objects) else None, dt_boxes, dt.score,
                            score_threshold=analysis.score_threshold, gt_names=gt_names,
                            det_names=[str(n) for n in dt.name], size=480, rings=10.0, title=title)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{kind}_{rank:02d}_{e.frame}_{e.cls}.png"
            write_png(path, img)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    from detector.eval.error_analysis import BACKGROUND_IOU, LOOSE_IOU, SCORE_THRESHOLD

    args = parse_args(
        argv,
        {"run": None, "gt": None, "results": None, "root": None, "score_threshold": SCORE_THRESHOLD, "out": None,
         "classes": "", "iou": "", "level": "auto", "loose_iou": LOOSE_IOU, "background_iou": BACKGROUND_IOU,
         "pictures": 6, "crop": 24.0, "fov_only": True, "layout": "auto", "split": None},
        USAGE,
    )
    run = Path(args["run"]).expanduser() if args["run"] else None
    gt_dir = args["gt"] or (str(run / "label_2") if run else None)
    res_dir = args["results"] or (str(run / "data") if run else None)
    if gt_dir is None or res_dir is None:
        print("error: give run=EVAL_DIR (the folder scripts/evaluate.py wrote) or gt= and results= (see --help)",
              file=sys.stderr)
        return 2
    if args["layout"] not in LAYOUTS:
        print(f"error: layout={args['layout']!r}: choose {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    for key in ("score_threshold", "loose_iou", "background_iou", "crop"):
        if not math.isfinite(args[key]):
            print(f"error: {key}={args[key]}: give a finite number", file=sys.stderr)
            return 2
    if args["pictures"] < 0 or args["crop"] <= 0:
        print("error: pictures= must be >= 0 and crop= > 0 (metres)", file=sys.stderr)
        return 2
    from detector.commands.kitti_eval import min_overlaps, parse_iou
    from detector.eval.error_analysis import analyze

    try:
        layout = detect_layout(gt_dir, res_dir) if args["layout"] == "auto" else args["layout"]
        inputs = load_eval_inputs(gt_dir, res_dir, args["split"], layout)
        overlaps = min_overlaps(layout, _classes(args["classes"], layout, inputs, run), parse_iou(args["iou"]))
        level = None if args["level"] == "auto" else args["level"]
        analysis = analyze(inputs.frame_ids, inputs.gt, inputs.dt, overlaps, args["score_threshold"], level,
                           args["loose_iou"], args["background_iou"])
        out = _out_dir(Path(args["out"]).expanduser() if args["out"] else Path(res_dir).parent / "errors")
        pictures: list[Path] = []
        if args["root"]:
            scenes = _Scenes(args["root"], inputs.frame_ids, inputs.gt, inputs.dt, args["fov_only"])
            count_points(analysis, scenes)
            if args["pictures"]:
                pictures = draw_pictures(analysis, scenes, out / "pictures", args["pictures"], args["crop"])
    except (KittiFormatError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if inputs.missing_results:
        print(f"warning: {len(inputs.missing_results)} of {len(inputs.frame_ids)} frames have no result file and "
              "count as frames without detections", file=sys.stderr)
    decoded = _decode_threshold(run)
    if decoded is not None and args["score_threshold"] < decoded:
        print(f"note: the evaluation decoded boxes scored >= {decoded:g}: score_threshold={args['score_threshold']:g} "
              "counts the same boxes", file=sys.stderr)
    print(analysis.table())
    print()
    print("\n".join(analysis.summary()))
    payload = {**analysis.to_json(), "inputs": {"gt": str(gt_dir), "results": str(res_dir), "layout": layout,
                                                "root": args["root"]}}
    (out / RESULT_NAME).write_text(json.dumps(payload, indent=1) + "\n")
    where = f"; {len(pictures)} pictures in {out / 'pictures'}" if pictures else \
        ("" if args["root"] else " (give root=DATASET_ROOT to count the points inside each box and draw the worst)")
    print(f"every error: {out / RESULT_NAME}{where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
