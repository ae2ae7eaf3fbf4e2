"""A LiDAR-only root as a user makes and uses one, each command through its script: convert_dataset.py on a KITTI root
without image sets, then the training and evaluation commands it prints (run as printed, the tests' tiny model
added), kitti_eval.py and visualize.py on what they wrote. One training run serves every test here; it also checks
the training console: each of Lightning's lines once, no advertisement, no deprecation inside Lightning."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from detector.commands import kitti_eval, visualize
from detector.data.lidar_labels import LidarLabels, read_lidar_label, write_lidar_label
from tests.paths import REPO
from tests.test_train import TINY


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)


def _printed(line: str, cwd: Path) -> list[str]:
    """A command line as the converter prints it (``python scripts/...``), run with this interpreter from ``cwd``."""
    argv = shlex.split(line)
    assert argv[0] == "python" and argv[1].startswith("scripts/"), line
    return [sys.executable, str(REPO / argv[1]), *argv[2:]]


@pytest.fixture(scope="module")
def session(tiny_root, tmp_path_factory):
    """The converted root, the converter's output, the training run (its folder and output) and the evaluation."""
    tmp = tmp_path_factory.mktemp("lidar_commands")
    src = tmp / "kitti"
    shutil.copytree(tiny_root, src)
    shutil.rmtree(src / "ImageSets")
    conv = _run([sys.executable, str(REPO / "scripts" / "convert_dataset.py"), f"root={src}", "out=lidar",
                 "fov_only=true"], cwd=tmp)
    assert conv.returncode == 0, conv.stderr[-3000:]
    lines = conv.stdout.strip().splitlines()
    assert lines[-2].startswith("train: ") and lines[-1].startswith("evaluate")  # the last lines: what to run
    train_line, eval_line = (x[x.index("python "):] for x in lines[-2:])
    run_dir = tmp / "run"
    train = _run([*_printed(train_line, tmp), *TINY, "trainer.max_steps=1", f"hydra.run.dir={run_dir}"], cwd=tmp)
    assert train.returncode == 0, train.stderr[-3000:]
    ckpt = train.stdout.split("best checkpoint: ")[1].split()[0]
    ev_dir = tmp / "ev"
    evaluate = _run([*_printed(eval_line.replace("CKPT", ckpt), tmp), f"hydra.run.dir={ev_dir}"], cwd=tmp)
    return {"tmp": tmp, "root": tmp / "lidar", "convert": conv, "train_line": train_line, "train": train,
            "run": run_dir, "ckpt": ckpt, "evaluate": evaluate, "ev": ev_dir}


def test_converter_prints_commands_that_run_on_a_root_without_image_sets(session):
    assert "data.train_split=all data.val_split=all" in session["train_line"]
    assert "no train/val split is made up" in session["convert"].stdout
    assert (session["root"] / "ImageSets").is_dir() and [p.name for p in (session["root"] / "ImageSets").iterdir()] \
        == ["all.txt"]
    ev = session["evaluate"]
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "split 'all'" in ev.stdout and (session["ev"] / "metrics.json").is_file()


def test_training_console_prints_each_lightning_line_once(session):
    r = session["train"]
    text = r.stdout + r.stderr
    for line in ("GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
                 "Loading `train_dataloader` to estimate number of stepping batches.",
                 "`Trainer.fit` stopped: `max_steps=1` reached."):
        assert text.count(line) == 1, (line, text[-4000:])
    assert "litlogger" not in text and "Tip:" not in text  # Lightning's advertisement
    assert "LeafSpec" not in text and "transfer_batch_to_device" not in text  # nothing a user can act on
    log = (session["run"] / "train.log").read_text()  # Hydra's file log keeps Lightning's lines (once)
    assert log.count("GPU available: False, used: False") == 1 and "litlogger" not in log


def test_kitti_eval_scores_the_lidar_only_evaluation_folder_as_evaluation_did(session, tmp_path):
    """kitti_eval.py on the LiDAR-only eval folder (8- and 9-field lines) gives training's evaluation numbers and
    table (it said "expected 15 fields ... got 8")."""
    ev = session["run"] / "eval"
    out = tmp_path / "from_files.json"
    r = _run([sys.executable, str(REPO / "scripts" / "kitti_eval.py"), f"gt={ev / 'label_2'}",
              f"results={ev / 'data'}", "classes=Car", f"out={out}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((ev / "metrics.json").read_text())
    assert json.loads(out.read_text()) == {k: v for k, v in metrics.items() if k != "_run"}
    table = r.stdout.split("\n", 1)[1].rsplit("\nwrote ", 1)[0]
    assert "overall" in table and table in session["train"].stdout


def test_visualize_reads_a_lidar_only_root(session, tmp_path):
    """visualize.py on a LiDAR-only root (points/, labels/) with the checkpoint trained on it (it said "no
    'training' folder"); its bird's-eye view is predict's and TensorBoard's: size= pixels on the map's long side
    (the legend under it), the labelled Cars in a tint of the Car colour (it drew plain green outlines)."""
    import open3d as o3d

    from detector.build import load_detector
    from detector.viz import LEGEND_BACKGROUND, gt_color

    out = tmp_path / "frame.png"
    r = _run([sys.executable, str(REPO / "scripts" / "visualize.py"), f"root={session['root']}", "frame=000001",
              "mode=bev", f"ckpt_path={session['ckpt']}", f"out={out}", "size=400"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    img = np.asarray(o3d.io.read_image(str(out)))
    grid = load_detector(session["ckpt"])[0].grid
    x_ext, y_ext = grid.x_range[1] - grid.x_range[0], grid.y_range[1] - grid.y_range[0]
    map_rows, map_cols = round(400 * x_ext / max(x_ext, y_ext)), round(400 * y_ext / max(x_ext, y_ext))
    assert img.shape[1] == map_cols and img.shape[0] > map_rows  # x up, y across; the legend below the map
    assert (read_lidar_label(session["root"] / "labels" / "000001.txt").name == "Car").any()  # the case can fail
    assert (img[:map_rows] == np.asarray(gt_color("Car"), np.uint8)).all(-1).any()  # its outline: a tint of Car's
    assert not (img[:map_rows] == np.asarray(LEGEND_BACKGROUND, np.uint8)).all(-1).all(-1).any()  # no legend row


# --- kitti_eval on LiDAR-only folders, in-process ---------------------------------------------------------------
@pytest.fixture(scope="module")
def lidar_root(tiny_root, tmp_path_factory) -> Path:
    from detector.data.convert import convert_kitti_to_lidar

    root = tmp_path_factory.mktemp("lidar_root") / "lidar"
    convert_kitti_to_lidar(tiny_root, root, fov_only=True)
    return root


def _folders(tmp_path: Path, root: Path) -> tuple[Path, Path]:
    """The labels of a LiDAR-only root, each frame twice (over 40 cars: KITTI's 40 recall points all reachable), as
    ground truth, and the same boxes as detections."""
    gt, res = tmp_path / "gt", tmp_path / "res"
    gt.mkdir()
    res.mkdir()
    for p in (root / "labels").glob("*.txt"):
        lab = read_lidar_label(p)
        for copy in ("a", "b"):
            write_lidar_label(gt / f"{copy}{p.name}", lab)
            write_lidar_label(res / f"{copy}{p.name}", LidarLabels(lab.boxes, lab.name, np.full(len(lab), 0.9)))
    return gt, res


def test_kitti_eval_lidar_layout_perfect_detections_score_100(lidar_root, tmp_path, capsys):
    gt, res = _folders(tmp_path, lidar_root)
    out = tmp_path / "ap.json"
    assert kitti_eval.main([f"gt={gt}", f"results={res}", "classes=Car,Truck", "iou=Truck:0.6", f"out={out}"]) == 0
    text = capsys.readouterr().out
    assert "LiDAR-only layout" in text and "Truck           0.60" in text
    js = json.loads(out.read_text())
    assert set(js["Truck"]) == {"bev", "3d"}
    for m in ("bev", "3d"):
        assert js["Car"][m]["R40"]["overall"] == pytest.approx(100.0) == js["Car"][m]["R11"]["overall"], m


def test_kitti_eval_lidar_layout_errors_are_one_line(lidar_root, tmp_path, capsys):
    gt, res = _folders(tmp_path, lidar_root)
    assert kitti_eval.main([f"gt={gt}", f"results={res}", "classes=Forklift"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Car, Pedestrian, Cyclist, Truck, Bus" in err and "iou=Forklift:0.7" in err
    assert kitti_eval.main([f"gt={gt}", f"results={res}", "classes=Forklift", "iou=Forklift:0.6"]) == 0
    assert "Forklift        0.60" in capsys.readouterr().out
    assert kitti_eval.main([f"gt={gt}", f"results={res}", "iou=Car"]) == 2
    assert "expected CLASS:IOU pairs" in capsys.readouterr().err
    kitti_res = tmp_path / "kitti_res"  # KITTI result lines (16 fields) beside LiDAR-only labels
    kitti_res.mkdir()
    (kitti_res / "000000.txt").write_text("Car 0 0 0 0 0 10 10 1.5 1.6 3.9 1 1 10 0 0.9\n")
    assert kitti_eval.main([f"gt={gt}", f"results={kitti_res}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "KITTI result file (16 fields" in err and "LiDAR-only label files" in err


def test_visualize_reads_both_layouts_of_real_kitti(kitti_real, tmp_path, capsys):
    """A real KITTI frame drawn from its KITTI root and from its LiDAR-only conversion."""
    from detector.data.convert import convert_kitti_to_lidar

    convert_kitti_to_lidar(kitti_real, tmp_path / "lidar", fov_only=True)
    fid = sorted(p.stem for p in (tmp_path / "lidar" / "points").glob("*.bin"))[0]
    for root in (kitti_real, tmp_path / "lidar"):
        out = tmp_path / f"{Path(root).name}.png"
        assert visualize.main([f"root={root}", f"frame={fid}", "mode=bev", f"out={out}"]) == 0, capsys.readouterr()
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
