"""The dynamic objects of a street scene: parked and moving vehicles, pedestrians and cyclists, drawn and
placed without collisions (street frame)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from detector.sim.actors import cyclist_mesh, pedestrian_mesh, vehicle_mesh
from detector.sim.meshes import TriMesh
from detector.sim.street import Occupancy, Street, pick


@dataclass
class Placement:
    name: str
    mesh: TriMesh  # local frame, ground at z = 0
    u: float
    v: float
    heading: float  # street frame
    on_sidewalk: bool
    moving: bool
    scale: float


# Size distributions (metres) per class, after KITTI's statistics: (mean, std, min, max) for l, w, h.
# Car: KITTI's labeled Cars measure l 3.88 ± 0.43, w 1.63 ± 0.10, h 1.53 ± 0.14 (SUVs add 0.15 to h below).
_SIZES = {
    "Car": ((3.88, 0.40, 3.0, 5.0), (1.63, 0.09, 1.40, 1.90), (1.50, 0.10, 1.30, 1.75)),
    "Van": ((5.0, 0.4, 4.3, 6.0), (1.92, 0.1, 1.75, 2.15), (2.15, 0.2, 1.8, 2.7)),
    "Truck": ((9.0, 2.0, 6.0, 12.5), (2.5, 0.08, 2.3, 2.6), (3.2, 0.25, 2.7, 3.8)),
    "Misc": ((3.2, 0.4, 2.4, 4.2), (1.7, 0.12, 1.4, 2.0), (1.5, 0.3, 1.0, 2.1)),
}

_CAR_STYLES = ("sedan", "hatchback", "wagon", "suv")

_CAR_STYLE_P = (0.35, 0.3, 0.2, 0.15)


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
        style = pick(rng, _CAR_STYLES, _CAR_STYLE_P)
        if style == "suv":
            h = float(np.clip(h + 0.15, 1.5, 1.85))
    else:
        style = {"Van": "van", "Truck": "truck", "Misc": "trailer"}[name]
    return _Vehicle(name, style, l, w, h)


def place_objects(st: Street, rng: np.random.Generator, occ: Occupancy) -> list[Placement]:
    out: list[Placement] = []
    # The ego vehicle's own footprint.
    occ.add((-3.5, 6.0, -1.3, 1.3))

    def try_place(name, mesh, u, v, heading, on_sidewalk, moving, scale, margin) -> bool:
        """Place ``mesh`` (a TriMesh, or a _Vehicle built once the place is free) unless it collides."""
        if isinstance(mesh, _Vehicle):
            l, w = mesh.l + 0.02, mesh.w  # licence plates stand 1 cm proud
        else:
            lo, hi = mesh.bounds()
            l, w = hi[0] - lo[0], hi[1] - lo[1]
        r = Occupancy.footprint(u, v, l, w, heading, margin)
        if not occ.free(r):
            return False
        occ.add(r)
        if isinstance(mesh, _Vehicle):
            mesh = mesh.build(rng)
        out.append(Placement(name, mesh, u, v, heading, on_sidewalk, moving, scale))
        return True

    def paint() -> float:  # dark, grey, mid, light, white
        return pick(rng, (0.3, 0.6, 1.0, 1.5, 1.9), (0.25, 0.2, 0.25, 0.15, 0.15))

    u_stop = st.u_end - 6.0  # the main street's objects stay clear of the buildings across a dead end
    cross_lo = st.cross_u - st.cross_half - 6.0 if st.cross_u is not None else None
    cross_hi = st.cross_u + st.cross_half + 3.0 if st.cross_u is not None else None
    # Parked vehicles along both kerbs.
    for side in (-1.0, 1.0):
        kerb = st.kerb_left if side > 0 else st.kerb_right
        if (st.park_left if side > 0 else st.park_right) == 0.0:  # no parking lane on this side
            continue
        p_park = float(rng.uniform(0.1, 0.6))
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
    density = float(rng.uniform(0.1, 0.55))
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
            for v in rng.uniform(-70.0, 70.0, size=int(rng.integers(0, 4))):
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
        for v in rng.uniform(-50.0, 50.0, size=int(rng.integers(0, 4))):
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
    # About 0.9 labeled pedestrians per frame (KITTI: 0.6; most frames have none).
    lam = (
        0.0
        if rng.random() < 0.4
        else float(rng.uniform(0.5, 4.0))
        if rng.random() < 0.75
        else float(rng.uniform(4.0, 10.0))
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
