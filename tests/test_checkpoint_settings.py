"""Your own data, end to end: a LiDAR-only root with a class the project has never seen (Forklift), trained and then
evaluated, predicted and inspected the way a user runs the commands (subprocesses). Evaluation takes the data
settings the checkpoint trained with (root, layout, classes and their IoUs, its own val split), the command line's
overrides win; the fixes the error messages suggest work; splits that share frames are a warning; the evaluation's
console says what it evaluated and what to check when it found nothing. One tiny training serves every test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from detector.callbacks import load_checkpoint
from detector.data.convert import convert_kitti_to_lidar
from tests.paths import REPO
from tests.test_train import TINY

FORKLIFT_ANCHOR = "[5.0,2.0,1.9,-0.8]"
# the overrides the missing-settings error suggests, with the anchor's numbers filled in
FIXES = [f"+model.coder.anchors.Forklift={FORKLIFT_ANCHOR}", "+data.classes.Forklift=0.7"]
TRAIN = ["data=lidar", "model.classes=[Car,Forklift]", "data.val_split=holdout", *TINY, "logger=none"]


def _run(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _ids(path: Path) -> list[str]:
    return path.read_text().split()


@pytest.fixture(scope="module")
def lidar_root(tiny_root, tmp_path_factory) -> Path:
    """The tiny simulated root converted to a LiDAR-only one, its Vans renamed Forklift; ``holdout`` (the val split
    training is told to use) and ``val`` each hold the val frame plus one training frame."""
    root = tmp_path_factory.mktemp("forklift") / "lidar"
    convert_kitti_to_lidar(tiny_root, root, fov_only=True)
    for p in (root / "labels").glob("*.txt"):
        p.write_text(re.sub(r" Van$", " Forklift", p.read_text(), flags=re.M))
    train, val = _ids(root / "ImageSets" / "train.txt"), _ids(root / "ImageSets" / "val.txt")
    (root / "ImageSets" / "holdout.txt").write_text("".join(f"{i}\n" for i in [*val, train[0]]))
    (root / "ImageSets" / "val.txt").write_text("".join(f"{i}\n" for i in [*val, train[1]]))
    assert "Forklift" in "".join(p.read_text() for p in (root / "labels").glob("*.txt"))
    return root


@pytest.fixture(scope="module")
def forklift_run(lidar_root, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``scripts/train.py data=lidar model.classes=[Car,Forklift]`` with the two overrides the error message of
    :func:`test_missing_anchor_and_iou_are_one_error_before_any_work` suggests: (run folder, the finished run)."""
    out = tmp_path_factory.mktemp("forklift_run") / "run"
    run = _run("scripts/train.py", *TRAIN, *FIXES, f"data.root={lidar_root}", f"paths.output_dir={out}")
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run


def _ckpt(out: Path) -> Path:
    return out / "checkpoints" / "last.ckpt"


def _variant(ckpt: Path, path: Path, data: dict | None = None, model: dict | None = None) -> Path:
    """The checkpoint with its saved data / model settings changed (its weights as they are): as if it had trained
    with them."""
    state = load_checkpoint(ckpt)
    saved = state["hyper_parameters"]["config"]
    saved["data"].update(data or {})
    saved["model"].update(model or {})
    torch.save(state, path)
    return path


def _one_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    return errors[0]


def _hint_line(text: str) -> str:
    hints = [line for line in text.splitlines() if line.startswith("hint:")]
    assert len(hints) == 1, text[-3000:]
    return hints[0]


# --- the class settings a new class needs --------------------------------------------------------------------
def test_missing_anchor_and_iou_are_one_error_before_any_work(lidar_root, tmp_path):
    """A new class without an anchor and without a minimum IoU: one line names both, with overrides Hydra accepts
    (``+`` for the new keys: without it Hydra answers "Could not override ... use +"), before the run folder is
    made; the fixture's run, given exactly those overrides, trains."""
    out = tmp_path / "run"
    line = _one_error(_run("scripts/train.py", *TRAIN, f"data.root={lidar_root}", f"paths.output_dir={out}"))
    assert "model.coder.anchors" in line and "data.classes" in line, line
    suggested = re.findall(r"(\+\S+=\S+)", line)
    assert [s.replace("[l,w,h,z]", FORKLIFT_ANCHOR) for s in suggested] == FIXES, line
    assert not out.exists()


def test_training_warns_of_shared_frames_and_hints_at_an_evaluation_that_found_nothing(forklift_run):
    """Train and val splits that share a frame: one warning naming it. The evaluation after training is headed as
    what it is (LiDAR-only: no DontCare, no difficulty levels) and, having found nothing after two steps, says
    what to check in one line."""
    out, run = forklift_run
    text = run.stdout + run.stderr
    shared = [line for line in text.splitlines() if "splits 'train' and 'holdout' share 1 frame(s) (" in line]
    assert len(shared) == 1, text[-3000:]
    assert "LiDAR-only evaluation of" in run.stdout and "KITTI evaluation" not in run.stdout
    assert "DontCare kept" not in run.stdout
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    _assert_found_nothing_hint(run.stdout, metrics)


def _assert_found_nothing_hint(stdout: str, metrics: dict) -> None:
    """The one hint line of an evaluation whose APs are all 0: about the mask where it was empty."""
    aps = [v for cls in ("Car", "Forklift") for m in metrics[cls].values() for r in m.values() for v in r.values()]
    assert aps and not any(aps)
    hint = _hint_line(stdout)
    if metrics["_run"]["mean_sparsity"] >= 0.999:
        assert "computation mask was empty (mean sparsity 1.000" in hint and "mask=none" in hint, hint
    else:
        assert "every AP is 0" in hint and "step 2" in hint, hint


# --- evaluation takes the checkpoint's data settings ------------------------------------------------------------
def test_evaluate_scores_the_checkpoint_val_split_with_its_classes(forklift_run, lidar_root, tmp_path):
    """``scripts/evaluate.py ckpt_path=...`` alone: the split the checkpoint validated on (holdout, not val) of the
    LiDAR-only root it trained on, its Forklift scored at the IoU it trained with - the same numbers as the
    evaluation after training -, the split printed, and its frame shared with the training split a warning."""
    out, _ = forklift_run
    ev = tmp_path / "ev"
    r = _run("scripts/evaluate.py", f"ckpt_path={_ckpt(out)}", f"paths.output_dir={ev}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"evaluating split 'holdout' of {lidar_root} (layout lidar)" in r.stdout
    train0 = _ids(lidar_root / "ImageSets" / "train.txt")[0]
    text = r.stdout + r.stderr
    assert f"splits 'train' and 'holdout' share 1 frame(s) ({train0})" in text, text[-3000:]
    got, trained = (json.loads(p.read_text()) for p in (ev / "metrics.json", out / "eval" / "metrics.json"))
    assert got["_run"]["frames"] == 2
    assert {k: got[k] for k in ("Car", "Forklift")} == {k: trained[k] for k in ("Car", "Forklift")}
    assert "Forklift        0.70" in r.stdout
    assert "LiDAR-only evaluation of" in r.stdout and "DontCare kept" not in r.stdout


def test_evaluate_command_line_beats_the_checkpoint(forklift_run, lidar_root, tiny_root, tmp_path):
    """A checkpoint trained on a KITTI-format root, pointed at a LiDAR-only one: one line says to add data=lidar;
    with it (and split=) the command line's layout, root and split win over the checkpoint's, its classes stay.
    The mask, thresholded out of existence, gives the empty-mask hint."""
    out, _ = forklift_run
    kitti = _variant(_ckpt(out), tmp_path / "kitti.ckpt",
                     data={"root": str(tiny_root), "layout": "kitti", "fov_only": True, "val_split": "val"})
    line = _one_error(_run("scripts/evaluate.py", f"ckpt_path={kitti}", f"data.root={lidar_root}",
                           f"paths.output_dir={tmp_path / 'a'}"))
    assert f"data.root={lidar_root} is a LiDAR-only root" in line and "add data=lidar" in line, line
    r = _run("scripts/evaluate.py", f"ckpt_path={kitti}", "data=lidar", f"data.root={lidar_root}", "split=val",
             "mask=predicted", "mask.net.threshold=0.9999", f"paths.output_dir={tmp_path / 'b'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"evaluating split 'val' of {lidar_root} (layout lidar)" in r.stdout
    assert "share" not in r.stdout + r.stderr  # trained on another root
    metrics = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert set(metrics["Forklift"]) == {"bev", "3d"} and metrics["_run"]["mean_sparsity"] == 1.0
    assert "computation mask was empty (mean sparsity 1.000" in _hint_line(r.stdout)


def test_plan_time_excludes_the_cost_model_load(forklift_run, lidar_root, tmp_path, monkeypatch):
    """``_run.time_ms_per_frame.plan`` of a model that plans per batch holds the planning alone: the cost model is
    loaded (here: a 0.3 s stand-in for a calibration) before the timed loop, its time ``_run.plan_cost_model_ms``."""
    from omegaconf import OmegaConf

    import detector.nn.plan as plan
    from detector.nn.cost import CostModel
    from detector.tasks import evaluate_checkpoint

    out, _ = forklift_run
    auto = _variant(_ckpt(out), tmp_path / "auto.ckpt", model={"block_size": "auto", "head_block_size": "auto"})
    state = load_checkpoint(auto)
    state["hyper_parameters"]["config"]["model"]["backbone"]["block_size"] = "auto"
    torch.save(state, auto)
    cost = CostModel(dense_mac=1e-9, block_mac=((8, 1e-9), (16, 1e-9), (32, 1e-9)), move=1e-10, pass_=1e-10,
                     dense_unit=0.0, sparse_unit=0.0, dense_unit_train=0.0, sparse_unit_train=0.0)

    def slow_load(*args):
        time.sleep(0.3)
        return cost

    monkeypatch.setattr(plan, "load_or_calibrate", slow_load)
    data = OmegaConf.create(state["hyper_parameters"]["config"]["data"])
    evaluate_checkpoint(auto, data, tmp_path / "ev", split="holdout", device="cpu",
                        write_results=False)
    run = json.loads((tmp_path / "ev" / "metrics.json").read_text())["_run"]
    assert run["plan_cost_model_ms"] >= 300
    assert run["time_ms_per_frame"]["plan"] * run["frames"] < 300


def test_an_exported_network_reports_the_sparsity_of_its_mask(forklift_run, lidar_root):
    """evaluate backend=export|onnx: the program predicts its mask inside; the output reports that mask's sparsity
    (it reported 0, a dense run, whatever the mask)."""
    from detector.build import load_detector
    from detector.data.dataset import KittiDataset
    from detector.data.structures import collate_frames
    from detector.export import DeployNet, freeze_modes, program_forward

    out, _ = forklift_run
    model, _ = load_detector(_ckpt(out))
    model.eval()
    ds = KittiDataset(lidar_root, "holdout", layout="lidar", fov_only=False, classes=["Car", "Forklift"])
    batch = collate_frames([ds[0], ds[1]])
    with torch.no_grad():
        bev = model.voxelize(batch)
        model.mask_net.threshold = float(torch.sigmoid(model.mask_net(bev)).quantile(0.7))  # some cells, not all
        eager = model(batch)
        assert 0.0 < eager.sparsity < 1.0
        net = DeployNet(model, "net", freeze_modes(model, bev, eager.mask))
        got = program_forward(model, net, "net")(batch)
    assert got.sparsity == pytest.approx(eager.sparsity)
    assert torch.equal(got.mask, eager.mask)


# --- the camera cut as the checkpoint trained --------------------------------------------------------------------
def test_predict_cuts_to_the_camera_view_as_the_checkpoint_trained(forklift_run, tiny_root, tmp_path):
    """``scripts/predict.py calib=...`` with a checkpoint trained on a LiDAR-only root (every point, no camera):
    every point of the cloud is used, as in its training; a checkpoint trained with the camera cut
    (data.fov_only on a KITTI-format root) gets the dataset's cut."""
    from detector.data.dataset import KittiDataset
    from detector.data.kitti import read_points
    from detector.data.kitti_calib import Calibration
    from detector.predict import Predictor

    out, _ = forklift_run
    frame = _ids(tiny_root / "ImageSets" / "val.txt")[0]
    cloud = tiny_root / "training" / "velodyne" / f"{frame}.bin"
    calib = tiny_root / "training" / "calib" / f"{frame}.txt"
    r = _run("scripts/predict.py", f"ckpt_path={_ckpt(out)}", f"input={cloud}", f"calib={calib}", "picture=none",
             f"out={tmp_path / 'p'}")
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "p" / "json" / f"{frame}.json").read_text())
    assert record["points_used"] == record["points"] == len(read_points(cloud))
    kitti = _variant(_ckpt(out), tmp_path / "kitti.ckpt", data={"root": str(tiny_root), "layout": "kitti",
                                                                "fov_only": True})
    pred, _ = Predictor.from_checkpoint(kitti, device="cpu")
    cut = pred.camera_view(read_points(cloud), Calibration.from_file(calib))
    as_trained = KittiDataset(tiny_root, "val", fov_only=True)[0].points
    assert len(cut) < len(read_points(cloud)) and np.array_equal(cut, as_trained)


# --- inspect -----------------------------------------------------------------------------------------------------
def test_inspect_warns_of_shared_train_and_val_frames(lidar_root, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(lidar_root, root)
    r = _run("scripts/inspect_dataset.py", f"root={root}")
    assert r.returncode == 0, r.stderr[-3000:]
    train1 = _ids(root / "ImageSets" / "train.txt")[1]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: splits 'train' and 'val' share 1 frame(s) ({train1}): a model trained on 'train' "
                        "and validated on 'val' is scored on frames it trained on"], r.stderr
