"""LiDAR-only datasets: the label format, the root, the round trip from KITTI, bad input, unknown classes, and a
tiny training + evaluation through scripts/train.py data=lidar."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from detector.commands.inspect_dataset import main as inspect_main
from detector.data.convert import convert_kitti_to_lidar
from detector.data.dataset import KittiDataset
from detector.data.kitti import KittiRoot, write_points
from detector.data.lidar import LidarRoot, open_root
from detector.data.lidar_labels import LidarLabels, parse_lidar_label, read_lidar_label, write_lidar_label
from detector.errors import ConfigError, KittiFormatError
from tests.paths import REPO


def _root(tmp_path: Path, labels: dict[str, str], points: dict[str, np.ndarray] | None = None,
          split: str = "train") -> Path:
    """A LiDAR-only root with the given label texts (and points, default 100 finite points per frame)."""
    root = tmp_path / "lidar"
    for d in ("points", "labels", "ImageSets"):
        (root / d).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for fid, text in labels.items():
        pts = (points or {}).get(fid)
        if pts is None:
            pts = rng.uniform(-5, 5, (100, 4)).astype(np.float32)
        if pts.shape[1] == 4 and pts.dtype == np.float32:
            write_points(root / "points" / f"{fid}.bin", pts)
        else:
            np.save(root / "points" / f"{fid}.npy", pts)
        (root / "labels" / f"{fid}.txt").write_text(text)
    (root / "ImageSets" / f"{split}.txt").write_text("".join(f"{i}\n" for i in labels))
    return root


# --- format -------------------------------------------------------------------------------------------
def test_label_round_trip_exact(tmp_path):
    lab = LidarLabels(np.array([[1.0 / 3, -2.5, -0.7, 4.1, 1.7, 1.5, 0.1], [20, 3, -1, 10, 2.6, 3.4, -3.1]]),
                      ["Car", "Truck"], [0.9, 1e-9])
    write_lidar_label(tmp_path / "a.txt", lab)
    back = read_lidar_label(tmp_path / "a.txt", with_score=True)
    assert np.array_equal(back.boxes, lab.boxes) and np.array_equal(back.score, lab.score)
    assert back.name.tolist() == ["Car", "Truck"] and back.line.tolist() == [1, 2]


def test_label_dontcare_and_blank_lines_left_out():
    lab = parse_lidar_label("\n1 2 3 4 5 6 0 Car\n0 0 0 1 1 1 0 DontCare\n", "x.txt")
    assert lab.name.tolist() == ["Car"] and lab.line.tolist() == [2]


@pytest.mark.parametrize("text, line, message", [
    ("1 2 3 4 5 6 0 Car\n1 2 3 4 5 6 Car\n", 2, "expected 8 fields"),
    ("1 2 3 4 5 six 0 Car\n", 1, "non-numeric dz 'six'"),
    ("1 2 nan 4 5 6 0 Car\n", 1, "NaN or infinite"),
    ("1 2 3 4 inf 6 0 Car\n", 1, "NaN or infinite"),
    ("1 2 3 -4 5 6 0 Car\n", 1, "negative box size"),
    ("1 2 3 4 5 6 0 Car 0.5\n", 1, "expected 8 fields"),
])
def test_bad_label_line_is_one_error_naming_file_and_line(text, line, message):
    with pytest.raises(KittiFormatError) as e:
        parse_lidar_label(text, "labels/000001.txt")
    assert e.value.line == line and message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"labels/000001.txt:{line}: ")


def test_root_reads_bin_and_npy_into_frame(tmp_path):
    xyz = np.arange(30, dtype=np.float64).reshape(10, 3)
    root = _root(tmp_path, {"a": "1 2 -1 4 2 1.5 0.5 Car\n", "b": ""}, {"b": xyz})
    r = open_root(root)
    assert isinstance(r, LidarRoot) and r.imageset("train") == ["a", "b"]
    f = r.read_frame("a")
    assert f.calib is None and f.image_size is None and f.gt_names.tolist() == ["Car"]
    assert np.allclose(f.gt_boxes.numpy(), [[1, 2, -1, 4, 2, 1.5, 0.5]])
    g = r.read_frame("b")
    assert g.points.shape == (10, 4) and np.array_equal(g.points[:, :3], xyz.astype(np.float32))
    assert (g.points[:, 3] == 0).all() and len(g.gt_boxes) == 0


@pytest.mark.parametrize("case, message", [
    ("truncated", "not a multiple of 16"),
    ("empty", "empty point cloud"),
    ("nan", "NaN or infinite"),
    ("missing", "has no point cloud"),
])
def test_bad_point_files(tmp_path, case, message):
    root = _root(tmp_path, {"000001": "1 2 -1 4 2 1.5 0 Car\n"})
    path = root / "points" / "000001.bin"
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:-3])
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "nan":
        pts = np.fromfile(path, np.float32).reshape(-1, 4)
        pts[5, 1] = np.nan
        write_points(path, pts)
    else:
        path.unlink()
    with pytest.raises(KittiFormatError) as e:
        KittiDataset(root, "train", layout="lidar")[0]
    assert message in str(e.value) and "000001" in str(e.value) and "\n" not in str(e.value)


def test_unknown_class_counted_and_reported_once(tmp_path, caplog):
    root = _root(tmp_path, {"a": "1 2 -1 4 2 1.5 0 Tractor\n5 5 -1 4 2 1.5 0 Car\n",
                            "b": "1 2 -1 4 2 1.5 0 Tractor\n1 9 -1 11 2.6 3 0 Bus\n3 3 -1 4 2 1.5 0 Van\n"})
    with caplog.at_level(logging.WARNING, logger="detector.data.dataset"):
        ds = KittiDataset(root, "train", layout="lidar", classes=["Car", "Truck"])
    assert dict(ds.unknown.counts) == {"Tractor": 2, "Bus": 1}  # Van: an ignore class, known
    warnings = [r.getMessage() for r in caplog.records if "not in data.classes" in r.getMessage()]
    assert len(warnings) == 1 and "Tractor 2" in warnings[0] and f"{root / 'labels' / 'a.txt'}:1" in warnings[0]
    frame = ds[1]  # never silently dropped: the objects stay in the frame
    assert sorted(frame.gt_names.tolist()) == ["Bus", "Tractor", "Van"]


def test_inspect_reports_unknown_and_bad_files(tmp_path, capsys):
    root = _root(tmp_path, {"a": "1 2 -1 4 2 1.5 0 Tractor\n", "b": "1 2 -1 4 2 1.5 Car\n"})
    assert inspect_main([f"root={root}"]) == 1
    out, err = capsys.readouterr()
    assert "Tractor" in out and "UNKNOWN" in out and "unknown classes: 1 labeled object(s)" in out
    assert f"{root / 'labels' / 'b.txt'}:1: expected 8 fields" in err


def test_config_errors(tmp_path):
    root = _root(tmp_path, {"a": ""})
    with pytest.raises(ConfigError, match="data.layout"):
        open_root(root, "velodyne")
    from detector.data.datamodule import KittiDataModule

    with pytest.raises(ConfigError, match=r"data.classes.Car=1.5"):
        KittiDataModule(str(root), grid=None, layout="lidar", classes={"Car": 1.5})


# --- the round trip on real KITTI frames ------------------------------------------------------------------
def test_round_trip_on_kitti_real(tmp_path, kitti_real):
    out = tmp_path / "lidar"
    summary = convert_kitti_to_lidar(kitti_real, out)
    kroot, lroot = KittiRoot(kitti_real), LidarRoot(out)
    ids = sorted(p.stem for p in (kroot.dir / "velodyne").glob("*.bin"))
    assert summary.frames == len(ids) == 10 and lroot.imageset("all") == ids
    for fid in ids:
        k, f = kroot.read_frame(fid), lroot.read_frame(fid)
        assert np.array_equal(k.points, f.points)  # identical
        assert k.gt_names.tolist() == f.gt_names.tolist()  # DontCare absent from both
        assert np.allclose(k.gt_boxes.numpy(), f.gt_boxes.numpy(), atol=1e-5)
        assert f.calib is None


def test_convert_refuses_non_empty_out(tmp_path, kitti_real):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(KittiFormatError, match="new or empty folder"):
        convert_kitti_to_lidar(kitti_real, tmp_path / "x")
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["keep.txt"]


# --- training and evaluation on a LiDAR-only root -----------------------------------------------------
def test_train_and_evaluate_on_lidar_root(tmp_path, tiny_root):
    """scripts/train.py data=lidar on the simulated frames converted to a LiDAR-only root, with a class beyond
    KITTI's (Truck: its anchor and its minimum IoU from the config), validating as it trains with the default
    best-checkpoint callback (it monitored a KITTI difficulty level, which a LiDAR-only root does not log, and
    crashed at the first validation), then scripts/evaluate.py on it."""
    from tests.test_train import TINY

    root = tmp_path / "lidar"
    convert_kitti_to_lidar(tiny_root, root, fov_only=True)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "data=lidar", f"data.root={root}",
           f"paths.output_dir={out}", *TINY, "trainer.check_val_every_n_epoch=1", "logger=none",
           "model.classes=[Car,Truck]", "data.classes.Truck=0.6", "hydra.job.chdir=false"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    assert set(metrics["Truck"]) == {"bev", "3d"} and "overall" in metrics["Car"]["bev"]["R40"]
    assert set(metrics["distance"]["Car"]["3d"]["R11"]) == {"0-30", "30-50", "50+"}
    assert "Truck           0.60" in run.stdout  # the configured threshold in the table
    dt = sorted((out / "eval" / "data").glob("*.txt"))
    assert dt and all(len(line.split()) == 9 for p in dt for line in p.read_text().splitlines())
    ckpt = next((out / "checkpoints").glob("epoch*.ckpt"))  # the best by val/AP_Car_bev_R40_overall
    assert "Traceback" not in run.stderr
    ev = tmp_path / "ev"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "evaluate.py"), f"ckpt_path={ckpt}", "data=lidar",
                          f"data.root={root}", "data.val_split=val", f"paths.output_dir={ev}",
                          "hydra.job.chdir=false"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((ev / "metrics.json").read_text())["Car"] == metrics["Car"]
