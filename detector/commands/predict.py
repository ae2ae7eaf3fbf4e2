"""Run a checkpoint on point-cloud files and write the boxes it finds.

    detector-predict ckpt_path=PATH input=FILE|DIR [out=DIR] [format=auto|bin|npy|pcd|ply]
                     [calib=FILE|DIR] [image=FILE|DIR] [mask=predicted|ground|none] [skip_bad=false]
                     [drop_nonfinite=false] [intensity_scale=1.0] [fov_only=true] [picture=bev|3d|both|none]
                     [picture_size=1000]
                     [score_threshold=0.3] [filter_files=false] [overwrite=false] [device=auto|cpu|cuda]
                     [block_size=8|16|32|dense|auto]
    (or: python scripts/predict.py ...)

input: a point cloud (KITTI .bin float32 x, y, z, reflectance; .npy [N, 3] or [N, 4]; .pcd or .ply) or a folder of
them (format= picks one kind; auto: every known extension). Each cloud goes through the checkpoint's BEV grid,
computation mask and decoding, as evaluation runs it. Per frame (its id: the file name without extension), in out
(default outputs/predict/<date_time>; a folder that holds anything is refused unless overwrite=true, which writes
this run's files over those of the same names):
    json/<id>.json     the boxes in the LiDAR frame: x, y, z (centre), l, w, h, yaw, class, score; and what was read
    txt/<id>.txt       the same, one box a line: x y z dx dy dz heading class score (OpenPCDet's custom format + score)
    kitti/<id>.txt     KITTI result files (camera frame, 2D box from the calibration's P2), with calib= only
    bev/<id>.png       the bird's-eye view: points, computation mask, the boxes scored >= score_threshold in their
                       class colours with their scores, range rings, a metre scale and a legend
    3d/<id>.png        (picture=3d|both) an offscreen open3d view, where this machine can render one
picture_size: pixels on the long side of the bird's-eye view's map (at least 200; the legend goes under it).
and summary.json (frames, boxes per class, ms per frame, skipped files, warnings). Every file is written whole
once its frame succeeded; a run that fails leaves no empty folder behind.

score_threshold: what the summary counts and the pictures draw: the boxes scored at least this. The files hold every
box the checkpoint decodes (down to its own model.score_threshold, as evaluation scores them: AP needs the low
scores) unless filter_files=true, which keeps only the boxes scored >= score_threshold in them too.

calib: a KITTI calibration file for every frame, or a folder of <id>.txt. With it the points are cut to the
camera's view (fov_only, as training and evaluation do) and the KITTI files are written: for a KITTI frame they
equal the ones scripts/evaluate.py writes. image: the left camera's PNG (or a folder of <id>.png): its size (default
1242 x 375) bounds the camera's view and the 2D boxes, as evaluation reads it from image_2/.
block_size: how the sparse network runs, in place of the checkpoint's - the tile of every sparse stage (or dense, or
auto: the plan). The mask defines what is computed: the boxes are the same every way, only the time changes
(docs/gpu.md).
mask: a computation mask in place of the checkpoint's (as scripts/evaluate.py mask=...); a road map needs the
simulator's maps, which a point cloud has not: use ground, none, or predicted where the checkpoint trained a mask net.

A cloud that does not look like the training data (metres, x forward, y left, z up, reflectance in [0, 1]) gets one
warning line per reason - no reflectance channel (0 used), reflectance beyond [0, 1] (intensity_scale= scales it),
millimetre or centimetre units, another up-axis, most points outside the grid - the first time it occurs; the
summary counts them. A bad file (empty, truncated, NaN/inf points, unknown extension) stops the run with one line
naming it; skip_bad=true skips and counts it instead. drop_nonfinite=true drops NaN/inf points (counted) instead of
refusing the file. docs/predict.md has the details.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from detector.cli import parse_args
from detector.errors import ConfigError, KittiFormatError, run_cleanly
from detector.outputs import atomic_path, claim_dir, writable_dir, write_text_atomic

USAGE = __doc__

DEFAULTS: dict[str, Any] = {
    "ckpt_path": None, "input": None, "out": None, "format": "auto", "calib": None, "image": None, "mask": None,
    "skip_bad": False, "drop_nonfinite": False, "intensity_scale": 1.0, "fov_only": True, "picture": "bev",
    "picture_size": 1000,
    "score_threshold": 0.3, "filter_files": False, "overwrite": False, "device": "auto", "block_size": None,
}
PICTURES = ("bev", "3d", "both", "none")


def _per_frame(arg: str | None, what: str, ext: str) -> Callable[[str], Path] | None:
    """A file given for every frame, or a folder of ``<id><ext>``; None when not given."""
    if arg is None:
        return None
    path = Path(arg)
    if path.is_dir():
        return lambda frame_id: path / f"{frame_id}{ext}"
    if not path.is_file():
        raise KittiFormatError(path, f"{what} not found (a file for every frame, or a folder of <id>{ext})")
    return lambda frame_id: path


def _inputs(args: dict[str, Any]) -> list[Path]:
    from detector.data.pointcloud import cloud_format, list_point_clouds

    src = Path(args["input"])
    if src.is_dir():
        return list_point_clouds(src, args["format"])
    if not src.is_file():
        raise KittiFormatError(src, "input not found (a point-cloud file or a folder of them)")
    cloud_format(src, args["format"])  # an unknown extension fails before the checkpoint loads
    return [src]


def _select(dets, keep):
    """The detections where ``keep`` (a bool tensor) holds."""
    from detector.data.structures import Detections

    return Detections(dets.boxes[keep], dets.scores[keep], dets.labels[keep])


class _Output:
    """The run's output folder: refused when it holds anything (unless ``overwrite``), its sub-folders made when their
    first file is written, and on a failure every folder this run made and left empty removed again. ``timed``: a
    folder named by the start time (no ``out=``), versioned (``_1``, ``_2``, ...) when another run already took it,
    as training's run folders are."""

    def __init__(self, root: Path, overwrite: bool, timed: bool = False):
        self.marker = None
        if timed:
            base = root
            for version in range(1000):
                root = base if version == 0 else base.with_name(f"{base.name}_{version}")
                made = [p for p in (root, *root.parents) if not p.exists()][::-1]
                if claim_dir(root):  # created (or found empty) and marked: ours, whoever starts in this second
                    self.marker = root / ".claimed"
                    break
            else:
                raise ConfigError(f"out={base}: 1000 predict runs already started in this second; give out=DIR")
        else:
            if root.is_dir() and any(root.iterdir()) and not overwrite:
                raise ConfigError(f"out={root}: the folder is not empty: one folder per run; choose a new folder (or "
                                  "give overwrite=true to write this run's files over those of the same names)")
            made = [p for p in (root, *root.parents) if not p.exists()][::-1]  # outermost first
        self.root, self.made = root, made
        writable_dir(root, "out")  # a path that cannot be written costs one line now, not after the first frame

    def release(self) -> None:
        """The run is over: its folder's claim marker removed (the folder holds the run's files only)."""
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)

    def file(self, sub: str, name: str) -> Path:
        """``root/sub/name``, its folder made (and remembered) where missing."""
        folder = self.root / sub
        if not folder.is_dir():
            folder.mkdir()
            self.made.append(folder)
        return folder / name

    def remove_empty(self) -> None:
        """Remove the folders this run made that hold nothing, innermost first."""
        self.release()
        for folder in reversed(self.made):
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): keep it
                pass


class _Run:
    """One predict run: the predictor, where outputs go, and what has been counted so far."""

    def __init__(self, args: dict[str, Any], predictor, out: _Output, total: int):
        self.args, self.predictor, self.out, self.total = args, predictor, out, total
        self.threshold = float(args["score_threshold"])
        self.picture_size = int(args["picture_size"])
        self.calib_for = _per_frame(args["calib"], "calibration", ".txt")
        self.image_for = _per_frame(args["image"], "image", ".png")
        self.pictures = {"bev", "3d"} if args["picture"] == "both" else {args["picture"]} - {"none"}
        self.frames, self.boxes, self.decoded = 0, Counter(), Counter()  # boxes: scored >= threshold; decoded: all
        self.model_ms: list[float] = []
        self.frame_ms: list[float] = []
        self.notes: Counter = Counter()
        self.skipped: list[str] = []

    def frame(self, path: Path, say: Callable[[str], None]) -> None:
        """Read, predict and write one point cloud; raises KittiFormatError (naming the file) on bad input before
        anything of the frame is written."""
        from detector.data.kitti import check_image_matches_calib, read_png_size
        from detector.data.kitti_calib import Calibration
        from detector.data.pointcloud import read_point_cloud, sanity_notes
        from detector.data.structures import Frame
        from detector.module import frame_records
        from detector.predict import box_dicts, openpcdet_lines

        t0 = time.perf_counter()
        args, pred = self.args, self.predictor
        frame_id = path.stem
        cloud = read_point_cloud(path, args["format"], drop_nonfinite=args["drop_nonfinite"])
        if args["intensity_scale"] != 1.0 and cloud.has_intensity:
            cloud.points[:, 3] *= args["intensity_scale"]
        notes = sanity_notes(cloud, pred.grid)
        calib = image_size = None
        points = cloud.points
        if self.calib_for is not None:
            calib_path = self.calib_for(frame_id)
            calib = Calibration.from_file(calib_path)
            if self.image_for is not None:
                image_size = read_png_size(self.image_for(frame_id))
                check_image_matches_calib(image_size, calib, self.image_for(frame_id), calib_path)
            if args["fov_only"]:  # as the dataset does for training and evaluation (the checkpoint's data.fov_only)
                points = pred.camera_view(points, calib, image_size)
        frame = Frame(frame_id, points, calib, image_size=image_size)
        t_model = time.perf_counter()
        result = pred([frame])
        model_ms = 1000 * (time.perf_counter() - t_model)
        dets = result.dets[0]
        shown = dets.scores >= self.threshold
        written = _select(dets, shown) if args["filter_files"] else dets
        boxes = box_dicts(written, pred.classes)
        kitti = frame_records(result.batch, [written], pred.classes, pred.grid)[0].dt if calib is not None else None
        images = self._pictures(frame_id, points, dets, result.out.mask)
        for kind, line in notes:
            if not self.notes[kind]:
                say(f"warning: {path}: {line}" + (" (later frames: counted in the summary)" if self.many else ""))
            self.notes[kind] += 1
        record = {"frame_id": frame_id, "source": str(path.resolve()), "points": int(len(cloud.points)),
                  "points_used": int(len(points)), "intensity": cloud.has_intensity,
                  "nonfinite_dropped": cloud.dropped, "warnings": [line for _, line in notes],
                  "checkpoint": str(args["ckpt_path"]), "boxes": boxes}
        # everything of the frame is computed: now its files, each whole
        write_text_atomic(self.out.file("json", f"{frame_id}.json"), json.dumps(record, indent=1) + "\n")
        write_text_atomic(self.out.file("txt", f"{frame_id}.txt"), "".join(s + "\n" for s in openpcdet_lines(boxes)))
        if kitti is not None:
            from detector.data.kitti_labels import write_label

            with atomic_path(self.out.file("kitti", f"{frame_id}.txt")) as tmp:
                write_label(tmp, kitti)
        self._write_pictures(frame_id, images, points, _select(dets, shown), say)
        self.frames += 1
        names = np.asarray(pred.classes)[dets.labels.numpy()] if len(dets) else np.zeros(0, str)
        self.boxes.update(names[shown.numpy()].tolist())
        self.decoded.update(names.tolist())
        self.model_ms.append(model_ms)
        self.frame_ms.append(1000 * (time.perf_counter() - t0))

    @property
    def many(self) -> bool:
        return self.total > 1

    def _pictures(self, frame_id: str, points: np.ndarray, dets, mask) -> dict[str, np.ndarray]:
        """The bird's-eye view to write (``bev``), computed before any file of the frame is written: the boxes scored
        at least score_threshold, in their class colours, with their scores."""
        if "bev" not in self.pictures:
            return {}
        from detector.viz import bev_image

        names = np.asarray(self.predictor.classes)[dets.labels.numpy()] if len(dets) else []
        return {"bev": bev_image(points, self.predictor.grid, det_boxes=dets.boxes, det_scores=dets.scores,
                                 det_names=names, mask=None if mask is None else mask[0, 0],
                                 score_threshold=self.threshold, title=frame_id, size=self.picture_size)}

    def _write_pictures(self, frame_id: str, images: dict[str, np.ndarray], points: np.ndarray, drawn,
                        say: Callable[[str], None]) -> None:
        """The pictures' files; ``drawn``: the detections the 3D view shows (those scored >= score_threshold)."""
        from detector.viz import write_png

        for name, img in images.items():
            with atomic_path(self.out.file(name, f"{frame_id}.png")) as tmp:
                write_png(tmp, img)
        if "3d" in self.pictures:
            from detector.commands.visualize import render_3d

            tmp = self.out.root / f".{frame_id}.3d.tmp{os.getpid()}.png"  # 3d/ is made once a view is rendered
            import open3d as o3d

            level = o3d.utility.get_verbosity_level()
            o3d.utility.set_verbosity_level(o3d.utility.VerbosityLevel.Error)  # its window-system probing notes
            try:
                rendered = render_3d(points, self._by_class(drawn), tmp)
                if rendered:
                    os.replace(tmp, self.out.file("3d", f"{frame_id}.png"))
            finally:
                o3d.utility.set_verbosity_level(level)
                tmp.unlink(missing_ok=True)
            if not rendered:
                say("warning: open3d cannot render offscreen on this machine: no 3D pictures from here on "
                    "(picture=bev draws the bird's-eye view)")
                self.pictures.discard("3d")

    def _by_class(self, dets) -> list[tuple[Any, tuple[float, float, float]]]:
        """The detections' boxes per class with the class's colour (0-1), as :func:`render_3d` takes them."""
        from detector.viz import class_color

        return [(dets.boxes[dets.labels == k], tuple(v / 255 for v in class_color(name)))
                for k, name in enumerate(self.predictor.classes) if bool((dets.labels == k).any())]

    def summary(self) -> dict[str, Any]:
        return {
            "frames": self.frames, "skipped": len(self.skipped), "skipped_files": self.skipped,
            "score_threshold": self.threshold, "boxes": dict(sorted(self.boxes.items())),
            "boxes_decoded": dict(sorted(self.decoded.items())),
            "decode_score_threshold": self.predictor.decode.get("score_threshold"),
            "filter_files": bool(self.args["filter_files"]),
            "model_ms_per_frame_median": float(np.median(self.model_ms)) if self.model_ms else None,
            "model_ms_first_frame": self.model_ms[0] if self.model_ms else None,
            "ms_per_frame_median": float(np.median(self.frame_ms)) if self.frame_ms else None,
            "warnings": dict(self.notes), "checkpoint": str(self.args["ckpt_path"]),
            "device": str(self.predictor.device), "output": str(self.out.root),
        }


def predict(args: dict[str, Any]) -> dict[str, Any]:
    """The command behind ``main``: returns the summary (also written to ``out/summary.json``)."""
    for key in ("ckpt_path", "input"):
        if not args[key]:
            raise ConfigError(f"{key}= is required (see --help)")
    if args["picture"] not in PICTURES:
        raise ConfigError(f"picture={args['picture']!r}: choose {', '.join(PICTURES)}")
    size = args["picture_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 200:
        raise ConfigError(f"picture_size={size!r}: pixels on the map's long side, an integer >= 200")
    if args["device"] not in ("auto", "cpu", "cuda") and not str(args["device"]).startswith("cuda:"):
        raise ConfigError(f"device={args['device']!r}: choose auto, cpu or cuda")
    if args["image"] is not None and args["calib"] is None:
        raise ConfigError("image= gives the camera's image size for the KITTI files: give calib= too")
    if not (args["intensity_scale"] > 0 and np.isfinite(args["intensity_scale"])):
        raise ConfigError(f"intensity_scale={args['intensity_scale']}: must be a positive number")
    if not 0 <= args["score_threshold"] <= 1:
        raise ConfigError(f"score_threshold={args['score_threshold']}: must lie in [0, 1] (scores do)")
    files = _inputs(args)
    _per_frame(args["calib"], "calibration", ".txt")  # a missing calibration fails before the checkpoint loads
    _per_frame(args["image"], "image", ".png")
    timed = not args["out"]
    out = _Output(Path(args["out"] or Path("outputs") / "predict" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")),
                  args["overwrite"], timed)
    try:
        summary = _predict(args, files, out)
    except BaseException:
        out.remove_empty()
        raise
    out.release()
    return summary


def _predict(args: dict[str, Any], files: list[Path], out: _Output) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from detector.data.masks import RoadMapMask
    from detector.predict import Predictor

    device = None if args["device"] == "auto" else args["device"]
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device}: no CUDA device here (torch {torch.__version__}): device=cpu or auto")
    predictor, _ = Predictor.from_checkpoint(args["ckpt_path"], args["mask"], device, args["block_size"])
    if isinstance(predictor.mask_provider, RoadMapMask):
        raise ConfigError(f"mask: {args['ckpt_path']} runs with mask=road_map, which needs the simulator's road maps; "
                          "a point cloud has none: give mask=ground, mask=none or (if it trained a mask net) "
                          "mask=predicted")
    g = predictor.grid
    print(f"predicting {len(files)} point cloud(s) with {args['ckpt_path']} on {predictor.device}: grid x "
          f"[{g.x_range[0]:g}, {g.x_range[1]:g}) y [{g.y_range[0]:g}, {g.y_range[1]:g}) z [{g.z_range[0]:g}, "
          f"{g.z_range[1]:g}) m, classes {', '.join(predictor.classes)}; output {out.root}")
    run = _Run(args, predictor, out, len(files))
    bar = tqdm(files, unit="frame", file=sys.stderr, disable=len(files) == 1, dynamic_ncols=True)

    def say(line: str) -> None:  # a line on stderr that the progress bar does not overwrite
        bar.write(line, file=sys.stderr)

    for path in bar:
        try:
            run.frame(path, say)
        except KittiFormatError as e:
            if not args["skip_bad"]:
                bar.close()
                raise
            run.skipped.append(str(e))
            say(f"skipped: {e}")
    bar.close()
    summary = run.summary()
    write_text_atomic(out.root / "summary.json", json.dumps(summary, indent=1) + "\n")
    _print_summary(summary)
    return summary


def _print_summary(s: dict[str, Any]) -> None:
    def counts(by_class: dict[str, int]) -> str:
        return ", ".join(f"{c} {n}" for c, n in by_class.items()) or "none"

    decoded = sum(s["boxes_decoded"].values())
    floor = s["decode_score_threshold"]
    kept = "these only (filter_files=true)" if s["filter_files"] else \
        f"all {decoded} decoded" + (f" (scores >= {floor:g})" if floor is not None else "")
    print(f"{s['frames']} frame(s), boxes scored >= {s['score_threshold']:g}: {counts(s['boxes'])}; the files hold "
          f"{kept}" + (f"; {s['skipped']} bad file(s) skipped" if s["skipped"] else ""))
    if s["frames"]:
        print(f"model {s['model_ms_per_frame_median']:.1f} ms per frame (median; voxelize, mask, network, decode; "
              f"the first frame {s['model_ms_first_frame']:.1f} ms), {s['ms_per_frame_median']:.1f} ms with reading "
              f"and writing (median) on {s['device']}")
    if s["warnings"]:
        print("warnings: " + ", ".join(f"{k} in {n} frame(s)" for k, n in s["warnings"].items()))
    print(f"wrote {s['output']} (summary.json)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, DEFAULTS, USAGE)
    run_cleanly(predict, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
