"""Evaluation folders: read a label folder and a result folder into paired frames, and write predictions as
result files.

Two layouts, as evaluation writes them (``eval/label_2``, ``eval/data``): KITTI's (a label line has 15 fields, a
result line a 16th, the score: ``write_label`` of ``boxes_to_labels(..., scores=...)``), and the LiDAR-only one
(:mod:`detector.data.lidar_labels`: ``x y z dx dy dz heading class``, a ninth field the score).
:func:`detect_layout` tells them apart by the field count of the first line of the folders. Pairing rules (both):

- The frames are those of ``split`` (an ImageSets-style file of ids) or, without one, every ``*.txt`` in
  the label folder. A listed frame without a label file is an error.
- A frame with a label file but no result file is evaluated as a frame without detections and counted
  in ``EvalInputs.missing_results`` (the CLI prints a warning with the count).
- A result file whose frame has no label file is an error (it means the folders do not belong together).
  Result files of labeled frames outside the split are not used and are counted in ``unused_results``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from detector.data.kitti import read_imageset
from detector.data.kitti_batch import read_labels
from detector.data.kitti_labels import KittiLabels, write_label
from detector.data.lidar import read_split_ids
from detector.data.lidar_labels import LidarLabels, read_lidar_label
from detector.errors import ConfigError, KittiFormatError

LAYOUTS = ("auto", "kitti", "lidar")
# fields of a line: (label, result) files
FIELDS = {"kitti": (15, 16), "lidar": (8, 9)}


@dataclass
class EvalInputs:
    """Paired frames read from disk."""

    frame_ids: list[str]
    gt: list[KittiLabels] | list[LidarLabels]
    dt: list[KittiLabels] | list[LidarLabels]
    missing_results: list[str]  # frames evaluated as "no detections" because their result file is missing
    unused_results: list[str]  # result files of labeled frames that are not in the split


def _txt_ids(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.txt") if p.is_file()}


def _first_line_fields(folder: Path) -> tuple[Path, int] | None:
    """The first ``*.txt`` file of ``folder`` (by name) with a non-blank line, and that line's field count."""
    for path in sorted(p for p in folder.glob("*.txt") if p.is_file()):
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.split():
                        return path, len(line.split())
        except OSError:
            continue
    return None


def detect_layout(gt_dir: str | Path, results_dir: str | Path) -> str:
    """``kitti`` or ``lidar``: the layout whose field count the first line of the label folder (15 or 8) and of the
    result folder (16 or 9) has; ``kitti`` where every file is empty. Folders of different layouts are a
    :class:`KittiFormatError` naming a file of each; a count of neither layout is left to the reader's error."""
    found = {}
    for folder, which in ((Path(gt_dir), 0), (Path(results_dir), 1)):
        first = _first_line_fields(folder) if folder.is_dir() else None
        if first is not None:
            layout = next((k for k, v in FIELDS.items() if v[which] == first[1]), None)
            if layout is not None:
                found[which] = (layout, first)
    if len({lay for lay, _ in found.values()}) > 1:
        (g, (gp, gn)), (r, (rp, rn)) = found[0], found[1]
        raise KittiFormatError(rp, f"a {'LiDAR-only' if r == 'lidar' else 'KITTI'} result file ({rn} fields a "
                               f"line) beside {'LiDAR-only' if g == 'lidar' else 'KITTI'} label files ({gp}: "
                               f"{gn} fields): are the label and result folders from the same evaluation?")
    return next(iter(found.values()))[0] if found else "kitti"


def load_eval_inputs(
    gt_dir: str | Path, results_dir: str | Path, split: str | Path | None = None, layout: str = "kitti"
) -> EvalInputs:
    """Read the label and result files of the frames to evaluate (see the module docstring for the rules), in
    ``layout`` (``kitti``, ``lidar`` or ``auto``: :func:`detect_layout`). Raises :class:`KittiFormatError` naming
    the file (and line) on any bad or missing file."""
    if layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r}: choose {', '.join(LAYOUTS)}")
    if layout == "auto":
        layout = detect_layout(gt_dir, results_dir)
    gt_dir, results_dir = Path(gt_dir), Path(results_dir)
    if not gt_dir.is_dir():
        raise KittiFormatError(gt_dir, "label folder not found")
    if not results_dir.is_dir():
        raise KittiFormatError(results_dir, "result folder not found")
    labeled = _txt_ids(gt_dir)
    results = _txt_ids(results_dir)
    orphans = sorted(results - labeled)
    if orphans:
        shown = ", ".join(orphans[:5]) + (", ..." if len(orphans) > 5 else "")
        raise KittiFormatError(
            results_dir / f"{orphans[0]}.txt",
            f"{len(orphans)} result file(s) have no label file in {gt_dir} (frames {shown}); "
            "are the label and result folders from the same split?",
        )
    lidar = layout == "lidar"
    ids = (read_split_ids(Path(split)) if lidar else read_imageset(split)) if split is not None else sorted(labeled)
    if not ids:
        raise KittiFormatError(split if split is not None else gt_dir, "no frames to evaluate")
    if lidar:
        gts = [read_lidar_label(gt_dir / f"{i}.txt", with_score=False) for i in ids]
        dts = [read_lidar_label(results_dir / f"{i}.txt", with_score=True) if i in results
               else LidarLabels.empty(with_score=True) for i in ids]
    else:
        gts = read_labels([gt_dir / f"{i}.txt" for i in ids], with_score=False)
        found = read_labels([results_dir / f"{i}.txt" for i in ids if i in results], with_score=True)[::-1]
        dts = [found.pop() if i in results else KittiLabels.empty(with_score=True) for i in ids]
    missing = [i for i in ids if i not in results]
    unused = sorted(results - set(ids))
    return EvalInputs(list(ids), gts, dts, missing, unused)


def write_results(
    results_dir: str | Path, frame_ids: Sequence[str], detections: Sequence[KittiLabels]
) -> None:
    """Write one result file per frame (``{id}.txt``; an empty file for a frame without detections).
    Each ``KittiLabels`` must carry scores (e.g. from ``boxes_to_labels(boxes, names, calib, scores)``)."""
    if len(frame_ids) != len(detections):
        raise ValueError(f"{len(frame_ids)} frame ids but {len(detections)} detection sets")
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i, det in zip(frame_ids, detections, strict=True):
        if det.score is None:
            raise ValueError(f"frame {i}: result files need scores (KittiLabels.score is None)")
        write_label(out / f"{i}.txt", det)
