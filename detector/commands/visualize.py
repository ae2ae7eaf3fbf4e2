"""Render a frame's points, ground-truth boxes and predicted boxes.

    detector-visualize root=DIR frame=000010 [ckpt_path=PATH] [mask=road_map|predicted|ground|none]
                       [out=frame.png] [mode=auto|3d|bev] [score_threshold=0.3] [fov_only=true]
                       [split_dir=training] [size=1000]
    (or: python scripts/visualize.py ...)

root: a KITTI-format root (``split_dir``/velodyne, label_2, calib) or a LiDAR-only one (points/, labels/:
docs/custom-data.md), told apart as training tells them (a ``points`` folder: LiDAR-only).

mode=3d renders with open3d's legacy Visualizer offscreen (works without a display on our machines);
mode=bev draws the bird's-eye-view image (the one TensorBoard and predict draw: the ground truth filled and the
predictions outlined in their class colours, with their scores; ``size`` pixels on the map's long side);
mode=auto tries 3d (ground truth green, predictions red), then bev.
Without ckpt_path only the ground truth is drawn. ``mask=`` replaces the checkpoint's computation mask,
as ``scripts/evaluate.py mask=...`` does (the same :func:`detector.build.load_detector`): real KITTI has
no road maps, so a road-map checkpoint is drawn there with mask=ground, mask=none (dense) or, when it
trained a mask net, mask=predicted. ``fov_only`` keeps the points in the camera's view, as training and
evaluation do (data.fov_only); a LiDAR-only frame has no camera and keeps every point.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from detector.cli import parse_args
from detector.data.dataset import camera_view
from detector.data.kitti import KittiRoot
from detector.data.lidar import open_root
from detector.data.structures import Detections, Frame
from detector.errors import ConfigError, KittiFormatError, is_user_error, one_line
from detector.geometry.boxes import BOX_EDGES, Boxes3D

USAGE = __doc__


def render_3d(points: np.ndarray, boxes: list[tuple[Boxes3D, tuple[float, float, float]]], out: Path,
              size: tuple[int, int] = (1280, 800)) -> bool:
    """Offscreen open3d rendering to PNG; False when this machine cannot render."""
    import open3d as o3d

    pcd = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(points[:, :3].astype(np.float64)))
    shade = np.clip(0.35 + 0.65 * points[:, 3:4], 0, 1)
    pcd.colors = o3d.utility.Vector3dVector(np.repeat(shade, 3, axis=1) * np.array([0.75, 0.8, 1.0]))
    geoms = [pcd]
    for b, color in boxes:
        for corners in b.corners().detach().cpu().double().numpy():
            ls = o3d.geometry.LineSet(o3d.utility.Vector3dVector(corners), o3d.utility.Vector2iVector(BOX_EDGES))
            ls.paint_uniform_color(color)
            geoms.append(ls)
    from detector.viz import private_runtime_dir

    vis = o3d.visualization.Visualizer()
    with private_runtime_dir():  # the window system's probe prints no XDG_RUNTIME_DIR complaint that reads as ours
        if not vis.create_window(visible=False, width=size[0], height=size[1]):
            return False
    try:
        for g in geoms:
            vis.add_geometry(g)
        opt = vis.get_render_option()
        opt.background_color = np.zeros(3)
        opt.point_size = 1.5
        ctl = vis.get_view_control()
        ctl.set_lookat([25.0, 0.0, 0.0])
        ctl.set_front([-1.0, 0.0, 0.9])
        ctl.set_up([1.0, 0.0, 0.6])
        ctl.set_zoom(0.3)
        vis.poll_events()
        vis.update_renderer()
        vis.capture_screen_image(str(out), do_render=True)
    finally:
        vis.destroy_window()
    return out.is_file() and out.stat().st_size > 0


def detect(model, cfg, frame: Frame) -> tuple[Detections, torch.Tensor | None]:
    """One frame's detections (all scores above the decode threshold) with the model's decode settings
    (those evaluation uses) and its computation mask [H, W] (None: dense): :class:`detector.predict.Predictor`, as
    ``detector-predict`` runs it. The mask comes from ``cfg.mask`` as :func:`detector.build.load_detector` set it:
    the checkpoint's, or a ``mask=`` override. A road-map mask on a frame without a road map raises ValueError (its
    message names the frame)."""
    from detector.predict import Predictor

    pred = Predictor.from_config(model, cfg, next(model.parameters()).device)([frame])
    return pred.dets[0], (None if pred.out.mask is None else pred.out.mask[0, 0])


def read_frame(root: str, frame_id: str, split_dir: str = "training") -> Frame:
    """A frame of a KITTI root (its ``split_dir``) or of a LiDAR-only one (``points/``, ``labels/``: no calibration,
    so no field-of-view cut), the layout found as :func:`detector.data.lidar.open_root` finds it; with its road map
    where the root has them."""
    found = open_root(root)
    if found.layout == "kitti" and split_dir != "training":
        found = KittiRoot(root, split_dir)
    return found.read_frame(frame_id, road_map=found.has_road_maps())


def main(argv=None) -> int:
    args = parse_args(argv, {"root": None, "frame": "000000", "split_dir": "training", "ckpt_path": None,
                             "mask": None, "out": None, "mode": "auto", "score_threshold": 0.3,
                             "fov_only": True, "size": 1000}, USAGE)
    if args["root"] is None:
        raise SystemExit("error: root=DIR is required (see --help)")
    if args["mode"] not in ("auto", "3d", "bev"):
        raise SystemExit(f"error: mode must be auto, 3d or bev, got {args['mode']!r}")
    if isinstance(args["size"], bool) or not isinstance(args["size"], int) or args["size"] < 200:
        raise SystemExit(f"error: size={args['size']!r}: pixels on the map's long side, an integer >= 200")
    if args["mask"] is not None and not args["ckpt_path"]:
        raise SystemExit("error: mask= chooses a checkpoint's computation mask: give ckpt_path=PATH too")
    try:
        frame = read_frame(args["root"], args["frame"], args["split_dir"])
    except (KittiFormatError, ConfigError) as e:
        print(one_line(e), file=sys.stderr)
        return 1
    if args["fov_only"]:  # as the dataset does for training and evaluation (a LiDAR-only frame keeps every point)
        frame.points = camera_view(frame.points, frame.calib, frame.image_size)
    dets, grid, mask, scores, names = None, None, None, None, None
    if args["ckpt_path"]:
        from detector.build import load_detector

        try:
            model, cfg = load_detector(args["ckpt_path"], mask_override=args["mask"])
            model.eval()
            found, mask = detect(model, cfg, frame)
        except Exception as e:  # e.g. a road-map model on a frame without one
            if not is_user_error(e):
                raise
            print(one_line(e), file=sys.stderr)
            return 1
        keep = found.scores >= args["score_threshold"]
        dets, scores = found.boxes[keep], found.scores[keep]
        names = list(np.asarray(model.coder.classes)[found.labels[keep].numpy()]) if int(keep.sum()) else []
        grid = model.grid
    out_path = Path(args["out"] or f"frame_{args['frame']}.png")
    boxes = [(frame.gt_boxes, (0.2, 0.9, 0.2))] + ([(dets, (1.0, 0.25, 0.25))] if dets is not None else [])
    if args["mode"] in ("auto", "3d"):
        if render_3d(frame.points, boxes, out_path):
            print(f"wrote {out_path} (open3d, 3D view)")
            return 0
        if args["mode"] == "3d":
            print("error: open3d could not render offscreen on this machine; use mode=bev", file=sys.stderr)
            return 1
    from detector.viz import bev_image, write_png

    if grid is None:
        from detector.geometry.voxelize import BevGrid

        grid = BevGrid((0.0, 70.4), (-40.0, 40.0), (-2.5, 1.0), 0.1, 0.1)
    write_png(out_path, bev_image(frame.points, grid, gt_boxes=frame.gt_boxes, det_boxes=dets, det_scores=scores,
                                  mask=mask, score_threshold=args["score_threshold"], gt_names=frame.gt_names,
                                  det_names=names, size=args["size"], title=f"frame {args['frame']}"))
    print(f"wrote {out_path} (bird's-eye view)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
