"""The LiDAR simulator: determinism, physics of the scan, KITTI labeling rules, files readable by KittiRoot.

Frames use a coarser sweep (``columns`` below) than the default to stay fast; the scene and the labeling
are the same as in a full-resolution frame.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from detector.commands import make_dataset
from detector.data.kitti import KittiRoot
from detector.data.kitti_camera import project_to_image
from detector.data.kitti_labels import IMAGE_SIZE
from detector.errors import ConfigError
from detector.geometry.boxes import Boxes3D
from detector.sim.actors import VEHICLE_STYLES, vehicle_mesh
from detector.sim.labels import (
    MIN_HEIGHT_PX,
    MIN_POINTS,
    OCCLUSION_LEVELS,
    hidden_fractions,
    label_frame,
    occlusion_level,
    truncation,
    unclipped_image_boxes,
)
from detector.sim.meshes import ALBEDO, Material, box, fit_to_box
from detector.sim.scene import assemble_scene, generate_scene
from detector.sim.sensor import (
    LidarSpec,
    beam_elevations,
    camera_center,
    make_calibration,
    open_rays,
    ray_directions,
    scan,
)
from detector.sim.street import Street
from detector.sim.writer import generate_dataset, simulate_frame, write_frame

SPEC = LidarSpec(columns=1024)
NOISE_BOUND = 3 * SPEC.range_noise  # range noise is clipped at ±3σ
FLOAT_TOL = 2e-3  # float32 scene vertices and hit distances, 2-decimal label values


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def frame():
    return simulate_frame(seed=3, index=1, spec=SPEC)


@pytest.fixture(scope="module")
def written(frame, tmp_path_factory):
    root = tmp_path_factory.mktemp("sim_frame")
    write_frame(root, frame)
    return root


# --------------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------------
def test_same_seed_same_bytes_whatever_the_worker_count(tmp_path):
    spec = LidarSpec(columns=256)
    a = generate_dataset(tmp_path / "a", frames=2, seed=11, workers=1, spec=spec, progress=False)
    b = generate_dataset(tmp_path / "b", frames=2, seed=11, workers=2, spec=spec, progress=False)
    fa, fb = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert len(fa) == 2 * 4 + 4  # 2 frames × (bin, txt, txt, png) + grid.json, sim.json, train, val
    assert fa == fb
    assert (a.workers, b.workers) == (1, 2) and [s.index for s in b.frames] == [0, 1]
    generate_dataset(tmp_path / "c", frames=1, seed=12, workers=1, spec=spec, progress=False)
    fc = _files(tmp_path / "c")
    assert fc["training/velodyne/000000.bin"] != fa["training/velodyne/000000.bin"]
    assert fc["training/label_2/000000.txt"] != fa["training/label_2/000000.txt"]


def test_frame_does_not_depend_on_dataset_size(tmp_path):
    spec = LidarSpec(columns=128)
    generate_dataset(tmp_path / "a", frames=2, seed=5, workers=1, spec=spec, progress=False)
    generate_dataset(tmp_path / "b", frames=1, seed=5, workers=1, spec=spec, progress=False)
    for sub in ("velodyne/000000.bin", "label_2/000000.txt", "calib/000000.txt", "road_map/000000.png"):
        assert (tmp_path / "a/training" / sub).read_bytes() == (tmp_path / "b/training" / sub).read_bytes()


def test_image_sets_and_regeneration(tmp_path):
    spec = LidarSpec(columns=64)
    generate_dataset(tmp_path, frames=6, seed=0, workers=1, spec=spec, progress=False)
    root = KittiRoot(tmp_path)
    assert root.imageset("val") == ["000004"]
    assert root.imageset("train") == ["000000", "000001", "000002", "000003", "000005"]
    # Regenerating fewer frames into the same folder removes the frames left over.
    generate_dataset(tmp_path, frames=2, seed=0, workers=1, spec=spec, progress=False)
    assert sorted(p.name for p in (tmp_path / "training/velodyne").iterdir()) == ["000000.bin", "000001.bin"]


def test_refuses_foreign_folder_and_bad_arguments(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=str(tmp_path)):
        generate_dataset(tmp_path, frames=1, progress=False)
    with pytest.raises(ValueError, match="frames"):
        generate_dataset(tmp_path / "x", frames=0, progress=False)
    with pytest.raises(ValueError, match="seed"):
        generate_dataset(tmp_path / "x", frames=1, seed=-1, progress=False)
    with pytest.raises(ValueError, match="columns"):
        LidarSpec(columns=0)


def test_cli(tmp_path, capsys):
    main = make_dataset.main
    with pytest.raises(SystemExit, match="out=DIR is required"):
        main([])
    with pytest.raises(SystemExit, match="frames"):
        main([f"out={tmp_path}", "frames=0"])
    with pytest.raises(SystemExit, match="unexpected argument 'colums=3'"):
        main([f"out={tmp_path}", "colums=3"])
    (tmp_path / "file").write_text("x")
    assert main([f"out={tmp_path / 'file'}", "frames=1", "progress=false"]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert (
        main([f"out={tmp_path / 'ds'}", "frames=2", "seed=4", "workers=1", "columns=64", "progress=false"])
        == 0
    )
    out = capsys.readouterr().out
    assert "2 frames" in out and "points per frame" in out
    assert KittiRoot(tmp_path / "ds").imageset("train") == ["000000", "000001"]


# --------------------------------------------------------------------------------------------------
# Physics of the scan
# --------------------------------------------------------------------------------------------------
def test_every_point_is_the_first_surface_along_its_ray(frame):
    p = frame.scan.points[:, :3].astype(np.float64)
    r = np.linalg.norm(p, axis=1)
    t, prim = frame.scene.cast(np.zeros(3), p / r[:, None])
    assert (prim >= 0).all()
    # Nothing lies in front of a point along its ray (beyond the range noise), and the point is on the
    # surface it came from.
    assert (t >= r - NOISE_BOUND - FLOAT_TOL).all()
    assert np.abs(t - r).max() <= NOISE_BOUND + FLOAT_TOL
    assert np.allclose(t, frame.scan.t, atol=FLOAT_TOL)


def test_occluder_casts_a_shadow():
    """Known answer: a 2 m × 2 m pillar 10 m ahead in front of a wall 20 m ahead; no return from the wall
    inside the pillar's angular extent, and the pillar's face is seen at 10 m."""
    st = Street.straight()
    ground = box((-100, -100, -1.73 - 0.5), (100, 100, -1.73), Material.ASPHALT)
    wall = box((20, -30, -1.73), (21, 30, 10), Material.FACADE)
    pillar = box((10, -1, -1.73), (12, 1, 0.27), Material.CONCRETE)
    scene = assemble_scene([(ground, 1.0), (wall, 1.0), (pillar, 1.0)], [], st)
    sweep = scan(scene, LidarSpec(columns=2048, dropout=0.0, range_noise=0.0), np.random.default_rng(0))
    p = sweep.points[:, :3]
    az = np.degrees(np.arctan2(p[:, 1], p[:, 0]))
    el = np.degrees(np.arctan2(p[:, 2], np.hypot(p[:, 0], p[:, 1])))
    # Rays that pass the pillar's front face (x = 10, |y| < 1, z in [-1.73, 0.27]) with a margin.
    shadow = (np.abs(az) < math.degrees(math.atan(0.95 / 10))) & (el < math.degrees(math.atan(0.25 / 10)))
    shadow &= el > math.degrees(math.atan(-1.7 / 10))
    assert shadow.sum() > 100
    assert np.allclose(p[shadow, 0], 10.0, atol=1e-3)
    on_wall = p[:, 0] > 19.9
    assert on_wall.sum() > 100
    assert not (on_wall & shadow).any()


def test_object_points_lie_in_their_labeled_boxes(frame, written):
    lab = frame.labels
    read = KittiRoot(written).read_frame("000001")
    objs = lab.labeled
    assert len(objs) == len(read.gt_boxes) >= 3
    assert list(read.gt_names) == [frame.scene.objects[i].name for i in objs]
    pts = frame.scan.points
    for k, i in enumerate(objs):
        mine = pts[frame.scan.obj == i]
        assert len(mine) >= MIN_POINTS
        inside = read.gt_boxes[k].points_in_boxes(mine, margin=NOISE_BOUND + FLOAT_TOL)[:, 0]
        assert inside.all(), (
            f"object {i} ({frame.scene.objects[i].name}): {int((~inside).sum())} points outside"
        )


def test_noise_free_points_lie_in_their_boxes_tightly():
    spec = LidarSpec(columns=512, range_noise=0.0)
    f = simulate_frame(seed=3, index=2, spec=spec)
    boxes = Boxes3D(np.stack([o.box for o in f.scene.objects]))
    hit = f.scan.obj >= 0
    assert hit.sum() > 500
    inside = boxes.points_in_boxes(f.scan.points[hit], margin=FLOAT_TOL)  # [M, N]
    assert inside[np.arange(hit.sum()), f.scan.obj[hit]].all()


def test_the_64_rings_are_present(frame):
    p = frame.scan.points.astype(np.float64)
    el = np.sort(np.degrees(np.arctan2(p[:, 2], np.hypot(p[:, 0], p[:, 1]))))
    breaks = np.flatnonzero(np.diff(el) > 0.1)  # beams are >= 1/3 degree apart
    clusters = np.split(el, breaks + 1)
    assert len(clusters) == 64
    centres = np.array([c.mean() for c in clusters])[::-1]
    assert np.allclose(centres, beam_elevations(), atol=0.01)
    assert centres[0] == pytest.approx(2.0, abs=0.01) and centres[-1] == pytest.approx(-24.8, abs=0.01)
    assert np.array_equal(np.unique(frame.scan.ring), np.arange(64))


def test_density_falls_with_range_and_reflectance_is_kitti_like(frame):
    p = frame.scan.points
    r = np.hypot(p[:, 0], p[:, 1])
    near = ((r > 5) & (r < 10)).sum() / (math.pi * (10**2 - 5**2))
    far = ((r > 30) & (r < 40)).sum() / (math.pi * (40**2 - 30**2))
    assert near > 20 * far
    assert r.max() <= SPEC.max_range + NOISE_BOUND
    assert p[:, 3].min() >= 0 and p[:, 3].max() <= 0.99
    assert np.allclose(p[:, 3] * 100, np.round(p[:, 3] * 100), atol=1e-3)  # 0.01 steps like KITTI
    assert 0.1 < np.median(p[:, 3]) < 0.5


def _flat_ground_scene():
    ground = box((-150, -150, -1.73 - 0.5), (150, 150, -1.73), Material.ASPHALT)
    return assemble_scene([(ground, 1.0)], [], Street.straight())


def test_the_ego_car_blocks_the_rays_that_meet_its_roof():
    """A ray whose direction meets the ``ego_body`` rectangle (at its height z) gives no point; without the
    ego car the same scene has such points, and every ray counts as fired either way."""
    scene = _flat_ground_scene()
    x0, x1, y0, y1, z = LidarSpec().ego_body
    for body, blocked_points in ((LidarSpec().ego_body, False), (None, True)):
        spec = LidarSpec(columns=1024, dropout=0.0, range_noise=0.0, ego_body=body)
        sweep = scan(scene, spec, np.random.default_rng(0))
        p = sweep.points[:, :3].astype(np.float64)
        s = z / p[:, 2]  # every point of this scene lies below the sensor
        x, y = p[:, 0] * s, p[:, 1] * s
        meets = (x > x0 + 1e-3) & (x < x1 - 1e-3) & (y > y0 + 1e-3) & (y < y1 - 1e-3)
        assert meets.any() == blocked_points
        assert sweep.rays == 64 * 1024
    # Blocked rays are low beams behind the sensor: none ahead; none above the elevation of the rectangle's
    # farthest corner, atan(0.5 / hypot(1.8, 0.85)) = 14.1 deg below the horizon.
    d = ray_directions(1024)
    blocked = np.setdiff1d(np.arange(len(d)), open_rays(1024, LidarSpec().ego_body))
    lowest = -math.atan2(-z, math.hypot(x0, y1))
    assert len(blocked) > 0 and (d[blocked, 0] < 0).all() and (d[blocked, 2] < math.sin(lowest)).all()


def test_weak_returns_read_zero_reflectance():
    """With no spread in the test, a return from asphalt (albedo 0.45, never DARK) reads 0 exactly when
    0.45 · (20 m / r)² < zero_signal, i.e. beyond 20 · sqrt(0.45 / 0.1) = 42.4 m."""
    spec = LidarSpec(columns=1024, dropout=0.0, range_noise=0.0, zero_spread=0.0, zero_signal=0.1)
    sweep = scan(_flat_ground_scene(), spec, np.random.default_rng(0))
    weak = ALBEDO[Material.ASPHALT] * (20.0 / np.maximum(sweep.t, 1.0)) ** 2 < 0.1
    assert weak.any() and (~weak).any()
    assert np.array_equal(sweep.points[:, 3] == 0, weak)


def test_static_scenery_keeps_off_the_road():
    """Shrubs, walls, bins, trees, lamps and signs stand beside the road: between the kerbs (and on the cross
    street) nothing static rises 0.3-1.8 m above the ground, where it would look like an unlabeled car."""
    for i in range(6):
        rng = np.random.default_rng(i)
        scene = generate_scene(rng, make_calibration(rng))
        st = scene.street
        v = scene.vertices[scene.triangles[scene.tri_object == -1]].reshape(-1, 3).astype(np.float64)
        uv = st.to_street(v[:, :2])
        h = v[:, 2] - st.ground_z(uv[:, 0], uv[:, 1])
        u, w, e = uv[:, 0], uv[:, 1], 0.01  # 1 cm inside the road: parts may end exactly at its border
        inside = st.drivable(u - e, w) & st.drivable(u + e, w) & st.drivable(u, w - e) & st.drivable(u, w + e)
        on_road = inside & (h > 0.3) & (h < 1.8)
        assert not on_road.any(), (i, v[on_road][:5])
    assert (scene.tri_material == Material.FOLIAGE).any()


# --------------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------------
def test_labels_only_in_the_camera_field_of_view(frame, written):
    read = KittiRoot(written).read_frame("000001")
    labels = read.labels
    w, h = IMAGE_SIZE
    assert ((labels.bbox[:, 0] >= 0) & (labels.bbox[:, 2] <= w - 1)).all()
    assert ((labels.bbox[:, 1] >= 0) & (labels.bbox[:, 3] <= h - 1)).all()
    obj = labels.name != "DontCare"
    assert ((labels.bbox[obj, 3] - labels.bbox[obj, 1]) >= MIN_HEIGHT_PX - 0.01).all()
    _, visible = project_to_image(read.gt_boxes, read.calib, IMAGE_SIZE)
    assert visible.all()
    # Objects whose box is entirely outside the image (e.g. behind the sensor) are never in the file,
    # and every object with LiDAR points whose box projects into the image is in it (labeled or DontCare).
    boxes = Boxes3D(np.stack([o.box for o in frame.scene.objects]))
    _, in_image = project_to_image(boxes, frame.calib, IMAGE_SIZE)
    n_points = np.bincount(frame.scan.obj[frame.scan.obj >= 0], minlength=len(boxes))
    listed = frame.labels.objects
    assert len(set(listed.tolist())) == len(listed) == len(labels)
    assert in_image[listed].all()
    assert (n_points[~in_image] > 0).any()  # there were objects with points to leave out
    assert set(np.flatnonzero(in_image & (n_points > 0)).tolist()) <= set(listed.tolist())
    assert len(frame.labels.labeled) >= 3


def test_occlusion_known_answer():
    """A car right behind a van, both 15 m ahead of the camera: the van fully visible, the car hidden."""
    rng = np.random.default_rng(0)
    calib = make_calibration(rng)
    st = Street.straight()
    ground = box((-100, -100, -1.73 - 0.5), (100, 100, -1.73), Material.ASPHALT)
    van = vehicle_mesh("van", 5.0, 2.0, 2.4, rng)
    car = vehicle_mesh("sedan", 4.0, 1.7, 1.5, rng)
    cam = camera_center(calib)
    objects = [
        ("Van", [15.0 + cam[0], cam[1], -1.73 + 1.2, 5.0, 2.0, 2.4, 0.0], van, 1.0, False),
        ("Car", [22.0 + cam[0], cam[1], -1.73 + 0.75, 4.0, 1.7, 1.5, 0.0], car, 1.0, False),
        ("Car", [20.0 + cam[0], cam[1] - 6.0, -1.73 + 0.75, 4.0, 1.7, 1.5, 0.0], car, 1.0, False),
    ]
    scene = assemble_scene([(ground, 1.0)], objects, st)
    hidden, n_in = hidden_fractions(scene, np.arange(3), calib, rng, samples=400)
    assert (n_in > 300).all()
    assert hidden[0] < OCCLUSION_LEVELS[0] and hidden[2] < OCCLUSION_LEVELS[0]
    assert hidden[1] > OCCLUSION_LEVELS[-1]
    sweep = scan(scene, LidarSpec(columns=2048, dropout=0.0), rng)
    fl = label_frame(scene, sweep, calib, rng)
    names = fl.labels.name.tolist()
    assert sorted(names[:2]) == ["Car", "Van"] and fl.objects[:2].tolist() in ([0, 2], [2, 0])
    assert all(n == "DontCare" for n in names[2:])  # the hidden car, seen over the van by the LiDAR
    assert (fl.labels.occluded[:2] == 0).all() and (fl.labels.truncated[:2] == 0).all()


def test_truncation_and_occlusion_levels(calib):
    assert truncation(np.array([[100.0, 100.0, 200.0, 200.0]]))[0] == 0.0
    assert truncation(np.array([[-100.0, 100.0, 100.0, 200.0]]))[0] == pytest.approx(0.5)
    assert truncation(np.array([[2000.0, 100.0, 2100.0, 200.0]]))[0] == 1.0
    assert occlusion_level(np.array([0.0, 0.19, 0.3, 0.6, 0.9])).tolist() == [0, 0, 1, 2, 3]
    # A box straight ahead projects inside the image, unclipped == clipped.
    b = Boxes3D(np.array([[20.0, 0.0, -0.9, 4.0, 1.7, 1.5, 0.0]]))
    un = unclipped_image_boxes(b, calib)
    clipped, vis = project_to_image(b, calib)
    assert vis[0] and np.allclose(un, clipped, atol=1e-6)
    # Behind the camera: no projection.
    assert np.isnan(unclipped_image_boxes(Boxes3D(np.array([[-20.0, 0, -0.9, 4, 1.7, 1.5, 0]])), calib)).all()


def test_label_values_are_on_the_file_grid(frame, written):
    """Boxes are placed so the 2-decimal label file describes them exactly."""
    read = KittiRoot(written).read_frame("000001")
    objs = frame.labels.labeled
    truth = np.stack([frame.scene.objects[i].box for i in objs])
    assert np.allclose(read.gt_boxes.tensor.double().numpy(), truth, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Files, calibration, road map, meshes
# --------------------------------------------------------------------------------------------------
def test_files_read_back(frame, written):
    root = KittiRoot(written)
    read = root.read_frame("000001", road_map=True)
    assert np.array_equal(read.points, frame.scan.points)
    for key in ("P0", "P1", "P2", "P3", "R0_rect", "Tr_velo_to_cam", "Tr_imu_to_velo"):
        assert np.allclose(getattr(read.calib, key), getattr(frame.calib, key), rtol=1e-11, atol=1e-12)
    rm = read.road_map
    assert rm.raster.shape == (800, 704) and rm.resolution == pytest.approx(0.1)
    assert (rm.x_min, rm.y_min) == (0.0, -40.0)
    # The ego vehicle stands on the road; the road is a minority of the 70 m x 80 m area.
    assert rm.raster[400, :50].all()
    assert 0.05 < rm.raster.mean() < 0.6
    st = frame.scene.street
    xy = np.array([[35.0, 0.0], [35.0, 39.0]])
    uv = st.to_street(xy)
    assert rm.raster[int((xy[0, 1] + 40) / 0.1), 350] == st.drivable(*uv[0])
    assert rm.raster[int((xy[1, 1] + 40) / 0.1), 350] == st.drivable(*uv[1])


def test_calibration_is_kitti_like():
    calib = make_calibration(np.random.default_rng(1))
    c2 = camera_center(calib, 2)
    assert np.allclose(c2, [0.27, 0.06, -0.08], atol=0.06)
    f = calib.P2[0, 0]
    assert 700 < f < 730 and 600 < calib.P2[0, 2] < 615 and 170 < calib.P2[1, 2] < 182
    # The camera looks along the LiDAR's x axis: a point 20 m ahead lands near the principal point.
    uv, depth = calib.lidar_to_image(np.array([[20.0, 0.06, -0.08]]))
    assert depth[0] > 19 and np.allclose(uv[0], calib.P2[:2, 2], atol=15)


@pytest.mark.parametrize("style", VEHICLE_STYLES)
def test_vehicle_meshes_are_shaped_and_fit_their_box(style):
    rng = np.random.default_rng(0)
    mesh = vehicle_mesh(style, 4.5, 1.8, 1.6, rng)
    assert len(mesh.triangles) > 60
    fitted = fit_to_box(mesh, (4.21, 1.73, 1.52))
    lo, hi = fitted.bounds()
    assert np.allclose(lo, [-2.105, -0.865, -0.76], atol=1e-12) and np.allclose(
        hi, [2.105, 0.865, 0.76], atol=1e-12
    )
    # Not a plain box: the mesh's volume is well below its bounding box's (area-weighted divergence).
    v, t = fitted.vertices, fitted.triangles
    vol = abs(np.einsum("ij,ij->i", v[t[:, 0]], np.cross(v[t[:, 1]], v[t[:, 2]])).sum()) / 6
    assert vol < 0.9 * 4.21 * 1.73 * 1.52
    assert {Material.TYRE, Material.PAINT} <= set(mesh.material.tolist())
