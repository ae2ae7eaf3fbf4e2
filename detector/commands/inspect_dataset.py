"""Validate every file of a KITTI-format or LiDAR-only root and print a summary.

    detector-inspect-dataset root=DIR [split_dir=training] [max_frames=0] [layout=auto] [classes=Car,...]
                             [train_split=train] [val_split=val]
    (or: python scripts/inspect_dataset.py ...)

layout   kitti, lidar or auto (a points/ folder: LiDAR-only); classes (LiDAR-only): the known class names, comma
         separated (default: data=lidar's, configs/data/lidar.yaml); objects of other names (and not of
         DontCare, Van, Tram, Misc, Person_sitting) are counted as unknown in the summary
train_split, val_split: the splits training would learn from and validate on (data.train_split, data.val_split):
         one warning when they list frames in common

Exits with status 1, naming each bad file, when any file is invalid.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from detector.cli import parse_args
from detector.data.dataset import split_overlap
from detector.data.kitti import KittiRoot
from detector.data.kitti_labels import DIFFICULTY_LEVELS, difficulty
from detector.data.lidar import LidarRoot, UnknownClasses, open_root
from detector.errors import ConfigError, KittiFormatError
from detector.sim.writer import stale_sample

USAGE = __doc__


def inspect(root: str, split_dir: str = "training", max_frames: int = 0) -> tuple[str, list[str]]:
    """Return (summary text, list of error messages)."""
    kroot = KittiRoot(root, split_dir)
    errors: list[str] = []
    splits: dict[str, list[str]] = {}
    for p in sorted((kroot.root / "ImageSets").glob("*.txt")):
        try:
            splits[p.stem] = kroot.imageset(p.stem)
        except KittiFormatError as e:
            errors.append(str(e))
    on_disk = sorted(p.stem for p in (kroot.dir / "velodyne").glob("*.bin"))
    ids = on_disk[:max_frames] if max_frames > 0 else on_disk
    listed = {i for s in splits.values() for i in s}
    for i in sorted(listed - set(on_disk)):
        errors.append(f"{kroot.path('velodyne', i)}: frame {i} is listed in ImageSets but has no point cloud")
    road = kroot.has_road_maps()
    n_points, per_class, dist = [], defaultdict(Counter), defaultdict(list)
    for i in ids:
        try:
            f = kroot.read_frame(i, road_map=road)
        except KittiFormatError as e:
            errors.append(str(e))
            continue
        n_points.append(len(f.points))
        if f.labels is None:
            continue
        lvl = difficulty(f.labels)
        for name, d in zip(f.labels.name, lvl, strict=True):
            per_class[name]["total"] += 1
            if name == "DontCare":
                continue
            for k, level in enumerate(DIFFICULTY_LEVELS):
                per_class[name][level] += int(0 <= d <= k)
        for name, c in zip(f.gt_names, f.gt_boxes.center.numpy(), strict=True):
            dist[name].append(float(np.hypot(c[0], c[1])))

    lines = _summary_head(f"KITTI-format root: {Path(root).resolve()}  ({split_dir})", on_disk, ids, splits,
                          f"road maps: {'yes' if road else 'no'}", n_points)
    if per_class:
        lines.append("")
        header = f"{'class':<15}{'objects':>9}{'easy':>8}{'moderate':>10}{'hard':>8}"
        lines.append(header + "   distance m (min / median / max)")
        for name in sorted(per_class, key=lambda n: -per_class[n]["total"]):
            c = per_class[name]
            d = np.array(dist.get(name, []))
            drange = f"{d.min():6.1f} / {np.median(d):6.1f} / {d.max():6.1f}" if len(d) else "-"
            lines.append(f"{name:<15}{c['total']:9d}{c['easy']:8d}{c['moderate']:10d}{c['hard']:8d}   {drange}")
        frames_lab = max(len(n_points), 1)
        total = sum(c["total"] for c in per_class.values())
        lines.append(f"objects per frame (all classes, DontCare included): {total / frames_lab:.1f}")
    return "\n".join(lines), errors


def _summary_head(title: str, on_disk: list[str], ids: list[str], splits: dict[str, list[str]], extra: str,
                  n_points: list[int]) -> list[str]:
    """The lines both kinds of root start their summary with: frames, splits, ``extra``, points per frame."""
    lines = [title, f"frames on disk: {len(on_disk)}" + (f" (checked {len(ids)})" if len(ids) < len(on_disk) else "")]
    lines += [f"  split {name:<10} {len(s):6d} frames" for name, s in splits.items()]
    lines.append(extra)
    if n_points:
        p = np.array(n_points)
        lines.append(f"points per frame: mean {p.mean():.0f}, min {p.min()}, max {p.max()}")
    return lines


LIDAR_CLASSES = "Car,Pedestrian,Cyclist,Truck,Bus"  # configs/data/lidar.yaml's


def inspect_lidar(root: str, max_frames: int = 0, classes: str = LIDAR_CLASSES) -> tuple[str, list[str]]:
    """The LiDAR-only twin of :func:`inspect`: (summary text, error messages); unknown class names counted."""
    lroot = LidarRoot(root, [c for c in classes.split(",") if c])
    errors: list[str] = []
    splits: dict[str, list[str]] = {}
    for name in lroot.splits():
        try:
            splits[name] = lroot.imageset(name)
        except KittiFormatError as e:
            errors.append(str(e))
    on_disk = lroot.frame_ids()
    ids = on_disk[:max_frames] if max_frames > 0 else on_disk
    for i in sorted({i for s in splits.values() for i in s} - set(on_disk)):
        errors.append(f"{lroot.root / 'points' / i}.bin: frame {i} is listed in ImageSets but has no point cloud")
    n_points, per_class, dist = [], Counter(), defaultdict(list)
    unknown = UnknownClasses()
    for i in ids:
        try:
            f = lroot.read_frame(i)
        except KittiFormatError as e:
            errors.append(str(e))
            continue
        n_points.append(len(f.points))
        if f.labels is None:
            continue
        unknown.add(f.labels, lroot.unknown(f.labels), lroot.path("labels", i))
        for name, c in zip(f.labels.name, f.labels.boxes, strict=True):
            per_class[name] += 1
            dist[name].append(float(np.hypot(c[0], c[1])))
    lines = _summary_head(f"LiDAR-only root: {Path(root).resolve()}", on_disk, ids, splits,
                          f"labels: {'yes' if lroot.has_labels() else 'no'}; no calibration, images or road maps",
                          n_points)
    if per_class:
        lines.append("")
        lines.append(f"{'class':<15}{'objects':>9}   distance m (min / median / max)")
        for name, n in per_class.most_common():
            d = np.array(dist[name])
            tag = "" if name in lroot.classes else "  (ignored)" if name in lroot.ignore_classes else "  (UNKNOWN)"
            lines.append(f"{name:<15}{n:9d}   {d.min():6.1f} / {np.median(d):6.1f} / {d.max():6.1f}{tag}")
        lines.append(f"objects per frame: {sum(per_class.values()) / max(len(n_points), 1):.1f}")
    if unknown:
        lines.append(f"unknown classes: {unknown.message(lroot.classes)}")
    return "\n".join(lines), errors


def _split_overlap(root, train_split: str, val_split: str) -> str | None:
    """:func:`detector.data.dataset.split_overlap` of the two splits, None where either is missing or unreadable
    (the summary's errors name it)."""
    try:
        return split_overlap((train_split, root.imageset(train_split)), (val_split, root.imageset(val_split)))
    except KittiFormatError:
        return None


def main(argv=None) -> int:
    args = parse_args(argv, {"root": None, "split_dir": "training", "max_frames": 0, "layout": "auto",
                             "classes": LIDAR_CLASSES, "train_split": "train", "val_split": "val"}, USAGE)
    if args["root"] is None:
        raise SystemExit("error: root=DIR is required (see --help)")
    try:
        root = open_root(args["root"], args["layout"])
        if root.layout == "lidar":
            summary, errors = inspect_lidar(args["root"], args["max_frames"], args["classes"])
        else:
            summary, errors = inspect(args["root"], args["split_dir"], args["max_frames"])
    except (KittiFormatError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary)
    if overlap := _split_overlap(root, args["train_split"], args["val_split"]):
        print(f"warning: {overlap}: a model trained on '{args['train_split']}' and validated on "
              f"'{args['val_split']}' is scored on frames it trained on", file=sys.stderr)
    stale = stale_sample(args["root"])
    if stale:
        print(f"warning: {stale}", file=sys.stderr)
    if errors:
        print(f"\n{len(errors)} invalid file(s):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
