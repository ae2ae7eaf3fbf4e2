"""A checkpoint's detections and AP do not depend on how its sparse network is executed: ``scripts/evaluate.py`` and
``scripts/predict.py`` with ``block_size=8``, ``block_size=dense`` and ``block_size=32`` write the same result
files, the same AP and the same boxes - run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.eval import test_app as eval_app
from tests.paths import REPO

car_root = eval_app.car_root
predicted_ckpt = eval_app.predicted_ckpt

WAYS = [["block_size=8"], ["block_size=dense"], ["block_size=32"]]


@pytest.fixture(scope="module")
def masked_ckpt(predicted_ckpt, car_root, tmp_path_factory) -> Path:
    """predicted_ckpt with its mask net thresholded low enough that its mask covers part of each frame (a one-step
    mask net predicts nothing at the trained threshold: every way would then compute nothing alike), decoding every
    box down to score 0 (equal empty files would prove nothing)."""
    from detector.build import load_detector
    from detector.callbacks import load_checkpoint
    from detector.data.dataset import KittiDataset
    from detector.data.structures import collate_frames

    model, _ = load_detector(predicted_ckpt)
    model.eval()
    frames = [KittiDataset(car_root, "val")[i] for i in range(2)]
    with torch.no_grad():
        prob = torch.sigmoid(model.mask_net(model.voxelize(collate_frames(frames))))
    ckpt = load_checkpoint(predicted_ckpt)
    cfg = ckpt["hyper_parameters"]["config"]
    cfg["mask"]["net"]["threshold"] = float(prob.quantile(0.6))  # about 40 % of the mask net's cells on
    cfg["model"]["score_threshold"] = 0.0
    cfg["model"]["max_detections"] = 30
    path = tmp_path_factory.mktemp("masked") / "masked.ckpt"
    torch.save(ckpt, path)
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_evaluate_gives_the_same_detections_and_ap_every_way(masked_ckpt, car_root, tmp_path):
    runs = []
    for way in WAYS:
        out = tmp_path / "_".join(way).replace("=", "")
        _run("scripts/evaluate.py", f"ckpt_path={masked_ckpt}", "data=kitti", f"data.root={car_root}",
             f"paths.output_dir={out}", *way)
        metrics = json.loads((out / "metrics.json").read_text())
        files = {p.name: p.read_text() for p in sorted((out / "data").glob("*.txt"))}
        runs.append((way, metrics, files))
    _, m0, f0 = runs[0]
    sparsity = m0["_run"]["mean_sparsity"]
    assert 0.05 < sparsity < 0.95, f"the mask must cover part of the grid for this to prove anything: {sparsity}"
    assert sum(len(t.splitlines()) for t in f0.values()) >= 10 * len(f0)
    for way, metrics, files in runs[1:]:
        assert files == f0, f"{way}: other result files than block_size=8"
        assert {k: v for k, v in metrics.items() if k != "_run"} == {k: v for k, v in m0.items() if k != "_run"}, way
        assert metrics["_run"]["mean_sparsity"] == sparsity


def test_predict_gives_the_same_boxes_every_way(masked_ckpt, car_root, tmp_path):
    cloud = car_root / "training" / "velodyne" / "000003.bin"
    boxes = []
    for way in WAYS:
        out = tmp_path / "_".join(way).replace("=", "")
        _run("scripts/predict.py", f"ckpt_path={masked_ckpt}", f"input={cloud}", f"out={out}", "picture=none", *way)
        boxes.append(json.loads((out / "json" / "000003.json").read_text())["boxes"])
    assert len(boxes[0]) >= 10
    for way, b in zip(WAYS[1:], boxes[1:], strict=True):
        assert len(b) == len(boxes[0]) and [r["class"] for r in b] == [r["class"] for r in boxes[0]], way
        for r, r0 in zip(b, boxes[0], strict=True):
            # float32 agreement to 1e-4, each side rounded to the file's 4 decimals
            assert all(abs(r[k] - r0[k]) <= 2e-4 for k in r if k != "class"), (way, r, r0)
