"""Domain statistics (detector/data/domains.py) on hand-built frames, the distances on known distributions,
and the domain report (scripts/compare_domains.py) end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from detector.bench import compare_domains
from detector.data.domains import collect, compare, elevation_deg, fit_ground, ks_statistic, wasserstein_1d
from detector.data.kitti import write_points
from detector.data.kitti_calib import Calibration
from detector.data.kitti_camera import boxes_to_labels
from detector.data.kitti_labels import write_label
from detector.geometry.boxes import Boxes3D
from detector.resources import config_dir
from tests.paths import REPO

REAL = REPO / ".." / "shared" / "kitti_real"
GRID = instantiate(OmegaConf.load(config_dir() / "bev" / "small.yaml"))


# --------------------------------------------------------------------------------------------------
# Distances
# --------------------------------------------------------------------------------------------------
def test_w1_of_shifted_samples_is_the_shift():
    assert wasserstein_1d([0.0], [3.0]) == pytest.approx(3.0)
    a = np.array([0.0, 1.0, 5.0, 7.5])
    assert wasserstein_1d(a, a + 2.0) == pytest.approx(2.0)
    assert wasserstein_1d(a, a) == 0.0


def test_w1_known_answer_and_symmetry():
    # F_a - F_b = 0.5 on [1, 2), 0 elsewhere -> area 0.5
    assert wasserstein_1d([0.0, 1.0], [0.0, 2.0]) == pytest.approx(0.5)
    assert wasserstein_1d([0.0, 2.0], [0.0, 1.0]) == pytest.approx(0.5)
    # Different sample counts: {0, 0, 1, 1} is the same distribution as {0, 1}.
    assert wasserstein_1d([0.0, 0.0, 1.0, 1.0], [0.0, 1.0]) == pytest.approx(0.0)


def test_ks_known_answers():
    a = np.array([0.1, 0.4, 0.7])
    assert ks_statistic(a, a) == 0.0
    assert ks_statistic(a, a + 10.0) == 1.0
    # At x = 0.5: F_a = 1/2, F_b = 0 -> 0.5 is the largest gap.
    assert ks_statistic([0.0, 1.0], [0.5, 1.5]) == pytest.approx(0.5)


def test_distances_refuse_empty_samples():
    with pytest.raises(ValueError):
        wasserstein_1d([], [1.0])


# --------------------------------------------------------------------------------------------------
# Per-frame measurements on hand-built points
# --------------------------------------------------------------------------------------------------
def test_elevation_of_known_points():
    p = np.array([[10.0, 0.0, 10.0], [1.0, 1.0, 0.0], [3.0, 4.0, -5.0], [0.0, -2.0, -2.0 * math.tan(0.1)]])
    assert np.allclose(elevation_deg(p), [45.0, 0.0, -45.0, -math.degrees(0.1)])


def test_ground_plane_height_and_slope():
    x, y = np.meshgrid(np.arange(2.0, 18.0, 0.5), np.arange(-6.0, 6.0, 0.5))
    x, y = x.ravel(), y.ravel()
    ground = np.stack([x, y, -1.75 + 0.02 * x], axis=1)
    above = ground[::7] + [0.0, 0.0, 1.0]  # objects: a metre above the road
    g = fit_ground(np.concatenate([ground, above]))
    assert g.height == pytest.approx(-1.75, abs=1e-6)
    assert g.slope_deg == pytest.approx(math.degrees(math.atan(0.02)), abs=1e-4)
    assert g.is_ground[: len(ground)].all() and not g.is_ground[len(ground):].any()


# --------------------------------------------------------------------------------------------------
# A hand-built KITTI-format frame
# --------------------------------------------------------------------------------------------------
def _calib() -> Calibration:
    """An ideal rig: camera at the LiDAR origin, axes x_cam = -y, y_cam = -z, z_cam = x; f = 700 px."""
    K = np.array([[700.0, 0.0, 621.0], [0.0, 700.0, 187.0], [0.0, 0.0, 1.0]])
    P = np.hstack([K, np.zeros((3, 1))])
    axes = np.array([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
    zero = np.zeros((3, 1))
    return Calibration(P, P, P, P, np.eye(3), np.hstack([axes, zero]), np.hstack([np.eye(3), zero]))


def _hand_root(root: Path) -> dict:
    """One frame: a ground plane z = -1.75 + 0.01 x (210 points on a 0.5 m lattice beside the car,
    reflectance 0.3), one Car (l 4, w 1.6, h 1.5 at x = 12) with 24 points inside (reflectance 0.7)."""
    x, y = np.meshgrid(np.arange(8.0, 18.01, 0.5), np.r_[np.arange(-3.0, -0.99, 0.5), np.arange(1.0, 3.01, 0.5)])
    x, y = x.ravel(), y.ravel()
    ground = np.stack([x, y, -1.75 + 0.01 * x, np.full(len(x), 0.3)], axis=1)
    cx, cy, cz = np.meshgrid([10.5, 11.5, 12.5, 13.5], [-0.5, 0.0, 0.5], [-1.0, -0.5])
    car = np.stack([cx.ravel(), cy.ravel(), cz.ravel(), np.full(cx.size, 0.7)], axis=1)
    calib = _calib()
    box = Boxes3D(np.array([[12.0, 0.0, -0.88, 4.0, 1.6, 1.5, 0.0]]))
    base = root / "training"
    for sub in ("velodyne", "label_2", "calib"):
        (base / sub).mkdir(parents=True)
    write_points(base / "velodyne" / "000000.bin", np.concatenate([ground, car]).astype(np.float32))
    calib.to_file(base / "calib" / "000000.txt")
    write_label(base / "label_2" / "000000.txt", boxes_to_labels(box, np.array(["Car"]), calib))
    return {"ground": len(ground), "car": len(car)}


def test_statistics_of_a_hand_built_frame(tmp_path):
    n = _hand_root(tmp_path)
    s = collect(tmp_path, GRID)
    assert s.frames == 1
    assert s.samples["points_per_frame"].tolist() == [n["ground"] + n["car"]]
    assert s.samples["points_per_frame_fov"].tolist() == [n["ground"] + n["car"]]  # all in the image
    assert s.elevation_hist.sum() == n["ground"] + n["car"]
    assert s.samples["car_points_0-20m"].tolist() == [n["car"]]
    assert len(s.samples["car_points_20-40m"]) == 0
    assert np.all(s.samples["intensity_car"] == np.float32(0.7))
    assert s.samples["ground_height_m"][0] == pytest.approx(-1.75, abs=1e-4)
    assert s.samples["ground_slope_deg"][0] == pytest.approx(math.degrees(math.atan(0.01)), abs=1e-3)
    assert len(s.samples["intensity_ground"]) == n["ground"]
    assert np.all(s.samples["intensity_ground"] == np.float32(0.3))
    assert s.samples["car_length_m"].tolist() == pytest.approx([4.0])
    assert s.samples["car_width_m"].tolist() == pytest.approx([1.6])
    assert s.samples["car_distance_m"].tolist() == pytest.approx([12.0], abs=0.01)
    assert abs(s.samples["car_yaw_deg"][0]) < 0.1  # label files keep rotation_y to 0.01 rad
    assert s.samples["cars_per_frame"].tolist() == [1]
    assert s.objects == {"Car": {"all": 1.0, "0-20m": 1.0}}
    # BEV: every ground point in its own 0.2 m cell of slice 2 (z -1.80..-1.45), the car's 12 columns in
    # slices 4 (z = -1.0) and 5 (z = -0.5).
    cells = GRID.H * GRID.W
    expect = np.zeros(GRID.n_slices)
    expect[2], expect[4], expect[5] = n["ground"] / cells, 12 / cells, 12 / cells
    assert np.allclose(s.bev_occupancy, expect)
    assert s.bev_mean[-1] == pytest.approx((n["ground"] * 0.3 + 12 * 0.7) / cells, rel=1e-5)  # max per column
    # A domain compared with itself is at distance 0.
    assert all(d.w1 == 0 and d.ks == 0 for d in compare(s, s) if not math.isnan(d.w1))


# --------------------------------------------------------------------------------------------------
# The report end to end
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_roots(tmp_path_factory):
    from detector.sim import LidarSpec, generate_dataset

    base = tmp_path_factory.mktemp("domains")
    for name, seed in (("a", 0), ("b", 1)):
        generate_dataset(base / name, 2, seed=seed, workers=1, spec=LidarSpec(columns=256), progress=False)
    return base


def test_report_end_to_end(tiny_roots, tmp_path, capsys):
    out = tmp_path / "report"
    rc = compare_domains.main([f"sim={tiny_roots / 'a'}", f"real={tiny_roots / 'b'}", f"baseline={tiny_roots / 'a'}",
                         f"out={out}"])
    assert rc == 0
    # out= is a folder: the JSON, the markdown and the PNGs all go into it, nothing anywhere else.
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "domains", "domains/objects.png", "domains/points.png", "domains/scene.png", "domains_cpu.json",
        "domains_cpu.md"]
    r = json.loads((out / "domains_cpu.json").read_text())
    assert set(r["domains"]) == {"real", "sim", "before"}
    assert r["domains"]["sim"]["frames"] == 2
    assert r["meta"]["plots"] == [str(out / "domains" / f"{n}.png") for n in ("points", "objects", "scene")]
    # The baseline is the same root: its distances equal sim's.
    assert r["distances"]["sim"] == r["distances"]["before"]
    names = [d["name"] for d in r["distances"]["sim"]]
    assert "elevation_deg" in names and f"bev_occupancy_slice{GRID.n_slices - 1}" in names
    md = (out / "domains_cpu.md").read_text()
    assert "| elevation_deg |" in md and "W1/σ before" in md
    assert "With 2 real frames the per-frame" in md  # the actual count, not a fixed 10
    assert f"`{out / 'domains' / 'points.png'}`" in md
    pngs = sorted((out / "domains").glob("*.png"))
    assert len(pngs) == 3 and all(0 < p.stat().st_size < 150_000 for p in pngs)


def test_report_default_folder_is_the_committed_report():
    """Without out= the report lands where the committed one is (its paths in the markdown do not change)."""
    mod = compare_domains
    out = Path(mod.DEFAULTS["out"])
    assert (out / mod.REPORT_JSON, out / mod.REPORT_MD, out / mod.PLOTS_DIR) == (
        Path("benchmarks/domains_cpu.json"), Path("benchmarks/domains_cpu.md"), Path("benchmarks/domains"))
    committed = json.loads((REPO / "benchmarks" / "domains_cpu.json").read_text())["meta"]["plots"]
    assert committed == [f"benchmarks/domains/{n}.png" for n in ("points", "objects", "scene")]


def test_report_refuses_a_file_as_out(tiny_roots, tmp_path):
    with pytest.raises(SystemExit, match=r"out=.*x\.json: a folder is expected"):
        compare_domains.main([f"sim={tiny_roots / 'a'}", f"real={tiny_roots / 'b'}", f"out={tmp_path / 'x.json'}"])
    assert not (tmp_path / "x.json").exists()


def test_report_refuses_a_missing_root(tiny_roots, tmp_path, capsys):
    rc = compare_domains.main([f"sim={tmp_path / 'nope'}", f"real={tiny_roots / 'b'}", f"out={tmp_path / 'x'}"])
    assert rc == 1
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not REAL.is_dir(), reason="no ../shared/kitti_real (real KITTI frames) beside the checkout")
def test_report_against_real_kitti(tiny_roots, tmp_path):
    out = tmp_path / "d"
    assert compare_domains.main([f"sim={tiny_roots / 'a'}", f"out={out}"]) == 0
    real = json.loads((out / "domains_cpu.json").read_text())["domains"]["real"]
    assert real["frames"] == 10 and real["means"]["points_per_frame"] > 100_000
    assert real["objects_per_frame"]["Car"]["all"] > 1
