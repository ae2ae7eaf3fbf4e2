"""A KITTI-format root written as a LiDAR-only one (:mod:`detector.data.lidar`).

Per frame: the velodyne scan as ``points/<id>.bin`` (the same float32 values), and every labeled object but
DontCare as a line ``x y z dx dy dz heading class`` in the LiDAR frame (the KITTI box through the frame's
calibration, in float64, written with every digit); ``ImageSets/*.txt`` copied. A root without image sets gets
``ImageSets/all.txt`` (every frame) and no other split: which frames to hold out for validation is the user's choice,
never made up here (:meth:`ConvertSummary.commands` gives the training and evaluation commands that run on what was
written). What has no place there is left behind: calibration, images, 2D boxes, truncation, occlusion, road maps.
``fov_only`` keeps only the points in the camera's view (KITTI labels objects there only: a detector trained on the
whole scan would learn that the unlabeled cars elsewhere are background).

The frames converted are those listed in the image sets and those with a velodyne file. A bad frame - listed without
a point cloud, or a file that does not read - is a :class:`KittiFormatError` naming the file, and nothing is written;
``skip_bad`` leaves such frames out instead (of the points, the labels and every image set), named in
:attr:`ConvertSummary.skipped`. The output is written into a temporary folder beside ``out`` and renamed at the end:
nothing half written.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from detector.data.kitti import KittiRoot, write_imageset, write_points
from detector.data.kitti_camera import in_camera_fov, labels_to_boxes
from detector.data.kitti_labels import IMAGE_SIZE
from detector.data.lidar_labels import LidarLabels, write_lidar_label
from detector.errors import KittiFormatError

SKIP_HINT = "skip_bad=true leaves bad frames out of the converted dataset"


@dataclass
class ConvertSummary:
    """What a conversion wrote: ``splits`` the image sets (name: frame count), ``made_all`` True where the source
    had none (``all.txt`` written), ``skipped`` the frames left out with ``skip_bad`` (id, the one-line reason)."""

    root: Path
    frames: int = 0
    objects: dict[str, int] = field(default_factory=dict)
    dropped_dontcare: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    made_all: bool = False
    labeled: bool = True
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def table(self) -> str:
        objs = ", ".join(f"{n} {c}" for n, c in sorted(self.objects.items(), key=lambda kv: -kv[1])) or "none"
        text = (f"{self.frames} frames; objects: {objs}"
                + (f"; {self.dropped_dontcare} DontCare record(s) left out" if self.dropped_dontcare else ""))
        if self.skipped:
            ids = [i for i, _ in self.skipped]
            shown = ", ".join(ids[:20]) + (f", ... ({len(ids) - 20} more)" if len(ids) > 20 else "")
            text += (f"; skipped {len(ids)} bad frame(s) (skip_bad=true; left out of ImageSets too): {shown} "
                     f"(first: {self.skipped[0][1]})")
        return text

    def split_choice(self) -> tuple[str, str]:
        """(train split, val split) of the written image sets: ``train`` and ``val`` where they exist; else the
        first of ``trainval`` and ``all`` (or the first set) for training, and the training split for validation."""
        names = list(self.splits)
        train = next((s for s in ("train", "trainval", "all") if s in self.splits), names[0] if names else "train")
        return train, ("val" if "val" in self.splits else train)

    def commands(self) -> list[str]:
        """The lines that say what to run on the written root: the training and evaluation commands (their split
        overrides where the defaults ``train`` / ``val`` are not there), or prediction for an unlabeled root."""
        root = shlex.quote(str(self.root))
        lines = []
        if self.made_all:
            lines.append(f"the source has no ImageSets: ImageSets/all.txt lists all {self.splits.get('all', 0)} "
                         "frames, and no train/val split is made up: to validate on frames held out of training, "
                         f"write ImageSets/train.txt and val.txt into {root}")
        if not self.labeled:
            return [*lines, f"no labels: predict with python scripts/predict.py ckpt_path=CKPT input={root}/points"]
        train, val = self.split_choice()
        splits = ("" if train == "train" else f" data.train_split={train}") + \
                 ("" if val == "val" else f" data.val_split={val}")
        if train == val and not self.made_all:
            lines.append(f"no val split: validation runs on the training split '{train}'")
        lines.append(f"train: python scripts/train.py data=lidar data.root={root}{splits}")
        lines.append(f"evaluate (CKPT: the best checkpoint training prints): python scripts/evaluate.py "
                     f"ckpt_path=CKPT data=lidar data.root={root} split={val}")
        return lines


def convert_kitti_to_lidar(root: str | Path, out: str | Path, split_dir: str = "training",
                           fov_only: bool = False, skip_bad: bool = False) -> ConvertSummary:
    """Write the LiDAR-only form of the KITTI root ``root`` (its ``split_dir``) into ``out`` (absent or an empty
    folder): every frame of its image sets and every frame with a velodyne file. A bad frame is a
    :class:`KittiFormatError` naming its file (and nothing is written), or with ``skip_bad`` left out and named in
    the summary."""
    kroot = KittiRoot(root, split_dir)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KittiFormatError(out, "out= must be a new or empty folder (a conversion never writes into a dataset)")
    on_disk = {p.stem for p in (kroot.dir / "velodyne").glob("*.bin")}
    sets = {split: kroot.imageset(split) for split in kroot.splits()}
    listed_in = {}
    for split, members in sets.items():
        for i in members:
            listed_in.setdefault(i, split)
    ids = sorted(on_disk | set(listed_in))
    if not ids:
        raise KittiFormatError(kroot.dir / "velodyne", "no point clouds (*.bin) to convert")
    made_parents = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    summary = ConvertSummary(out, labeled=kroot.has_labels(), made_all=not sets)
    try:
        (tmp / "points").mkdir()
        (tmp / "ImageSets").mkdir()
        if summary.labeled:
            (tmp / "labels").mkdir()
        for fid in ids:
            try:
                if fid not in on_disk:
                    raise KittiFormatError(kroot.path("velodyne", fid), f"frame {fid} is listed in "
                                           f"ImageSets/{listed_in[fid]}.txt but has no point cloud")
                _convert_frame(kroot, fid, tmp, fov_only, summary)
            except KittiFormatError as e:
                if not skip_bad:
                    e.args = (f"{e}; {SKIP_HINT}",)
                    raise
                summary.skipped.append((fid, " ".join(str(e).split())))
        bad = {i for i, _ in summary.skipped}
        for split, members in (sets or {"all": ids}).items():
            kept = [i for i in members if i not in bad]
            if members and not kept:
                raise KittiFormatError(kroot.root / "ImageSets" / f"{split}.txt",
                                       f"every frame of split '{split}' is bad: nothing left to write "
                                       f"(first: {summary.skipped[0][1]})")
            write_imageset(tmp / "ImageSets" / f"{split}.txt", kept)
            summary.splits[split] = len(kept)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made_parents:  # innermost first
            try:
                p.rmdir()
            except OSError:
                break
        raise
    return summary


def _convert_frame(kroot: KittiRoot, fid: str, tmp: Path, fov_only: bool, summary: ConvertSummary) -> None:
    """Read one frame (every file checked before anything of it is written), write its points and labels, count its
    objects."""
    frame = kroot.read_frame(fid)
    points = frame.points
    if fov_only:
        points = points[in_camera_fov(points, frame.calib, frame.image_size or IMAGE_SIZE)]
    labels = None
    if summary.labeled:
        lab = frame.labels
        obj = lab.name != "DontCare"
        boxes = labels_to_boxes(lab.select(obj), frame.calib).tensor.double().numpy()
        labels = LidarLabels(boxes, lab.name[obj])
    write_points(tmp / "points" / f"{fid}.bin", points)
    if labels is not None:
        write_lidar_label(tmp / "labels" / f"{fid}.txt", labels)
        summary.dropped_dontcare += int((lab.name == "DontCare").sum())
        for n in labels.name:
            summary.objects[str(n)] = summary.objects.get(str(n), 0) + 1
    summary.frames += 1
