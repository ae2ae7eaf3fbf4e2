"""KITTI-format folders for evaluation: read a label folder and a result folder into paired frames, and
write predictions as result files.

A result file is a label file whose lines carry a 16th field, the score (``write_label`` of
``boxes_to_labels(..., scores=...)`` writes them). Pairing rules:

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
from detector.errors import KittiFormatError


@dataclass
class EvalInputs:
    """Paired frames read from disk."""

    frame_ids: list[str]
    gt: list[KittiLabels]
    dt: list[KittiLabels]
    missing_results: list[str]  # frames evaluated as "no detections" because their result file is missing
    unused_results: list[str]  # result files of labeled frames that are not in the split


def _txt_ids(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.txt") if p.is_file()}


def load_eval_inputs(
    gt_dir: str | Path, results_dir: str | Path, split: str | Path | None = None
) -> EvalInputs:
    """Read the label and result files of the frames to evaluate (see the module docstring for the
    rules). Raises :class:`KittiFormatError` naming the file (and line) on any bad or missing file."""
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
    ids = read_imageset(split) if split is not None else sorted(labeled)
    if not ids:
        raise KittiFormatError(split if split is not None else gt_dir, "no frames to evaluate")
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
