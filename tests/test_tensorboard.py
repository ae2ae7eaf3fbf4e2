"""What validation shows in TensorBoard: the bird's-eye views of the same first validation frames every validation
(readable, with the computation mask), and per class a precision-recall curve made of the metric's own matching."""

from __future__ import annotations

import numpy as np

from detector.data.kitti_labels import KittiLabels
from detector.eval.kitti_metric import evaluate


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = next(folder.rglob("events.out.tfevents.*")).parent
    return EventAccumulator(str(folder), size_guidance={"images": 0, "tensors": 0}).Reload()  # 0: keep every event


def _cars(x: list[float], z: list[float], score: list[float] | None = None) -> KittiLabels:
    """Cars in the camera frame at (x, 1.6, z), 1.5 x 1.6 x 3.9 m, facing the camera's x; 100 px high, unoccluded,
    untruncated (counted at every KITTI difficulty)."""
    n = len(x)
    loc = np.stack([x, np.full(n, 1.6), z], axis=1)
    return KittiLabels(["Car"] * n, np.zeros(n), np.zeros(n), np.zeros(n), np.tile([100.0, 100, 200, 200], (n, 1)),
                       np.tile([1.5, 1.6, 3.9], (n, 1)), loc, np.zeros(n), None if score is None else np.asarray(score))


def test_pr_curve_is_the_metrics_matching(tmp_path):
    """Four labelled cars; three found exactly (scores 0.9, 0.8, 0.6) and one false positive elsewhere (0.7). The
    metric's thresholds are the true positives' scores; at 0.9: precision 1, recall 1/4; at 0.8: 1, 2/4; at 0.6:
    3/4 (the false positive counts), 3/4. TensorBoard gets them lowest threshold first."""
    from torch.utils.tensorboard import SummaryWriter

    from detector.module import log_pr_curves

    gt = _cars([-6, -2, 2, 6], [10, 15, 20, 25])
    dt = _cars([-6, -2, 2, 0], [10, 15, 20, 40], score=[0.9, 0.8, 0.6, 0.7])
    result = evaluate([gt], [dt], classes=["Car"])
    with SummaryWriter(str(tmp_path)) as writer:
        log_pr_curves(writer, result, ["Car"], "moderate", step=7)
    acc = _events(tmp_path)
    (event,) = acc.Tensors("val/pr_Car_bev_moderate")
    assert event.step == 7
    tp, fp, tn, fn, precision, recall = np.asarray(event.tensor_proto.float_val).reshape(6, -1)
    np.testing.assert_allclose(precision, [0.75, 1, 1])
    np.testing.assert_allclose(recall, [0.75, 0.5, 0.25])
    np.testing.assert_array_equal(tp, [3, 2, 1])
    np.testing.assert_array_equal(fp, [1, 0, 0])
    np.testing.assert_array_equal(fn, [1, 2, 3])


def test_validation_logs_the_same_frames_and_their_masks(tmp_path, tiny_root):
    """Two validations of the first 3 frames of the val split (here the 5 training frames, 2 a batch): each frame
    gets its own picture at each validation (the sanity check logs none), at least 800 px wide, the road-map mask
    shaded."""
    from detector.tasks import train
    from detector.viz import MASK_COLOR
    from tests.test_train import _cfg

    cfg = _cfg(tmp_path, tiny_root, "mask=road_map", "val_images=3", "data.val_split=train",
               "trainer.max_epochs=2", "trainer.limit_train_batches=1", "trainer.check_val_every_n_epoch=1",
               "callbacks.model_checkpoint.monitor=null", "evaluate_after=false")
    train(cfg)
    acc = _events(tmp_path / "tensorboard")
    first = (tiny_root / "ImageSets" / "train.txt").read_text().split()[:3]
    tags = sorted(t for t in acc.Tags()["images"] if t.startswith("val/bev"))
    assert tags == [f"val/bev/{i}" for i in first], tags
    import open3d as o3d

    for tag in tags:
        events = acc.Images(tag)
        assert [e.step for e in events] == [1, 2]
        png = tmp_path / "img.png"
        png.write_bytes(events[-1].encoded_image_string)
        img = np.asarray(o3d.io.read_image(str(png)))
        assert img.shape[1] >= 800 and (img == np.asarray(MASK_COLOR, np.uint8)).all(-1).any()
