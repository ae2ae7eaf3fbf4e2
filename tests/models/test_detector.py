"""The detector: target encoding/decoding, rotated NMS, sparse vs dense twin, overfitting one frame."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from detector.data.structures import Batch, collate_frames
from detector.geometry.boxes import Boxes3D
from detector.geometry.iou import bev_iou
from detector.geometry.voxelize import BevGrid
from detector.models.detector import BevDetector
from detector.models.mask_net import MaskNet
from detector.models.mask_schedule import MaskSchedule
from detector.models.nms import rotated_nms
from detector.models.targets import BoxCoder
from detector.nn.resnet import SparseResNet

GRID = BevGrid((0.0, 25.6), (-12.8, 12.8), (-2.5, 1.0), 0.2, 0.5)


def _boxes():
    return Boxes3D(torch.tensor([
        [8.0, 2.0, -0.9, 4.0, 1.7, 1.5, 0.4],
        [18.0, -5.0, -0.8, 3.8, 1.6, 1.45, -2.0],
        [12.0, 8.0, -0.8, 0.8, 0.6, 1.7, 3.0],
        [9.0, 5.5, -0.6, 5.0, 1.9, 2.1, 0.4],       # a Van: ignored for Car
        [30.0, 0.0, -0.9, 4.0, 1.7, 1.5, 0.0],      # outside the grid: no target
    ]))


NAMES = np.array(["Car", "Car", "Pedestrian", "Van", "Car"])


def test_targets_decode_back_to_the_boxes():
    coder = BoxCoder(["Car", "Pedestrian"])
    out = GRID.downsampled(4)
    t = coder.encode([_boxes(), _boxes()[1:2]], [NAMES, NAMES[1:2]], out)
    # every box inside the grid has positives of its class; the Van and the far car none
    assert t.heatmap[0, 0].sum() > 0 and t.heatmap[0, 1].sum() > 0 and t.heatmap[1].sum() > 0
    assert not (t.ignore & (t.heatmap > 0)).any()
    # the Van's footprint is ignored for Car and not a positive
    r, c = out.world_to_cell(torch.tensor(9.0), torch.tensor(5.5))
    assert t.ignore[0, 0, r, c] and t.heatmap[0, 0, r, c] == 0
    for b, boxes in ((0, _boxes()[:3]), (1, _boxes()[1:2])):
        rows, cols = torch.nonzero(t.positive[b], as_tuple=True)
        px, py = out.cell_center(rows, cols)
        cls = t.heatmap[b, :, rows, cols].argmax(0)
        dec = coder.decode_boxes(t.regression[b, :, rows, cols].T, cls, px, py)
        # every decoded box is one of the frame's boxes (up to float rounding), and each box appears
        d = (dec[:, None, :6] - boxes.tensor[None, :, :6]).abs().amax(-1)
        dyaw = torch.remainder(dec[:, None, 6] - boxes.tensor[None, :, 6] + math.pi, 2 * math.pi) - math.pi
        match = (d < 1e-4) & (dyaw.abs() < 1e-5)
        assert match.any(1).all() and match.any(0).all()


def test_decode_of_perfect_maps_gives_one_box_per_object():
    coder = BoxCoder(["Car", "Pedestrian"])
    out = GRID.downsampled(4)
    boxes = _boxes()
    t = coder.encode([boxes], [NAMES], out)
    logits = torch.where(t.heatmap > 0, 6.0, -6.0)
    dets = coder.decode(logits, t.regression, out, score_threshold=0.5, nms_iou=0.1)[0]
    assert len(dets) == 3
    iou = bev_iou(dets.boxes.bev().double().numpy(), boxes[:3].bev().double().numpy())
    assert (iou.max(1) > 0.999).all()
    assert sorted(dets.labels.tolist()) == [0, 0, 1]


def _brute_force_nms(boxes, scores, labels, thr):
    order = sorted(range(len(boxes)), key=lambda i: (-float(scores[i]), i))
    keep = []
    for i in order:
        ok = True
        for j in keep:
            if labels[i] == labels[j]:
                iou = bev_iou(boxes[i:i + 1, [0, 1, 3, 4, 6]], boxes[j:j + 1, [0, 1, 3, 4, 6]])[0, 0]
                if iou > thr:
                    ok = False
                    break
        if ok:
            keep.append(i)
    return keep


@pytest.mark.parametrize("thr", [0.0, 0.1, 0.5])
def test_rotated_nms_matches_brute_force(thr):
    rng = np.random.default_rng(3)
    n = 80
    t = np.column_stack([rng.uniform(0, 12, n), rng.uniform(0, 12, n), np.zeros(n), rng.uniform(1, 5, n),
                         rng.uniform(0.5, 2, n), np.ones(n), rng.uniform(-np.pi, np.pi, n)])
    scores = rng.random(n)
    scores[5] = scores[6]  # a tie: the lower index wins
    labels = rng.integers(0, 2, n)
    keep = rotated_nms(torch.from_numpy(t), torch.from_numpy(scores), torch.from_numpy(labels), thr)
    assert keep.tolist() == _brute_force_nms(t, scores, labels, thr)


def _model(mask_net=None, block=8, head_block=16) -> BevDetector:
    torch.manual_seed(0)
    backbone = SparseResNet(GRID.C, stem_channels=8, stage_units=(1, 1, 1), stage_channels=(8, 12, 16),
                            stage_strides=(2, 2, 2), bottleneck=False, block_size=block)
    schedule = None if mask_net is None else MaskSchedule(train_source="union", warmup_steps=0, train_threshold=None,
                                                           train_threshold_steps=0, union_dilation_m=None)
    return BevDetector(GRID, backbone=backbone, coder=BoxCoder(["Car"]), neck_channels=8, head_channels=8,
                       out_stride=4, head_block_size=head_block, mask_dilation_m=2.0, sparse=True, mask_net=mask_net,
                       mask_schedule=schedule)


def _batch(n=2, seed=0) -> Batch:
    """Random points with some structure (a few dense clusters), n frames."""
    from detector.data.kitti_calib import Calibration
    from detector.data.structures import Frame
    from tests.conftest import make_calib

    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        pts = np.column_stack([rng.uniform(0, 25.6, 3000), rng.uniform(-12.8, 12.8, 3000),
                               rng.uniform(-2.4, 0.9, 3000), rng.random(3000)]).astype(np.float32)
        boxes = _boxes()[:3]
        frames.append(Frame(f"{i:06d}", pts, make_calib(), boxes, NAMES[:3].copy()))
    assert isinstance(frames[0].calib, Calibration)
    return collate_frames(frames)


def test_sparse_and_dense_twin_agree_with_all_ones_mask():
    model = _model().eval()
    batch = _batch()
    with torch.no_grad():
        dense = model(batch)
        batch.mask = torch.ones(2, 1, GRID.H, GRID.W)
        sparse = model(batch)
    torch.testing.assert_close(sparse.heatmap, dense.heatmap, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sparse.regression, dense.regression, rtol=1e-4, atol=1e-4)


def test_sparse_equals_dense_where_the_receptive_field_is_active():
    """With a road-like mask (an active band), head outputs whose receptive field lies inside the mask equal the
    dense twin's (every feature they read lies in the mask, where the units compute what the dense twin does); cells
    whose dense output moves under none of three random changes of the input outside the mask are those."""
    model = _model().eval()
    batch = _batch(1)
    mask = torch.zeros(1, 1, GRID.H, GRID.W)
    mask[..., 16:112, :] = 1.0  # |y| < 9.6 m: a road along x
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        bev = model.voxelize(batch)
        dense = model(batch, bev=bev)
        safe = torch.ones_like(dense.heatmap[:, 0], dtype=torch.bool)
        for _ in range(3):  # both signs, so that a unit dead (ReLU) under one change is alive under another
            noisy = bev.clone()
            out = mask[0, 0] == 0
            noisy[..., out] += 3 * torch.randn(noisy[..., out].shape, generator=g)
            safe &= (model(batch, bev=noisy).heatmap - dense.heatmap).abs().amax(1) == 0
        batch.mask = mask
        sparse = model(batch, bev=bev)
    assert safe.sum() > 0.05 * safe.numel()
    diff = (sparse.heatmap - dense.heatmap).abs().amax(1)
    assert diff[safe].max() < 1e-4
    rdiff = (sparse.regression - dense.regression).abs().amax(1)
    assert rdiff[safe].max() < 1e-4
    assert abs(sparse.sparsity - (1 - mask.mean().item())) < 1e-6


def test_predicted_mask_path_trains():
    """The mask net learns from its own loss only (the thresholded mask it predicts passes no gradient to
    the detection outputs); the detection loss trains the backbone through the sparse blocks."""
    model = _model(mask_net=MaskNet(GRID.C, downsample=4, channels=8, num_convs=2)).train()
    batch = _batch()
    out = model(batch)
    assert out.mask is not None and 0.0 < out.sparsity < 1.0
    mask_params = list(model.mask_net.parameters())
    through_detection = torch.autograd.grad(out.heatmap.sum() + out.regression.sum(), mask_params,
                                            retain_graph=True, allow_unused=True)
    assert all(g is None or g.abs().max() == 0 for g in through_detection)
    loss, logs = model.loss(out, batch)
    assert "loss/mask" in logs and torch.isfinite(loss) and logs["loss/mask"] > 0
    loss.backward()
    for name, p in [*model.mask_net.named_parameters(), *model.backbone.named_parameters()]:
        if p.requires_grad and name.endswith("weight") and p.dim() == 4:  # every conv learns
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def test_object_mask_covers_the_detected_classes_only():
    """The mask net's target and the training mask's ground-truth part are the cells of the boxes of the
    classes the detector finds (here Car), enlarged by mask_dilation_m: a Pedestrian and a Van are left out
    (GT sampling pastes such objects too, and computing for them only costs tiles)."""
    from detector.data.kitti_calib import Calibration  # noqa: F401  (Frame's calib type)
    from detector.data.structures import Frame
    from tests.conftest import make_calib

    boxes = _boxes()[:4]  # Car, Car, Pedestrian, Van
    frame = Frame("000000", np.zeros((0, 4), np.float32), make_calib(), boxes, NAMES[:4].copy())
    batch = collate_frames([frame])
    model = _model(mask_net=MaskNet(GRID.C, downsample=4, channels=8, num_convs=2))
    model.mask_dilation_m = 0.0
    mask = model.object_mask(batch, downsample=1)[0, 0]

    def cell(x, y):  # the grid cell holding the point (x, y)
        return int((y - GRID.y_range[0]) / GRID.resolution), int((x - GRID.x_range[0]) / GRID.resolution)

    assert mask[cell(8.0, 2.0)] == 1 and mask[cell(18.0, -5.0)] == 1  # the Cars' centres
    assert mask[cell(12.0, 8.0)] == 0  # the Pedestrian's centre
    assert mask[cell(9.0 + 2.3 * math.cos(0.4), 5.5 + 2.3 * math.sin(0.4))] == 0  # in the Van, outside the Cars
    # a Car's cells: its 4.0 x 1.7 m rectangle holds about 4.0 * 1.7 / 0.2^2 = 170 cells (the two Cars, no more)
    assert 2 * 150 < int(mask.sum()) < 2 * 190
    model.mask_dilation_m = 1.0  # enlarged by 1 m on every side: (4 + 2) x (1.7 + 2) m per Car
    grown = model.object_mask(batch, downsample=1)[0, 0]
    assert 2 * 500 < int(grown.sum()) < 2 * 610 and bool((grown >= mask).all())


@pytest.fixture(scope="module")
def sim_frame():
    from detector.data.kitti_camera import labels_to_boxes
    from detector.data.structures import Frame
    from detector.sim import LidarSpec, simulate_frame

    f = simulate_frame(seed=5, index=3, spec=LidarSpec(columns=1024))  # half the azimuth steps: a small frame
    lab = f.labels.labels
    obj = lab.name != "DontCare"
    boxes = Boxes3D(labels_to_boxes(lab.select(obj), f.calib).tensor.float())
    return Frame("000003", f.scan.points, f.calib, boxes, lab.name[obj], lab)


def test_overfit_one_simulated_frame(sim_frame):
    """The loss falls while overfitting one frame, and the decoded cars then match the labeled cars in
    the grid with BEV IoU > 0.7."""
    torch.manual_seed(0)
    backbone = SparseResNet(GRID.C, stem_channels=16, stage_units=(1, 1, 1), stage_channels=(24, 32, 48),
                            stage_strides=(2, 2, 2), bottleneck=False, block_size=16)
    model = BevDetector(GRID, backbone=backbone, coder=BoxCoder(["Car"]), neck_channels=32, head_channels=32,
                        out_stride=4, head_block_size=16, mask_dilation_m=2.0, sparse=True)
    batch = collate_frames([sim_frame])
    cars = sim_frame.gt_boxes[torch.from_numpy(sim_frame.gt_names == "Car")]
    c = cars.tensor
    inside = (c[:, 0] > 1) & (c[:, 0] < 24.6) & (c[:, 1].abs() < 11.8)
    cars = cars[inside]
    assert len(cars) >= 2, "the test frame should hold cars in the small grid"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    bev = model.voxelize(batch)
    losses = []
    model.train()
    for _ in range(60):
        out = model(batch, bev=bev)
        loss, _ = model.loss(out, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < 0.3 * np.mean(losses[:5])
    model.eval()
    with torch.no_grad():
        dets = model.decode(model(batch, bev=bev), score_threshold=0.3)[0]
    iou = bev_iou(cars.bev().double().numpy(), dets.boxes.bev().double().numpy())
    assert len(dets) > 0 and (iou.max(1) > 0.7).all(), iou.max(1)


def test_neck_and_head_run_sparse_given_a_mask():
    """With a mask, the 1/4-resolution neck conv and the head tower compute the mask's pixels only (the mask
    max-pooled to their resolution): their outputs are zero everywhere else and not in the mask; without a mask
    (the dense twin) they run everywhere."""
    model = _model(head_block=8).eval()
    batch = _batch(1)
    mask = torch.zeros(1, 1, GRID.H, GRID.W)
    mask[..., 40:72, 40:72] = 1.0  # one 3.2 m square: rows/cols 10..17 at 1/4
    seen = {}
    model.head.tower.register_forward_hook(lambda m, i, o: seen.__setitem__("tower", o))
    model.neck.smooth[0].register_forward_hook(lambda m, i, o: seen.__setitem__("neck", o))
    with torch.no_grad():
        model(batch)
        dense_tower, dense_neck = seen["tower"].clone(), seen["neck"].clone()
        batch.mask = mask
        model(batch)
    h, w = dense_tower.shape[-2:]
    inside = torch.zeros(h, w, dtype=torch.bool)
    inside[10:18, 10:18] = True
    for name, dense in (("tower", dense_tower), ("neck", dense_neck)):
        out = seen[name]
        assert out[..., ~inside].abs().max() == 0, name
        assert (out[..., inside].abs().amax((0, 1)) > 0).float().mean() > 0.5, name  # computed in the mask
        assert dense[..., ~inside].abs().max() > 0, name  # the dense twin computes everywhere
