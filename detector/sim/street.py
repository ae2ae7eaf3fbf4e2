"""The street a simulated scene is laid out on, and its random draw.

A scene is laid out in a *street frame* (u along the street, v to its left, metres), with the sensor at
the origin above the centre of its lane, then rotated into the LiDAR frame by the ego vehicle's small
heading offset ``Street.yaw``. The ground is a gently sloped plane ``z = -sensor_height + su·u + sv·v``
(as the sensor sees it: the road's grade plus the car's pitch and roll).

Cross-section of the main street, right to left (right-hand traffic):
``yard | sidewalk | kerb | parking lane? | forward lanes | backward lanes | parking lane? | kerb | sidewalk
| yard``, with buildings set back behind the sidewalks, trees, street lamps and signs along the kerbs,
shrubs, garden walls, fences and hedges along the yards, bins on the sidewalks, and an optional cross
street (sometimes a T-junction: the main street ends there, buildings across).
Cars, vans, trucks and trailers park along the kerbs and drive in the lanes (and on the cross street),
pedestrians walk on the sidewalks or cross the road, cyclists ride near the kerbs. Objects do not
overlap (axis-aligned footprints in the street frame are kept apart).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from detector.data.road_map import RoadMap

# Extent of the scene along the street (m): the scan reaches 120 m, objects are placed in [-60, 110].
U_MIN, U_MAX = -150.0, 200.0


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


class Occupancy:
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


def pick(rng: np.random.Generator, values: Sequence, probs: Sequence[float]):
    """One of ``values`` drawn with probabilities ``probs`` (cheaper than Generator.choice)."""
    x, acc = rng.random() * sum(probs), 0.0
    for value, p in zip(values, probs, strict=True):
        acc += p
        if x < acc:
            return value
    return values[-1]


def sample_street(rng: np.random.Generator) -> Street:
    n_fwd = pick(rng, (1, 2, 3), (0.55, 0.35, 0.1))
    n_back = pick(rng, (0, 1, 2), (0.2, 0.55, 0.25))
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
        # The ground as the sensor sees it (road grade plus the car's pitch and roll): KITTI's ground planes
        # rise ahead by ~1 % on average and tilt by ~1.4 deg (detector/data/domains.py on real frames).
        slope=(
            float(np.clip(rng.normal(0.008, 0.012), -0.035, 0.035)),
            float(np.clip(rng.normal(0.0, 0.012), -0.03, 0.03)),
        ),
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
