"""``detector-predict``: the point-cloud readers (each format, written files read back, files written by open3d and
by hand), the sanity lines, bad input (one line naming the file, nothing written half, skip_bad), predict's KITTI
result file equal to evaluate's for the same frame, and ``scripts/predict.py`` end to end on a folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from detector.commands import predict as predict_cmd
from detector.data.pointcloud import list_point_clouds, read_point_cloud, sanity_notes, write_point_cloud
from detector.errors import KittiFormatError
from detector.geometry.voxelize import BevGrid
from tests.eval import test_app as eval_app
from tests.paths import REPO
from tests.test_train import _cfg

# the fixtures of the evaluation's tests: a hand-built KITTI root of 12 frames and a checkpoint trained on it (one step)
car_root = eval_app.car_root
predicted_ckpt = eval_app.predicted_ckpt

FORMATS = ("bin", "npy", "pcd", "ply")
SMALL = BevGrid((0.0, 51.2), (-19.2, 19.2), (-2.5, 1.0), 0.2, 0.35)  # configs/bev/small.yaml


def _cloud(n: int = 500, seed: int = 0) -> np.ndarray:
    """[n, 4] float32 points with reflectance in [0, 1)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.normal(0, 10, (n, 3)), rng.uniform(0, 1, (n, 1))], axis=1).astype(np.float32)


# --- readers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_written_clouds_read_back_exactly(tmp_path, fmt):
    pts = _cloud()
    write_point_cloud(tmp_path / f"a.{fmt}", pts)
    cloud = read_point_cloud(tmp_path / f"a.{fmt}")
    assert cloud.has_intensity and cloud.dropped == 0
    np.testing.assert_array_equal(cloud.points, pts)
    assert cloud.points.dtype == np.float32 and cloud.points.shape == (500, 4)
    if fmt != "bin":  # x, y, z only: the reflectance column is 0, and the cloud says it had none
        write_point_cloud(tmp_path / f"b.{fmt}", pts[:, :3])
        cloud = read_point_cloud(tmp_path / f"b.{fmt}")
        assert not cloud.has_intensity
        np.testing.assert_array_equal(cloud.points[:, :3], pts[:, :3])
        assert (cloud.points[:, 3] == 0).all()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


@pytest.mark.parametrize("fmt", ["pcd", "ply"])
def test_clouds_written_by_open3d_are_read(tmp_path, fmt):
    """open3d's legacy writer (float64 positions, no intensity field), as other tools write them."""
    import open3d as o3d

    xyz = _cloud()[:, :3].astype(np.float64)
    o3d.io.write_point_cloud(str(tmp_path / f"o.{fmt}"), o3d.geometry.PointCloud(o3d.utility.Vector3dVector(xyz)))
    cloud = read_point_cloud(tmp_path / f"o.{fmt}")
    assert not cloud.has_intensity
    np.testing.assert_allclose(cloud.points[:, :3], xyz, rtol=1e-6, atol=1e-5)


def test_ascii_pcd_and_ply_written_by_hand(tmp_path):
    """Headers as the PCD and PLY specifications write them, with a reflectance field under another accepted name."""
    (tmp_path / "h.pcd").write_text(
        "# .PCD v0.7\nVERSION 0.7\nFIELDS x y z intensity\nSIZE 4 4 4 4\nTYPE F F F F\nCOUNT 1 1 1 1\nWIDTH 2\n"
        "HEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\nPOINTS 2\nDATA ascii\n1.5 -2 0.25 0.5\n10 3 -1.5 1\n")
    (tmp_path / "h.ply").write_text(
        "ply\nformat ascii 1.0\ncomment by hand\nelement vertex 2\nproperty float x\nproperty float y\n"
        "property float z\nproperty float reflectance\nend_header\n1.5 -2 0.25 0.5\n10 3 -1.5 1\n")
    for name in ("h.pcd", "h.ply"):
        cloud = read_point_cloud(tmp_path / name)
        assert cloud.has_intensity, name
        np.testing.assert_array_equal(cloud.points, [[1.5, -2, 0.25, 0.5], [10, 3, -1.5, 1]])


def test_format_override_and_folder_listing(tmp_path):
    pts = _cloud()
    write_point_cloud(tmp_path / "scan.dat", pts, fmt="bin")  # any extension with format=bin
    np.testing.assert_array_equal(read_point_cloud(tmp_path / "scan.dat", "bin").points, pts)
    for i, fmt in enumerate(("bin", "npy", "pcd")):
        write_point_cloud(tmp_path / f"{i:06d}.{fmt}", pts)
    (tmp_path / "notes.txt").write_text("not a cloud\n")
    assert [p.name for p in list_point_clouds(tmp_path)] == ["000000.bin", "000001.npy", "000002.pcd"]
    assert [p.name for p in list_point_clouds(tmp_path, "npy")] == ["000001.npy"]
    write_point_cloud(tmp_path / "000001.ply", pts)  # two clouds named 000001: their outputs would collide
    with pytest.raises(KittiFormatError, match="two point clouds named 000001: 000001.npy and 000001.ply"):
        list_point_clouds(tmp_path)


def _bytes(data: bytes):
    return lambda p: p.write_bytes(data)


def _npy(array):
    def make(p):
        with open(p, "wb") as fh:
            np.save(fh, array, allow_pickle=True)
    return make


def _with_nan(fmt: str, value: float):
    def make(p):
        pts = _cloud(20)
        pts[7, 2] = value
        pts[12, 0] = value
        write_point_cloud(p, pts, fmt)
    return make


def _truncated(fmt: str, cut: int):
    def make(p):
        write_point_cloud(p.with_name("whole." + fmt), _cloud(20))
        p.write_bytes(p.with_name("whole." + fmt).read_bytes()[:-cut])
    return make


_PCD_HEAD = "VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 1 1 1\nWIDTH {n}\nHEIGHT 1\nPOINTS {n}\n"
BAD_FILES = [  # (file name, how it is made, what the one line says after the file's name)
    ("t.bin", _bytes(b"\0" * 20), "truncated point cloud: 20 bytes is not a multiple of 16"),
    ("e.bin", _bytes(b""), "empty point cloud (0 bytes)"),
    ("e.npy", _bytes(b""), "empty point cloud (0 bytes)"),
    ("e.pcd", _bytes(b""), "empty point cloud (0 bytes)"),
    ("z.npy", _npy(np.zeros((0, 3), np.float32)), "empty point cloud (0 points)"),
    ("z.pcd", _bytes((_PCD_HEAD.format(n=0) + "DATA ascii\n").encode()), "empty point cloud (its header says 0"),
    ("n.bin", _with_nan("bin", np.nan), "2 points with NaN or infinite values (first: point 7)"),
    ("i.npy", _with_nan("npy", np.inf), "2 points with NaN or infinite values (first: point 7)"),
    ("n.pcd", _with_nan("pcd", -np.inf), "2 points with NaN or infinite values (first: point 7)"),
    ("c5.npy", _npy(np.zeros((4, 5), np.float32)), "expected a numeric [N, 3] or [N, 4] array"),
    ("o.npy", _npy(np.array([{"x": 1}], dtype=object)), "holds pickled objects (refused)"),
    ("t.npy", _truncated("npy", 9), "truncated or corrupt .npy file"),
    ("t.pcd", _truncated("pcd", 9), "truncated PCD file"),
    ("t.ply", _truncated("ply", 9), "truncated PLY file"),
    ("g.pcd", _bytes(b"garbage\n"), "not a PCD file: no 'DATA' line in its header"),
    ("g.ply", _bytes(b"ply\nformat ascii 1.0\nelement face 1\nend_header\n"), "no 'element vertex' in the PLY header"),
    ("a.pcd", _bytes((_PCD_HEAD.format(n=3) + "DATA ascii\n1 2 3\n").encode()), "truncated PCD file: its header "
     "says 3 points, 1 in the file"),
    ("a.ply", _bytes(b"ply\nformat ascii 1.0\nelement vertex 2\nproperty float x\nproperty float y\n"
                     b"property float z\nend_header\n1 2 3\n"), "truncated PLY file: its header says 2 points, 1 in"),
    ("scan.xyz", _bytes(b"1 2 3\n"), "unknown point-cloud format '.xyz'"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_files_raise_one_error_naming_the_file(tmp_path, name, make, message):
    path = tmp_path / name
    make(path)
    with pytest.raises(KittiFormatError) as e:
        read_point_cloud(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_nonfinite_points_are_dropped_and_counted_when_asked(tmp_path):
    _with_nan("bin", np.nan)(tmp_path / "n.bin")
    cloud = read_point_cloud(tmp_path / "n.bin", drop_nonfinite=True)
    assert cloud.dropped == 2 and len(cloud.points) == 18 and np.isfinite(cloud.points).all()
    assert ("nonfinite", "2 points with NaN or infinite values dropped") in sanity_notes(cloud, SMALL)


# --- does it look like the training data? ---------------------------------------------------------------------
def _scan(seed: int = 0) -> np.ndarray:
    """A KITTI-like scan in metres, z up, sensor 1.73 m above the ground: ground rings all around out to 40 m, and
    some walls and cars; reflectance in [0, 1)."""
    rng = np.random.default_rng(seed)
    r, a = rng.uniform(3, 40, 6000), rng.uniform(-np.pi, np.pi, 6000)
    ground = np.stack([r * np.cos(a), r * np.sin(a), rng.normal(-1.73, 0.03, 6000)], axis=1)
    objects = np.stack([rng.uniform(-30, 30, 3000), rng.uniform(-15, 15, 3000), rng.uniform(-1.7, 0.5, 3000)], 1)
    xyz = np.concatenate([ground, objects])
    return np.concatenate([xyz, rng.uniform(0, 1, (len(xyz), 1))], axis=1).astype(np.float32)


def _kinds(points: np.ndarray, has_intensity: bool = True) -> list[str]:
    from detector.data.pointcloud import PointCloud

    return [k for k, _ in sanity_notes(PointCloud(Path("s.bin"), points, has_intensity), SMALL)]


def test_sanity_notes_one_line_per_reason():
    scan = _scan()
    assert _kinds(scan) == []  # as the training data looks: nothing to say
    mm = scan.copy()
    mm[:, :3] *= 1000
    assert "units" in _kinds(mm)
    (_, line), = [n for n in sanity_notes(_as_cloud(mm), SMALL) if n[0] == "units"]
    assert "millimetres" in line and "1000x" in line
    cm = scan.copy()
    cm[:, :3] *= 100
    assert "centimetres" in dict(sanity_notes(_as_cloud(cm), SMALL))["units"]
    y_up = scan[:, [0, 2, 1, 3]]  # y vertical
    (_, line), = [n for n in sanity_notes(_as_cloud(y_up), SMALL) if n[0] == "up_axis"]
    assert line.startswith("y looks vertical")
    far = scan.copy()
    far[:, 0] += 120  # beyond the grid's far end (51.2 m), still metres (median distance under 200)
    assert _kinds(far) == ["outside_grid"]
    high = scan.copy()
    high[:, 2] += 4.0  # the sensor's origin 4 m lower: the heights leave the grid, x and y do not
    assert _kinds(high) == ["outside_grid"]
    assert "their heights are the cause" in dict(sanity_notes(_as_cloud(high), SMALL))["outside_grid"]
    assert _kinds(scan, has_intensity=False) == ["no_intensity"]
    bright = scan.copy()
    bright[:, 3] *= 255
    assert _kinds(bright) == ["intensity_range"]
    for kind, line in sanity_notes(_as_cloud(mm), SMALL) + sanity_notes(_as_cloud(y_up), SMALL):
        assert "\n" not in line, kind


def _as_cloud(points):
    from detector.data.pointcloud import PointCloud

    return PointCloud(Path("s.bin"), points, True)


# --- the command: bad input, skip_bad, nothing written half ------------------------------------------------------
def _run(capsys, *argv: str) -> tuple[int, str, str]:
    """``detector-predict argv`` in this process: (exit status, stdout, stderr)."""
    try:
        rc = predict_cmd.main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) if out.exists() else []


def test_bad_input_to_the_command_is_one_line_naming_the_file(predicted_ckpt, tmp_path, capsys):
    good = tmp_path / "good"
    good.mkdir()
    write_point_cloud(good / "000001.bin", _scan())
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "t.bin").write_bytes(b"\0" * 20)
    (tmp_path / "scan.xyz").write_bytes(b"1 2 3\n")
    ckpt = f"ckpt_path={predicted_ckpt}"
    cases = [  # (arguments, the file the line must name, what it says)
        ([ckpt, f"input={tmp_path / 't.bin'}"], tmp_path / "t.bin", "truncated point cloud"),
        ([ckpt, f"input={tmp_path / 'scan.xyz'}"], tmp_path / "scan.xyz", "unknown point-cloud format"),
        ([ckpt, f"input={tmp_path / 'empty_dir'}"], tmp_path / "empty_dir", "no point-cloud files"),
        ([ckpt, f"input={tmp_path / 'none.bin'}"], tmp_path / "none.bin", "input not found"),
        ([f"ckpt_path={tmp_path / 'none.ckpt'}", f"input={good}"], tmp_path / "none.ckpt", "checkpoint not found"),
        ([ckpt, f"input={good}", f"calib={tmp_path / 'calib'}"], tmp_path / "calib", "calibration not found"),
        ([ckpt, f"input={good}", "mask=road_map"], predicted_ckpt, "a point cloud has none"),
        ([ckpt, f"input={good}", f"out={tmp_path / 't.bin' / 'out'}"], tmp_path / "t.bin", "cannot write there"),
        ([ckpt, f"input={good}", "picture_size=50"], "picture_size=50", "an integer >= 200"),
    ]
    for i, (argv, named, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc, _, err = _run(capsys, f"out={out}", *argv)  # a later out= replaces the first
        assert rc == 1, (argv, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(named) in lines[0], (argv, err)
        assert message in lines[0], (argv, err)
        assert not out.exists(), argv  # nothing written, not even an empty folder


def test_a_folder_stops_at_the_first_bad_file_or_skips_and_counts(predicted_ckpt, tmp_path, capsys):
    src = tmp_path / "clouds"
    src.mkdir()
    write_point_cloud(src / "a.bin", _scan(0))
    (src / "b.bin").write_bytes(b"\0" * 40)  # truncated
    write_point_cloud(src / "c.bin", _scan(1))
    out = tmp_path / "stop"
    rc, _, err = _run(capsys, f"ckpt_path={predicted_ckpt}", f"input={src}", f"out={out}")
    assert rc == 1 and f"error: {src / 'b.bin'}: truncated point cloud" in err
    # a's outputs whole, nothing of b or c (sorted order: a, b, c), no temporary files
    assert _files(out) == ["bev/a.png", "json/a.json", "txt/a.txt"]
    out = tmp_path / "skip"
    rc, stdout, err = _run(capsys, f"ckpt_path={predicted_ckpt}", f"input={src}", f"out={out}", "skip_bad=true")
    assert rc == 0, err
    assert f"skipped: {src / 'b.bin'}: truncated point cloud" in err
    assert _files(out) == ["bev/a.png", "bev/c.png", "json/a.json", "json/c.json", "summary.json", "txt/a.txt",
                           "txt/c.txt"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["frames"] == 2 and summary["skipped"] == 1 and str(src / "b.bin") in summary["skipped_files"][0]
    assert "2 frame(s), boxes scored >= 0.3:" in stdout and "1 bad file(s) skipped" in stdout


# --- predict == evaluate ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scoring_ckpt(predicted_ckpt, tmp_path_factory) -> Path:
    """predicted_ckpt decoding every box down to score 0 (up to max_detections): an untrained head's scores lie near
    its prior (0.01), under the default 0.1, and equal empty files would prove nothing."""
    from detector.callbacks import load_checkpoint

    ckpt = load_checkpoint(predicted_ckpt)
    ckpt["hyper_parameters"]["config"]["model"]["score_threshold"] = 0.0
    ckpt["hyper_parameters"]["config"]["model"]["max_detections"] = 20
    path = tmp_path_factory.mktemp("scoring") / "scoring.ckpt"
    torch.save(ckpt, path)
    return path


def test_predict_writes_the_kitti_result_file_evaluate_writes(car_root, scoring_ckpt, tmp_path, capsys):
    from detector.tasks import evaluate_checkpoint

    root = tmp_path / "root"
    shutil.copytree(car_root, root)
    (root / "ImageSets" / "one.txt").write_text("000003\n")
    evaluate_checkpoint(scoring_ckpt, _cfg(tmp_path, root).data, tmp_path / "eval", split="one")
    capsys.readouterr()
    out = tmp_path / "pred"
    rc, stdout, err = _run(capsys, f"ckpt_path={scoring_ckpt}", f"input={root / 'training/velodyne/000003.bin'}",
                           f"calib={root / 'training/calib/000003.txt'}", f"out={out}")
    assert rc == 0, err
    evaluated = (tmp_path / "eval" / "data" / "000003.txt").read_text()
    assert len(evaluated.splitlines()) >= 10  # most of the 20 boxes (those centred inside the grid): of substance
    assert (out / "kitti" / "000003.txt").read_text() == evaluated
    # the JSON and text files hold the same boxes in the LiDAR frame, highest score first
    boxes = json.loads((out / "json" / "000003.json").read_text())["boxes"]
    assert len(boxes) == 20 and [b["score"] for b in boxes] == sorted((b["score"] for b in boxes), reverse=True)
    assert set(boxes[0]) == {"x", "y", "z", "l", "w", "h", "yaw", "class", "score"}
    lines = (out / "txt" / "000003.txt").read_text().splitlines()
    assert [ln.split()[7] for ln in lines] == ["Car"] * 20
    assert [float(v) for v in lines[0].split()[:7]] == pytest.approx([boxes[0][k] for k in "x y z l w h yaw".split()])
    # an untrained head's scores lie under the default score_threshold (0.3): none counted, every one in the files
    assert "1 frame(s), boxes scored >= 0.3: none; the files hold all 20 decoded (scores >= 0)" in stdout
    assert "ms per frame" in stdout


# --- the script end to end ---------------------------------------------------------------------------------------
def test_script_runs_on_a_folder_of_mixed_formats(car_root, predicted_ckpt, tmp_path):
    """scripts/predict.py on three real frames of the KITTI root written as .bin, .npy without reflectance and .pcd:
    every frame's files, one line about the missing reflectance, the summary."""
    from detector.data.kitti import read_points

    src = tmp_path / "clouds"
    src.mkdir()
    velodyne = car_root / "training" / "velodyne"
    shutil.copy(velodyne / "000000.bin", src / "000000.bin")
    write_point_cloud(src / "000001.npy", read_points(velodyne / "000001.bin")[:, :3])
    write_point_cloud(src / "000002.pcd", read_points(velodyne / "000002.bin"))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "scripts/predict.py", f"ckpt_path={predicted_ckpt}", f"input={src}",
                        f"out={out}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    per_frame = [f"{d}/00000{i}.{e}" for d, e in (("bev", "png"), ("json", "json"), ("txt", "txt")) for i in range(3)]
    assert _files(out) == sorted(["summary.json", *per_frame])
    assert r.stderr.count("no intensity channel: 0 used") == 1 and f"{src / '000001.npy'}" in r.stderr
    assert "3 frame(s), boxes scored >= 0.3:" in r.stdout and "ms per frame" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["frames"] == 3 and summary["warnings"] == {"no_intensity": 1}
    assert json.loads((out / "json" / "000001.json").read_text())["intensity"] is False


def test_predict_equals_evaluate_on_a_real_kitti_frame(kitti_real, scoring_ckpt, tmp_path, capsys):
    """A real frame whose image (1224 x 370 px) is not the default 1242 x 375: predict's KITTI file, given the
    calibration and image folders, equals evaluate's (which reads image_2/); the root is linked, not copied."""
    from detector.tasks import evaluate_checkpoint

    root = tmp_path / "root"
    (root / "training").mkdir(parents=True)
    for sub in ("velodyne", "calib", "label_2", "image_2"):
        (root / "training" / sub).symlink_to(kitti_real / "training" / sub)
    (root / "ImageSets").mkdir()
    (root / "ImageSets" / "one.txt").write_text("000000\n")
    evaluate_checkpoint(scoring_ckpt, _cfg(tmp_path, root, "data=kitti").data, tmp_path / "eval", split="one")
    capsys.readouterr()
    t = kitti_real / "training"
    common = [f"ckpt_path={scoring_ckpt}", f"input={t / 'velodyne' / '000000.bin'}", f"calib={t / 'calib'}",
              "picture=none"]
    rc, _, err = _run(capsys, *common, f"image={t / 'image_2'}", f"out={tmp_path / 'pred'}")
    assert rc == 0, err
    evaluated = (tmp_path / "eval" / "data" / "000000.txt").read_text()
    assert len(evaluated.splitlines()) >= 10
    assert (tmp_path / "pred" / "kitti" / "000000.txt").read_text() == evaluated
    # without image= the default, wider image keeps more of the points in the camera's view
    rc, _, err = _run(capsys, *common, f"out={tmp_path / 'wide'}")
    assert rc == 0, err
    used = [json.loads((tmp_path / d / "json" / "000000.json").read_text())["points_used"] for d in ("pred", "wide")]
    assert used[0] < used[1]


def test_bad_block_size_is_one_line_naming_the_key(predicted_ckpt, tmp_path, capsys):
    """``block_size=`` a value that is no tile, dense or auto: one line naming the key, with nothing written (the values
    that run: tests/commands/test_execution_invariance.py)."""
    good = tmp_path / "good"
    good.mkdir()
    write_point_cloud(good / "000001.bin", _scan())
    rc, _, err = _run(capsys, f"ckpt_path={predicted_ckpt}", f"input={good}", f"out={tmp_path / 'bad'}",
                      "block_size=fast")
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "block_size" in lines[0] and _files(tmp_path / "bad") == []


# --- score_threshold, the output folder, the 3D picture's console (issue 52) ----------------------------------------
def test_score_threshold_counts_draws_and_filters_when_asked(car_root, scoring_ckpt, tmp_path, capsys):
    """As the user meets it (scripts/predict.py, no XDG_RUNTIME_DIR): the summary says the threshold it counts at and
    how many boxes the files hold (every decoded one by default); the picture draws only the boxes at or above it; a
    rerun into the non-empty folder is refused in one line and changes nothing, overwrite=true writes over it; with
    filter_files=true the files hold only the counted boxes; picture=3d prints none of the window system's lines."""
    cloud = car_root / "training" / "velodyne" / "000003.bin"
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    cmd = [sys.executable, "scripts/predict.py", f"ckpt_path={scoring_ckpt}", f"input={cloud}", f"out={out}"]
    r = subprocess.run([*cmd, "picture=both", "picture_size=300"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    import open3d as o3d

    from detector.build import load_detector

    grid = load_detector(scoring_ckpt)[0].grid  # picture_size: pixels on the map's long side, the legend under it
    x_ext, y_ext = grid.x_range[1] - grid.x_range[0], grid.y_range[1] - grid.y_range[0]
    img = np.asarray(o3d.io.read_image(str(out / "bev" / "000003.png")))
    longest = max(x_ext, y_ext)
    assert img.shape[1] == round(300 * y_ext / longest) and img.shape[0] > round(300 * x_ext / longest)
    assert "XDG_RUNTIME_DIR" not in r.stderr and "error" not in r.stderr.lower(), r.stderr
    # an untrained head scores every box under 0.3: none counted, all 20 in the files, none drawn
    assert "1 frame(s), boxes scored >= 0.3: none; the files hold all 20 decoded (scores >= 0)" in r.stdout
    scores = [b["score"] for b in json.loads((out / "json" / "000003.json").read_text())["boxes"]]
    assert len(scores) == 20 and len((out / "txt" / "000003.txt").read_text().splitlines()) == 20
    from detector.viz import class_color

    assert not _colour_in_map(out / "bev" / "000003.png", class_color("Car"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["score_threshold"] == 0.3 and summary["boxes"] == {} and summary["boxes_decoded"] == {"Car": 20}
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    # the same folder again: refused before anything runs, nothing changed
    threshold = sorted(scores)[len(scores) // 2]  # the median score: about half the boxes at or above it
    above = sum(s >= threshold for s in scores)
    r = subprocess.run([*cmd, f"score_threshold={threshold}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and f"out={out}: the folder is not empty" in lines[0], r.stderr
    assert "overwrite=true" in lines[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    # overwrite=true, filter_files=true (in this process: the same command): counted, drawn and written alike
    rc, stdout, err = _run(capsys, *cmd[2:], f"score_threshold={threshold}", "overwrite=true", "filter_files=true")
    assert rc == 0, err
    assert f"boxes scored >= {threshold:g}: Car {above}; the files hold these only (filter_files=true)" in stdout
    written = json.loads((out / "json" / "000003.json").read_text())["boxes"]
    assert len(written) == above and min(b["score"] for b in written) >= threshold
    assert len((out / "txt" / "000003.txt").read_text().splitlines()) == above
    assert _colour_in_map(out / "bev" / "000003.png", class_color("Car"))


def _colour_in_map(png: Path, color) -> bool:
    """Whether ``color`` is drawn in the picture's map (above the legend, whose class swatches have it too)."""
    import open3d as o3d

    from detector.viz import LEGEND_BACKGROUND

    img = np.asarray(o3d.io.read_image(str(png)))
    legend = np.flatnonzero((img == np.asarray(LEGEND_BACKGROUND, np.uint8)).all(-1).all(-1))  # its blank rows
    top = legend.min() if len(legend) else len(img)
    return bool((img[:top] == np.asarray(color, np.uint8)).all(-1).any())


def test_a_failed_run_leaves_no_folder(tmp_path):
    """scripts/predict.py with a checkpoint that is not there: one line, exit 1, and out= (with the parents it would
    have made) not created."""
    cloud = tmp_path / "000001.bin"
    write_point_cloud(cloud, _scan())
    out = tmp_path / "new" / "out"
    r = subprocess.run([sys.executable, "scripts/predict.py", f"ckpt_path={tmp_path / 'none.ckpt'}", f"input={cloud}",
                        f"out={out}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "checkpoint not found" in lines[0], r.stderr
    assert not (tmp_path / "new").exists()


def test_runs_without_out_started_in_the_same_second_get_their_own_folders(tmp_path):
    """predict's default folder is named by the start time: a second run in the same second takes ``<time>_1`` (as
    training's run folders do), never the first run's folder; a folder the user names is refused when not empty."""
    from detector.commands.predict import _Output
    from detector.errors import ConfigError

    base = tmp_path / "outputs" / "predict" / "2026-01-01_00-00-00"
    first, second = _Output(base, False, timed=True), _Output(base, False, timed=True)
    assert (first.root, second.root) == (base, base.with_name(base.name + "_1"))
    first.file("json", "a.json").write_text("{}")
    first.release()
    second.remove_empty()  # a failed second run leaves nothing behind
    assert sorted(p.name for p in base.parent.iterdir()) == [base.name]
    assert [p.name for p in base.iterdir()] == ["json"]
    with pytest.raises(ConfigError, match="not empty"):
        _Output(base, False)
