"""Procedural street scenes for the LiDAR simulator.

A scene is laid out in a *street frame* (u along the street, v to its left, metres), with the sensor at
the origin above the centre of its lane, then rotated into the LiDAR frame by the ego vehicle's small
heading offset ``Street.yaw``. The ground is a gently sloped plane ``z = -sensor_height + su·u + sv·v``.

Cross-section of the main street, right to left (right-hand traffic):
``yard | sidewalk | kerb | parking lane? | forward lanes | backward lanes | parking lane? | kerb | sidewalk
| yard``, with buildings set back behind the sidewalks, trees, street lamps and signs along the kerbs,
and an optional cross street (sometimes a T-junction: the main street ends there, buildings across).
Cars, vans, trucks and trailers park along the kerbs and drive in the lanes (and on the cross street),
pedestrians walk on the sidewalks or cross the road, cyclists ride near the kerbs. Objects do not
overlap (axis-aligned footprints in the street frame are kept apart).

Every dynamic object has a 3D box in the LiDAR frame that is the tight bounding box of its mesh, and whose
KITTI label values (camera-frame bottom centre, dimensions, rotation_y) are exact multiples of 0.01, so the
2-decimal label files describe the meshes exactly (see :func:`quantize_boxes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from detector.data.kitti import Calibration, RoadMap
from detector.data.sim_meshes import (
    ALBEDO,
    Material,
    TriMesh,
    box,
    cyclist_mesh,
    cylinder_z,
    ellipsoid,
    fit_to_box,
    limb,
    pedestrian_mesh,
    rot_z,
    vehicle_mesh,
)
from detector.data.structures import Boxes3D, wrap_angle

M = Material
# Materials whose reflectivity varies per instance (car paint colour, clothes, facades, road surface).
_VARIABLE = np.zeros(len(Material), dtype=bool)
_VARIABLE[[M.PAINT, M.CLOTH, M.FACADE, M.ASPHALT]] = True

# Extent of the scene along the street (m): the scan reaches 120 m, objects are placed in [-60, 110].
U_MIN, U_MAX = -150.0, 200.0


@dataclass
class SimObject:
    """A dynamic object: KITTI class ``name``, its ``box`` (x, y, z, l, w, h, yaw) in the LiDAR frame
    (float64), whether it is ``moving``, and its triangles ``[tri_start, tri_end)`` in the scene mesh."""

    name: str
    box: np.ndarray
    moving: bool
    tri_start: int = 0
    tri_end: int = 0


@dataclass
class Street:
    """The layout of one scene (street frame: u along the street, v to the left; see module doc)."""

    yaw: float  # street frame -> LiDAR frame rotation about z
    sensor_height: float
    slope: tuple[float, float]  # (su, sv): ground z = -sensor_height + su·u + sv·v
    kerb_right: float  # v of the right kerb (< 0)
    kerb_left: float
    kerb_height: float
    park_right: float  # widths of the parking lanes along the kerbs (0: none)
    park_left: float
    sidewalk_right: float  # widths
    sidewalk_left: float
    lane_width: float
    forward_lanes: np.ndarray  # v of the lane centres (traffic towards +u)
    backward_lanes: np.ndarray  # (traffic towards -u)
    lines: np.ndarray  # v of the painted lines
    lines_dashed: np.ndarray  # bool per line
    cross_u: float | None  # centre of the cross street (None: no cross street)
    cross_half: float  # half width of the cross street's carriageway
    dead_end: bool  # the main street ends at the cross street (a T-junction with buildings across)
    asphalt: float  # reflectivity of the road surface
    window_phase: float

    @classmethod
    def straight(
        cls, kerb_right: float = -5.0, kerb_left: float = 5.0, sensor_height: float = 1.73
    ) -> Street:
        """A flat, straight two-lane street along the LiDAR's x axis, without markings or cross street
        (for hand-built scenes)."""
        return cls(
            yaw=0.0,
            sensor_height=sensor_height,
            slope=(0.0, 0.0),
            kerb_right=kerb_right,
            kerb_left=kerb_left,
            kerb_height=0.12,
            park_right=0.0,
            park_left=0.0,
            sidewalk_right=3.0,
            sidewalk_left=3.0,
            lane_width=3.5,
            forward_lanes=np.array([-1.75]),
            backward_lanes=np.array([1.75]),
            lines=np.zeros(0),
            lines_dashed=np.zeros(0, bool),
            cross_u=None,
            cross_half=0.0,
            dead_end=False,
            asphalt=1.0,
            window_phase=0.0,
        )

    # --- frames -----------------------------------------------------------------------------------
    def to_lidar(self, uv: np.ndarray) -> np.ndarray:
        """[N, 2] street (u, v) -> LiDAR (x, y)."""
        uv = np.asarray(uv, np.float64)
        c, s = math.cos(self.yaw), math.sin(self.yaw)
        return np.stack([c * uv[..., 0] - s * uv[..., 1], s * uv[..., 0] + c * uv[..., 1]], axis=-1)

    def to_street(self, xy: np.ndarray) -> np.ndarray:
        """[N, 2] LiDAR (x, y) -> street (u, v)."""
        xy = np.asarray(xy, np.float64)
        c, s = math.cos(self.yaw), math.sin(self.yaw)
        return np.stack([c * xy[..., 0] + s * xy[..., 1], -s * xy[..., 0] + c * xy[..., 1]], axis=-1)

    def ground_z(self, u, v):
        """Height of the road surface at (u, v) in the LiDAR frame."""
        return -self.sensor_height + self.slope[0] * np.asarray(u) + self.slope[1] * np.asarray(v)

    @property
    def u_end(self) -> float:
        """Where the main street ends (inf: it runs through the scene)."""
        return self.cross_u + self.cross_half if self.dead_end else math.inf

    def in_cross(self, u) -> np.ndarray:
        if self.cross_u is None:
            return np.zeros(np.shape(u), dtype=bool)
        return np.abs(np.asarray(u) - self.cross_u) < self.cross_half

    # --- drivable area and painted surfaces ---------------------------------------------------------
    def drivable(self, u, v) -> np.ndarray:
        """Road surface between the kerbs of the main street, or on the cross street."""
        u, v = np.asarray(u), np.asarray(v)
        return ((v > self.kerb_right) & (v < self.kerb_left) & (u < self.u_end)) | self.in_cross(u)

    def road_map(self, x_range=(0.0, 70.4), y_range=(-40.0, 40.0), resolution: float = 0.1) -> RoadMap:
        """The drivable area as a LiDAR-frame BEV raster (cell centres tested)."""
        cols = int(round((x_range[1] - x_range[0]) / resolution))
        rows = int(round((y_range[1] - y_range[0]) / resolution))
        x = x_range[0] + (np.arange(cols) + 0.5) * resolution
        y = y_range[0] + (np.arange(rows) + 0.5) * resolution
        c, s = math.cos(self.yaw), math.sin(self.yaw)
        u = c * x[None, :] + s * y[:, None]  # [rows, cols]
        v = -s * x[None, :] + c * y[:, None]
        raster = self.drivable(u, v)
        return RoadMap(raster, float(x_range[0]), float(y_range[0]), float(resolution))

    def painted(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Lane markings (0.12 m wide; dashes 3 m every 9 m) and a zebra crossing before the cross street."""
        u, v = np.asarray(u), np.asarray(v)
        out = np.zeros(u.shape, dtype=bool)
        on_main = (v > self.kerb_right) & (v < self.kerb_left) & ~self.in_cross(u) & (u < self.u_end)
        for lv, dashed in zip(self.lines, self.lines_dashed, strict=True):
            hit = np.abs(v - lv) < 0.06
            if dashed:
                hit &= np.mod(u, 9.0) < 3.0
            out |= hit
        out &= on_main
        if self.cross_u is not None:
            zu = u - (self.cross_u - self.cross_half - 1.0)
            zebra = (
                (zu < 0) & (zu > -3.0) & (np.mod(v, 1.0) < 0.5) & (v > self.kerb_right) & (v < self.kerb_left)
            )
            out |= zebra
        return out

    def window(self, u: np.ndarray, v: np.ndarray, height: np.ndarray, normal_uv: np.ndarray) -> np.ndarray:
        """Window panes on building facades (1.4 m wide, 1.5 m tall, storeys of 3.2 m)."""
        along = np.where(np.abs(normal_uv[:, 1]) > np.abs(normal_uv[:, 0]), u, v) + self.window_phase
        storey = np.mod(height, 3.2)
        return (height > 1.0) & (storey > 0.9) & (storey < 2.4) & (np.mod(along, 3.0) < 1.4)


@dataclass
class Scene:
    """A scene in the LiDAR frame: one triangle mesh with per-triangle material, reflectivity and owner
    (index into ``objects``, -1 for static geometry)."""

    vertices: np.ndarray  # [V, 3] float32
    triangles: np.ndarray  # [T, 3] uint32
    tri_material: np.ndarray  # [T] uint8
    tri_albedo: np.ndarray  # [T] float32
    tri_object: np.ndarray  # [T] int32
    objects: list[SimObject]
    street: Street
    _caster: object = field(default=None, repr=False)

    _normals: np.ndarray | None = field(default=None, repr=False)

    def normals(self, prim: np.ndarray) -> np.ndarray:
        """Unit normals of the given triangles (float64)."""
        if self._normals is None:
            v = self.vertices.astype(np.float64)
            t = self.triangles.astype(np.int64)
            n = np.cross(v[t[:, 1]] - v[t[:, 0]], v[t[:, 2]] - v[t[:, 0]])
            self._normals = n / np.maximum(np.linalg.norm(n, axis=1, keepdims=True), 1e-12)
        return self._normals[prim]

    def cast(self, origins: np.ndarray, directions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """First hit of each ray: (t [N] in units of the direction's length, inf when nothing is hit;
        triangle index [N], -1 when nothing is hit). Single-threaded, so results do not depend on the
        machine's core count."""
        import open3d as o3d

        if self._caster is None:
            rs = o3d.t.geometry.RaycastingScene(nthreads=1)
            rs.add_triangles(o3d.core.Tensor(self.vertices), o3d.core.Tensor(self.triangles))
            self._caster = rs
        rays = np.concatenate([np.broadcast_to(origins, directions.shape), directions], axis=1)
        res = self._caster.cast_rays(
            o3d.core.Tensor(np.ascontiguousarray(rays, dtype=np.float32)), nthreads=1
        )
        t = res["t_hit"].numpy().astype(np.float64)
        prim = res["primitive_ids"].numpy().astype(np.int64)
        hit = np.isfinite(t)
        prim[~hit] = -1
        return t, prim


# --------------------------------------------------------------------------------------------------
# Labels on the 0.01 grid
# --------------------------------------------------------------------------------------------------
def quantize_boxes(boxes: np.ndarray, calib: Calibration) -> np.ndarray:
    """[N, 7] LiDAR boxes nearest to ``boxes`` whose KITTI label values (bottom centre in the rectified
    camera frame, h, w, l and rotation_y) are multiples of 0.01, i.e. what a 2-decimal label file stores."""
    boxes = np.asarray(boxes, np.float64).reshape(-1, 7)
    if len(boxes) == 0:
        return boxes
    loc, dims, ry = Boxes3D(boxes).to_camera(calib)
    loc, dims = np.round(loc, 2), np.round(dims, 2)
    ry = np.round(ry, 2)  # to_camera gives [-pi, pi): rounding stays within [-3.14, 3.14]
    return Boxes3D.from_camera(loc, dims, ry, calib).tensor.numpy()


# --------------------------------------------------------------------------------------------------
# Scene generation
# --------------------------------------------------------------------------------------------------
@dataclass
class _Part:
    mesh: TriMesh  # street frame (static) or object frame (dynamic)
    scale: float = 1.0  # reflectivity factor for the materials in _VARIABLE
    obj: int = -1


@dataclass
class _Placement:
    name: str
    mesh: TriMesh  # local frame, ground at z = 0
    u: float
    v: float
    heading: float  # street frame
    on_sidewalk: bool
    moving: bool
    scale: float


class _Occupancy:
    """Axis-aligned footprints (street frame) of what is already placed, to avoid collisions."""

    def __init__(self):
        self.rects: list[tuple[float, float, float, float]] = []

    @staticmethod
    def footprint(u, v, l, w, heading, margin):
        c, s = abs(math.cos(heading)), abs(math.sin(heading))
        hu = (l * c + w * s) / 2 + margin
        hv = (l * s + w * c) / 2 + margin
        return (u - hu, u + hu, v - hv, v + hv)

    def free(self, r) -> bool:
        return not any(r[0] < q[1] and q[0] < r[1] and r[2] < q[3] and q[2] < r[3] for q in self.rects)

    def add(self, r) -> None:
        self.rects.append(r)


# Size distributions (metres) per class, after KITTI's statistics: (mean, std, min, max) for l, w, h.
_SIZES = {
    "Car": ((4.0, 0.35, 3.3, 4.9), (1.66, 0.09, 1.45, 1.95), (1.52, 0.09, 1.35, 1.75)),
    "Van": ((5.0, 0.4, 4.3, 6.0), (1.92, 0.1, 1.75, 2.15), (2.15, 0.2, 1.8, 2.7)),
    "Truck": ((9.0, 2.0, 6.0, 12.5), (2.5, 0.08, 2.3, 2.6), (3.2, 0.25, 2.7, 3.8)),
    "Misc": ((3.2, 0.4, 2.4, 4.2), (1.7, 0.12, 1.4, 2.0), (1.5, 0.3, 1.0, 2.1)),
}
_CAR_STYLES = ("sedan", "hatchback", "wagon", "suv")
_CAR_STYLE_P = (0.35, 0.3, 0.2, 0.15)


def _pick(rng: np.random.Generator, values: Sequence, probs: Sequence[float]):
    """One of ``values`` drawn with probabilities ``probs`` (cheaper than Generator.choice)."""
    x, acc = rng.random() * sum(probs), 0.0
    for value, p in zip(values, probs, strict=True):
        acc += p
        if x < acc:
            return value
    return values[-1]


def _normal(rng, mean, std, lo, hi) -> float:
    return float(np.clip(rng.normal(mean, std), lo, hi))


@dataclass
class _Vehicle:
    """A vehicle drawn but not built yet (its mesh is built only once its place is found)."""

    name: str
    style: str
    l: float
    w: float
    h: float

    def build(self, rng: np.random.Generator) -> TriMesh:
        return vehicle_mesh(self.style, self.l, self.w, self.h, rng)


def _vehicle(rng: np.random.Generator, parked: bool) -> _Vehicle:
    r = rng.random()
    if parked:
        name = "Car" if r < 0.87 else "Van" if r < 0.95 else "Truck" if r < 0.975 else "Misc"
    else:
        name = "Car" if r < 0.86 else "Van" if r < 0.94 else "Truck"
    l, w, h = (_normal(rng, *p) for p in _SIZES[name])
    if name == "Car":
        style = _pick(rng, _CAR_STYLES, _CAR_STYLE_P)
        if style == "suv":
            h = float(np.clip(h + 0.15, 1.5, 1.85))
    else:
        style = {"Van": "van", "Truck": "truck", "Misc": "trailer"}[name]
    return _Vehicle(name, style, l, w, h)


def _sample_street(rng: np.random.Generator) -> Street:
    n_fwd = _pick(rng, (1, 2, 3), (0.55, 0.35, 0.1))
    n_back = _pick(rng, (0, 1, 2), (0.2, 0.55, 0.25))
    lane_w = float(rng.uniform(3.0, 3.6))
    park_r = float(rng.uniform(2.0, 2.5)) if rng.random() < 0.85 else 0.0
    park_l = float(rng.uniform(2.0, 2.5)) if rng.random() < 0.75 else 0.0
    ego_lane = int(rng.integers(n_fwd))
    v_edge = -(ego_lane + 0.5) * lane_w + float(rng.uniform(-0.3, 0.3))  # right edge of the forward lanes
    fwd = v_edge + (np.arange(n_fwd) + 0.5) * lane_w
    back = v_edge + (n_fwd + np.arange(n_back) + 0.5) * lane_w
    v_top = v_edge + (n_fwd + n_back) * lane_w
    lines, dashed = [v_edge + 0.1, v_top - 0.1], [False, False]
    for k in range(1, n_fwd + n_back):
        lines.append(v_edge + k * lane_w)
        dashed.append(k != n_fwd or rng.random() < 0.5)
    cross = rng.random() < 0.45
    return Street(
        yaw=float(np.clip(rng.normal(0.0, 0.03), -0.1, 0.1)),
        sensor_height=float(rng.uniform(1.70, 1.76)),
        slope=(float(rng.uniform(-0.012, 0.012)), float(rng.uniform(-0.006, 0.006))),
        kerb_right=v_edge - park_r,
        kerb_left=v_top + park_l,
        kerb_height=float(rng.uniform(0.10, 0.16)),
        park_right=park_r,
        park_left=park_l,
        sidewalk_right=float(rng.uniform(2.0, 5.0)),
        sidewalk_left=float(rng.uniform(2.0, 5.0)),
        lane_width=lane_w,
        forward_lanes=fwd,
        backward_lanes=back,
        lines=np.asarray(lines),
        lines_dashed=np.asarray(dashed),
        cross_u=float(rng.uniform(12.0, 65.0)) if cross else None,
        cross_half=float(rng.uniform(4.0, 7.5)) if cross else 0.0,
        dead_end=bool(cross and rng.random() < 0.4),
        asphalt=float(rng.uniform(0.7, 1.2)),
        window_phase=float(rng.uniform(0.0, 3.0)),
    )


def _segments(st: Street, lo: float, hi: float) -> list[tuple[float, float]]:
    """[lo, hi] along the street minus the cross street's carriageway."""
    if st.cross_u is None:
        return [(lo, hi)]
    if st.dead_end:
        return [(lo, st.cross_u - st.cross_half)]
    return [(lo, st.cross_u - st.cross_half), (st.cross_u + st.cross_half, hi)]


def _buildings_across(st: Street, rng: np.random.Generator, yard_mat: int) -> list[_Part]:
    """Sidewalk, yard and a row of buildings across the end of a dead-end main street."""
    kh, u0 = st.kerb_height, st.u_end
    sw = float(rng.uniform(2.0, 5.0))
    parts = [
        _Part(box((u0, -150.0, -0.5), (u0 + sw, 150.0, kh), M.CONCRETE)),
        _Part(box((u0 + sw, -150.0, -0.5), (U_MAX, 150.0, kh), yard_mat)),
    ]
    front = u0 + sw + (float(rng.uniform(0.0, 4.0)) if rng.random() < 0.5 else 0.0)
    v = -120.0 + float(rng.uniform(0.0, 10.0))
    while v < 120.0:
        length = float(rng.uniform(8.0, 30.0))
        if rng.random() < 0.9:
            depth, height = float(rng.uniform(8.0, 20.0)), float(rng.uniform(4.0, 22.0))
            b = box((front, v, -0.5), (front + depth, v + length, kh + height), M.FACADE)
            b.material[2:4] = M.ROOF
            parts.append(_Part(b, float(rng.uniform(0.5, 1.5))))
        v += length + (float(rng.uniform(1.0, 6.0)) if rng.random() < 0.3 else 0.0)
    return parts


def _static(st: Street, rng: np.random.Generator, occ: _Occupancy) -> list[_Part]:
    """Ground, sidewalks, yards, buildings, trees, street lamps and signs (street frame, flat ground)."""
    parts = [_Part(box((U_MIN, -200.0, -0.5), (U_MAX, 200.0, 0.0), M.ASPHALT), st.asphalt)]
    kh = st.kerb_height
    yard_mat = M.GRASS if rng.random() < 0.5 else M.CONCRETE
    if st.dead_end:
        parts += _buildings_across(st, rng, yard_mat)
    tree_p = float(rng.uniform(0.0, 0.9))
    for side in (-1.0, 1.0):
        kerb = st.kerb_left if side > 0 else st.kerb_right
        sw = st.sidewalk_left if side > 0 else st.sidewalk_right
        front = kerb + side * sw  # building side of the sidewalk
        setback = float(rng.uniform(0.0, 4.0)) if rng.random() < 0.5 else 0.0
        for u0, u1 in _segments(st, U_MIN, U_MAX):
            v_pair = sorted((kerb, front))
            parts.append(_Part(box((u0, v_pair[0], -0.5), (u1, v_pair[1], kh), M.CONCRETE)))
            y_pair = sorted((front, front + side * 150.0))
            parts.append(_Part(box((u0, y_pair[0], -0.5), (u1, y_pair[1], kh), yard_mat)))
            # Buildings: facade blocks along the segment, occasionally a gap or an empty lot.
            u = u0 + (float(rng.uniform(0.0, 5.0)) if st.cross_u is not None and u0 > U_MIN else 0.0)
            while u < u1 - 4.0:
                length = min(float(rng.uniform(8.0, 30.0)), u1 - u)
                if rng.random() < 0.9:
                    depth = float(rng.uniform(8.0, 20.0))
                    height = float(rng.uniform(4.0, 22.0))
                    f = front + side * setback
                    vv = sorted((f, f + side * depth))
                    b = box((u, vv[0], -0.5), (u + length, vv[1], kh + height), M.FACADE)
                    b.material[2:4] = M.ROOF  # the top face
                    parts.append(_Part(b, float(rng.uniform(0.5, 1.5))))
                    if setback > 1.5 and rng.random() < 0.4:  # a hedge in the front yard
                        hv = front + side * float(rng.uniform(0.5, setback - 0.6))
                        parts.append(
                            _Part(
                                box(
                                    (u, hv - 0.4, kh),
                                    (u + length, hv + 0.4, kh + rng.uniform(0.6, 1.4)),
                                    M.FOLIAGE,
                                )
                            )
                        )
                u += length + (float(rng.uniform(1.0, 6.0)) if rng.random() < 0.3 else 0.0)
            # Trees and street lamps along the kerb.
            u = u0 + float(rng.uniform(0.0, 10.0))
            while u < u1 - 1.0:
                tv = kerb + side * float(rng.uniform(0.6, 1.0))
                if rng.random() < tree_p:
                    trunk_r, trunk_h = float(rng.uniform(0.1, 0.25)), float(rng.uniform(2.2, 3.5))
                    cr, cz = float(rng.uniform(1.2, 2.8)), float(rng.uniform(1.0, 2.5))
                    parts.append(_Part(cylinder_z((u, tv), -0.5, kh + trunk_h + cz, trunk_r, M.BARK)))
                    parts.append(
                        _Part(
                            ellipsoid(
                                (u, tv + side * 0.3, kh + trunk_h + cz),
                                (cr, cr * rng.uniform(0.8, 1.1), cz),
                                M.FOLIAGE,
                                5,
                                9,
                                rng,
                                0.15,
                            )
                        )
                    )
                    occ.add((u - 0.5, u + 0.5, tv - 0.5, tv + 0.5))
                elif rng.random() < 0.35:
                    h = float(rng.uniform(5.0, 8.0))
                    parts.append(_Part(cylinder_z((u, tv), -0.5, kh + h, 0.08, M.METAL, 6)))
                    tip = (u, tv - side * 1.5, kh + h + 0.3)
                    parts.append(_Part(limb((u, tv, kh + h - 0.2), tip, 0.08, 0.08, M.METAL)))
                    parts.append(
                        _Part(
                            box(
                                (tip[0] - 0.3, tip[1] - 0.15, tip[2] - 0.15),
                                (tip[0] + 0.3, tip[1] + 0.15, tip[2]),
                                M.METAL,
                            )
                        )
                    )
                    occ.add((u - 0.3, u + 0.3, tv - 0.3, tv + 0.3))
                elif rng.random() < 0.25:  # a traffic sign facing the traffic
                    parts.append(_Part(cylinder_z((u, tv), -0.5, kh + 2.6, 0.04, M.METAL, 6)))
                    parts.append(
                        _Part(box((u - 0.02, tv - 0.3, kh + 2.0), (u + 0.02, tv + 0.3, kh + 2.6), M.SIGN))
                    )
                    occ.add((u - 0.3, u + 0.3, tv - 0.3, tv + 0.3))
                u += float(rng.uniform(7.0, 16.0))
    return parts


def _objects(st: Street, rng: np.random.Generator, occ: _Occupancy) -> list[_Placement]:
    out: list[_Placement] = []
    # The ego vehicle's own footprint.
    occ.add((-3.5, 6.0, -1.3, 1.3))

    def try_place(name, mesh, u, v, heading, on_sidewalk, moving, scale, margin) -> bool:
        """Place ``mesh`` (a TriMesh, or a _Vehicle built once the place is free) unless it collides."""
        if isinstance(mesh, _Vehicle):
            l, w = mesh.l + 0.02, mesh.w  # licence plates stand 1 cm proud
        else:
            lo, hi = mesh.bounds()
            l, w = hi[0] - lo[0], hi[1] - lo[1]
        r = _Occupancy.footprint(u, v, l, w, heading, margin)
        if not occ.free(r):
            return False
        occ.add(r)
        if isinstance(mesh, _Vehicle):
            mesh = mesh.build(rng)
        out.append(_Placement(name, mesh, u, v, heading, on_sidewalk, moving, scale))
        return True

    def paint() -> float:  # dark, grey, mid, light, white
        return _pick(rng, (0.3, 0.6, 1.0, 1.5, 1.9), (0.25, 0.2, 0.25, 0.15, 0.15))

    u_stop = st.u_end - 6.0  # the main street's objects stay clear of the buildings across a dead end
    cross_lo = st.cross_u - st.cross_half - 6.0 if st.cross_u is not None else None
    cross_hi = st.cross_u + st.cross_half + 3.0 if st.cross_u is not None else None
    # Parked vehicles along both kerbs.
    for side in (-1.0, 1.0):
        kerb = st.kerb_left if side > 0 else st.kerb_right
        if (st.park_left if side > 0 else st.park_right) == 0.0:  # no parking lane on this side
            continue
        p_park = float(rng.uniform(0.35, 0.95))
        u = -60.0 + float(rng.uniform(0.0, 5.0))
        while u < min(110.0, u_stop):
            if cross_lo is not None and cross_lo < u < cross_hi:
                u = cross_hi
                continue
            if rng.random() < p_park:
                veh = _vehicle(rng, parked=True)
                l, w = veh.l + 0.02, veh.w
                forward = (side < 0) == (rng.random() < 0.85)
                heading = (0.0 if forward else math.pi) + float(rng.normal(0.0, 0.03))
                v = kerb - side * (w / 2 + float(rng.uniform(0.1, 0.4)))
                try_place(veh.name, veh, u + l / 2, v, heading, False, False, paint(), 0.2)
                u += l + float(rng.uniform(0.5, 2.5))
            else:
                u += float(rng.uniform(3.0, 8.0))
    # Traffic in the lanes.
    density = float(rng.uniform(0.3, 1.0))
    for lanes, heading0 in ((st.forward_lanes, 0.0), (st.backward_lanes, math.pi)):
        for lv in lanes:
            u = -60.0 + float(rng.uniform(0.0, 20.0))
            while u < min(110.0, u_stop):
                if rng.random() < density:
                    veh = _vehicle(rng, parked=False)
                    try_place(
                        veh.name,
                        veh,
                        u,
                        lv + float(rng.normal(0.0, 0.2)),
                        heading0 + float(rng.normal(0.0, 0.02)),
                        False,
                        True,
                        paint(),
                        0.5,
                    )
                    u += veh.l + float(rng.uniform(4.0, 30.0))
                else:
                    u += float(rng.uniform(8.0, 25.0))
    # Cross street: traffic both ways and a few parked cars.
    if st.cross_u is not None:
        for lane_u, heading in (
            (st.cross_u - st.cross_half / 2, math.pi / 2),
            (st.cross_u + st.cross_half / 2, -math.pi / 2),
        ):
            for v in rng.uniform(-70.0, 70.0, size=int(rng.integers(0, 5))):
                veh = _vehicle(rng, parked=False)
                try_place(
                    veh.name,
                    veh,
                    lane_u + float(rng.normal(0, 0.2)),
                    float(v),
                    heading + float(rng.normal(0, 0.03)),
                    False,
                    True,
                    paint(),
                    0.5,
                )
        for v in rng.uniform(-50.0, 50.0, size=int(rng.integers(0, 5))):
            side = 1.0 if rng.random() < 0.5 else -1.0
            if st.kerb_right - 3.0 < v < st.kerb_left + 3.0:  # not in the intersection
                continue
            veh = _vehicle(rng, parked=True)
            u = st.cross_u + side * (st.cross_half - veh.w / 2 - 0.3)
            try_place(
                veh.name,
                veh,
                u,
                float(v),
                side * math.pi / 2 + float(rng.normal(0, 0.04)),
                False,
                False,
                paint(),
                0.2,
            )
    # Pedestrians on the sidewalks (alone or in small groups), some crossing the road.
    lam = (
        0.0
        if rng.random() < 0.3
        else float(rng.uniform(1.0, 6.0))
        if rng.random() < 0.7
        else float(rng.uniform(6, 15))
    )
    for _ in range(int(rng.poisson(lam))):
        side = 1.0 if rng.random() < 0.5 else -1.0
        kerb = st.kerb_left if side > 0 else st.kerb_right
        sw = st.sidewalk_left if side > 0 else st.sidewalk_right
        u0 = float(rng.uniform(-20.0, min(70.0, u_stop)))
        v0 = kerb + side * float(rng.uniform(0.4, sw - 0.4))
        for k in range(1 + (int(rng.integers(1, 4)) if rng.random() < 0.3 else 0)):
            heading = (0.0 if rng.random() < 0.5 else math.pi) + float(rng.normal(0.0, 0.3))
            if rng.random() < 0.2:
                heading = float(rng.uniform(-math.pi, math.pi))
            stride = float(rng.uniform(0.0, 0.05)) if rng.random() < 0.25 else float(rng.uniform(0.15, 0.45))
            mesh = pedestrian_mesh(_normal(rng, 1.74, 0.09, 1.45, 1.98), stride, rng)
            u, v = u0 + k * float(rng.uniform(0.6, 1.2)), v0 + float(rng.normal(0.0, 0.4))
            if not st.drivable(u, v) and not st.in_cross(u):
                try_place(
                    "Pedestrian", mesh, u, v, heading, True, stride > 0.1, float(rng.uniform(0.4, 1.6)), 0.1
                )
    if rng.random() < 0.2:
        u0 = st.cross_u - st.cross_half - 2.5 if st.cross_u is not None else float(rng.uniform(8.0, 50.0))
        for _ in range(int(rng.integers(1, 5))):
            v = float(rng.uniform(st.kerb_right + 0.5, st.kerb_left - 0.5))
            mesh = pedestrian_mesh(_normal(rng, 1.74, 0.09, 1.45, 1.98), float(rng.uniform(0.15, 0.45)), rng)
            heading = (math.pi / 2 if rng.random() < 0.5 else -math.pi / 2) + float(rng.normal(0, 0.2))
            try_place(
                "Pedestrian",
                mesh,
                u0 + float(rng.normal(0, 0.6)),
                v,
                heading,
                False,
                True,
                float(rng.uniform(0.4, 1.6)),
                0.1,
            )
    # Cyclists near the kerbs (a few on the sidewalk).
    lam_c = 0.0 if rng.random() < 0.4 else float(rng.uniform(0.5, 3.5))
    for _ in range(int(rng.poisson(lam_c))):
        mesh = cyclist_mesh(_normal(rng, 1.72, 0.08, 1.5, 1.95), rng)
        u = float(rng.uniform(-10.0, min(70.0, u_stop)))
        r = rng.random()
        if r < 0.55:
            v, heading, sidewalk = st.forward_lanes[0] - st.lane_width / 2 + 0.8, 0.0, False
        elif r < 0.8 and len(st.backward_lanes):
            v, heading, sidewalk = st.backward_lanes[-1] + st.lane_width / 2 - 0.8, math.pi, False
        else:
            side = 1.0 if rng.random() < 0.5 else -1.0
            kerb = st.kerb_left if side > 0 else st.kerb_right
            v = kerb + side * (st.sidewalk_left if side > 0 else st.sidewalk_right) / 2
            heading, sidewalk = (0.0 if rng.random() < 0.5 else math.pi), True
            if st.in_cross(u):
                continue
        try_place(
            "Cyclist",
            mesh,
            u,
            v + float(rng.normal(0.0, 0.15)),
            heading + float(rng.normal(0.0, 0.05)),
            sidewalk,
            True,
            float(rng.uniform(0.5, 1.5)),
            0.3,
        )
    return out


def assemble_scene(
    static: Sequence[tuple[TriMesh, float]],
    objects: Sequence[tuple[str, np.ndarray, TriMesh, float, bool]],
    street: Street,
) -> Scene:
    """One scene mesh from LiDAR-frame parts: ``static`` (mesh, reflectivity scale) pairs, and
    ``objects`` (class name, box [7], mesh in the object's frame, reflectivity scale, moving) whose mesh
    is fitted exactly to the box (:func:`~detector.data.sim_meshes.fit_to_box`) and placed with it."""
    verts, tris, mats, albedo, owner = [], [], [], [], []
    n_v = n_t = 0
    sim_objects: list[SimObject] = []

    def add(mesh: TriMesh, scale: float, obj: int) -> None:
        nonlocal n_v, n_t
        verts.append(mesh.vertices)
        tris.append(mesh.triangles + n_v)
        mats.append(mesh.material)
        a = ALBEDO[mesh.material].copy()
        a[_VARIABLE[mesh.material]] *= scale
        albedo.append(np.clip(a, 0.0, 1.0))
        owner.append(np.full(len(mesh.triangles), obj, np.int32))
        n_v += len(mesh.vertices)
        n_t += len(mesh.triangles)

    for mesh, scale in static:
        add(mesh, scale, -1)
    for name, box7, local, scale, moving in objects:
        box7 = np.asarray(box7, np.float64)
        mesh = fit_to_box(local, box7[3:6]).transformed(rot_z(box7[6]), box7[:3])
        sim_objects.append(SimObject(name, box7, moving, n_t, n_t + len(mesh.triangles)))
        add(mesh, scale, len(sim_objects) - 1)
    return Scene(
        vertices=np.concatenate(verts).astype(np.float32),
        triangles=np.concatenate(tris).astype(np.uint32),
        tri_material=np.concatenate(mats),
        tri_albedo=np.concatenate(albedo).astype(np.float32),
        tri_object=np.concatenate(owner),
        objects=sim_objects,
        street=street,
    )


def generate_scene(rng: np.random.Generator, calib: Calibration) -> Scene:
    """A random street scene in the LiDAR frame (see module doc); ``calib`` puts the labels on the grid."""
    st = _sample_street(rng)
    occ = _Occupancy()
    static = _static(st, rng, occ)
    placements = _objects(st, rng, occ)
    rot = rot_z(st.yaw)
    static_lidar = []
    for p in static:
        v = p.mesh.vertices.copy()
        v[:, 2] += st.ground_z(v[:, 0], v[:, 1])  # shear onto the sloped ground
        static_lidar.append((TriMesh(v @ rot.T, p.mesh.triangles, p.mesh.material), p.scale))
    boxes = np.zeros((len(placements), 7))
    for k, p in enumerate(placements):
        lo, hi = p.mesh.bounds()
        dims = hi - lo
        base = float(st.ground_z(p.u, p.v)) + (st.kerb_height if p.on_sidewalk else 0.0)
        xy = st.to_lidar(np.array([p.u, p.v]))
        boxes[k] = (xy[0], xy[1], base + dims[2] / 2, *dims, float(wrap_angle(p.heading + st.yaw)))
    boxes = quantize_boxes(boxes, calib)
    objects = [(p.name, b, p.mesh, p.scale, p.moving) for p, b in zip(placements, boxes, strict=True)]
    return assemble_scene(static_lidar, objects, st)
