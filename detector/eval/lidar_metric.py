"""Evaluation of LiDAR-only datasets: BEV and 3D AP (R40 and R11) per class, overall and by distance band.

    result = evaluate_lidar(gt_frames, det_frames, min_overlap={"Car": 0.7, "Truck": 0.7})
    result.ap("Truck", "bev", "overall")            # R40, in percent; also "0-30", "30-50", "50+"
    print(lidar_table(result))

The rule is :mod:`detector.eval.protocol`'s L1-L4. The matching and the AP are the KITTI metric's
(:func:`detector.eval.kitti_metric.evaluate`): the boxes enter as its records in a camera-like geometry
(:func:`metric_records`, an axis rotation that keeps every overlap and distance), at the one level
:data:`~detector.eval.protocol.OVERALL` plus the distance bands.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from detector.data.kitti_labels import KittiLabels
from detector.data.lidar_labels import LidarLabels
from detector.errors import ConfigError
from detector.eval.kitti_metric import POINTS, KittiResult, evaluate
from detector.eval.protocol import DISTANCE_RANGES, LIDAR_METRICS, MIN_OVERLAP, OVERALL


def metric_records(labels: LidarLabels) -> KittiLabels:
    """LiDAR-frame boxes as the KITTI metric's records (L4): location (−y, −(z − dz/2), x) (the bottom centre),
    dimensions (dz, dy, dx), rotation_y −heading − π/2; an empty 2D box, truncation and occlusion 0, alpha 0."""
    b = labels.boxes
    n = len(labels)
    loc = np.stack([-b[:, 1], -(b[:, 2] - b[:, 5] / 2), b[:, 0]], axis=1) if n else np.zeros((0, 3))
    z = np.zeros(n)
    return KittiLabels(labels.name, z, z, z, np.zeros((n, 4)), b[:, [5, 4, 3]], loc, -b[:, 6] - np.pi / 2,
                       labels.score)


def missing_overlaps(classes: Sequence[str], configured: Mapping[str, float | None] | None) -> list[str]:
    """The classes without a minimum IoU in ``configured`` (``data.classes``; None: KITTI's,
    :data:`~detector.eval.protocol.MIN_OVERLAP`; a null value gives none)."""
    overlaps = MIN_OVERLAP if configured is None else configured
    return [c for c in classes if overlaps.get(c) is None]


def overlap_overrides(missing: Sequence[str], configured: Mapping[str, float | None] | None) -> list[str]:
    """The command-line overrides that give each class of ``missing`` a minimum IoU (0.7, the strictest KITTI
    uses, as the example): ``+data.classes.<name>=0.7`` where the key is new (Hydra refuses a new key without ``+``),
    without ``+`` where ``data.classes`` holds it (null); where ``data.classes`` is null (KITTI's three in use) the
    whole mapping, KITTI's three kept, as the classes it names are then the only known ones."""
    if configured is None:
        items = {**MIN_OVERLAP, **dict.fromkeys(missing, 0.7)}
        return ["'data.classes={" + ",".join(f"{c}:{v}" for c, v in items.items()) + "}'"]
    return [f"{'' if c in configured else '+'}data.classes.{c}=0.7" for c in missing]


def missing_overlap_message(missing: Sequence[str], configured: Mapping[str, float | None] | None) -> str:
    """The error of classes scored without a minimum IoU: what ``data.classes`` has, and the overrides that add
    theirs (:func:`overlap_overrides`)."""
    has = ", ".join(MIN_OVERLAP if configured is None else configured) or "none"
    return (f"data.classes has no minimum IoU for class(es) {', '.join(missing)} (it has {has}): add "
            f"{' '.join(overlap_overrides(missing, configured))}")


def evaluate_lidar(
    gt: Sequence[LidarLabels],
    dt: Sequence[LidarLabels],
    min_overlap: Mapping[str, float],
    classes: Sequence[str] | None = None,
    distance_ranges: Sequence[tuple[float, float]] | None = DISTANCE_RANGES,
) -> KittiResult:
    """Score detections ``dt`` (with scores) against ground truth ``gt``, one per frame in the same order.
    ``min_overlap``: {class: minimum IoU}; ``classes`` (default: its keys) the classes scored, each must have
    one (else a :class:`ConfigError` naming ``data.classes``)."""
    classes = tuple(classes if classes is not None else min_overlap)
    if missing := missing_overlaps(classes, min_overlap):
        raise ConfigError(missing_overlap_message(missing, min_overlap))
    return evaluate([metric_records(g) for g in gt], [metric_records(d) for d in dt], classes=classes,
                    metrics=LIDAR_METRICS, distance_ranges=distance_ranges,
                    min_overlap={c: float(min_overlap[c]) for c in classes}, levels=(OVERALL,))


def lidar_table(result: KittiResult) -> str:
    """Per class and metric: AP R40 and R11 overall and by distance band, with the counted GT."""
    bands = (*result.levels, *result.distance_levels)
    lines = [f"{'class':<14}{'IoU>':>6}{'metric':>8}{'AP':>5}" + "".join(f"{b:>10}" for b in bands)]
    for c, cls in enumerate(result.classes):
        for m in result.metrics:
            for p in POINTS:
                vals = "".join(f"{result.ap(cls, m, b, p):>10.2f}" for b in bands)
                lines.append(f"{cls:<14}{result.min_overlap[c]:>6.2f}{m:>8}{p:>5}{vals}")
        n_gt = [*result.num_gt[c], *(result.distance_num_gt[c] if result.distance_levels else [])]
        lines.append(f"{'':<14}{'':>6}{'#GT':>8}{'':>5}" + "".join(f"{int(n):>10d}" for n in n_gt))
    return "\n".join(lines)
