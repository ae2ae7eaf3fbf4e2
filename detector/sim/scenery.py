"""The static scenery of a street scene: ground, sidewalks, yards, buildings, trees, lamps and signs, and
the clutter between road and buildings (shrubs, garden walls, fences, hedges, bins) (street frame, flat
ground)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from detector.sim.meshes import Material, TriMesh, box, cylinder_z, ellipsoid, limb
from detector.sim.street import U_MAX, U_MIN, Occupancy, Street

M = Material


@dataclass
class Part:
    """A piece of static scenery."""

    mesh: TriMesh  # street frame
    scale: float = 1.0  # reflectivity factor of the materials that vary per instance (scene._VARIABLE)


def _segments(st: Street, lo: float, hi: float) -> list[tuple[float, float]]:
    """[lo, hi] along the street minus the cross street's carriageway."""
    if st.cross_u is None:
        return [(lo, hi)]
    if st.dead_end:
        return [(lo, st.cross_u - st.cross_half)]
    return [(lo, st.cross_u - st.cross_half), (st.cross_u + st.cross_half, hi)]


def _buildings_across(st: Street, rng: np.random.Generator, yard_mat: int) -> list[Part]:
    """Sidewalk, yard and a row of buildings across the end of a dead-end main street."""
    kh, u0 = st.kerb_height, st.u_end
    sw = float(rng.uniform(2.0, 5.0))
    parts = [
        Part(box((u0, -150.0, -0.5), (u0 + sw, 150.0, kh), M.CONCRETE)),
        Part(box((u0 + sw, -150.0, -0.5), (U_MAX, 150.0, kh), yard_mat)),
    ]
    front = u0 + sw + (float(rng.uniform(0.0, 4.0)) if rng.random() < 0.5 else 0.0)
    v = -120.0 + float(rng.uniform(0.0, 10.0))
    while v < 120.0:
        length = float(rng.uniform(8.0, 30.0))
        if rng.random() < 0.9:
            depth, height = float(rng.uniform(8.0, 20.0)), float(rng.uniform(4.0, 22.0))
            b = box((front, v, -0.5), (front + depth, v + length, kh + height), M.FACADE)
            b.material[2:4] = M.ROOF
            parts.append(Part(b, float(rng.uniform(0.5, 1.5))))
        v += length + (float(rng.uniform(1.0, 6.0)) if rng.random() < 0.3 else 0.0)
    return parts


_JITTER = 0.25  # radial irregularity of the foliage blobs


def _bush(
    rng: np.random.Generator, u: float, v: float, base: float, height: float, length: float, half_width: float
) -> list[Part]:
    """A shrub: one to three overlapping, irregular foliage blobs ``height`` tall, about ``length`` long
    along the street, reaching at most ``half_width`` across it from ``v``."""
    parts = []
    n = 1 + int(rng.integers(0, 3))
    for k in range(n):
        du = (k - (n - 1) / 2) * length / (n + 1)
        h = height * float(rng.uniform(0.75, 1.0))
        ru = length / (n + 1) * float(rng.uniform(0.9, 1.3))
        rv = half_width / (1 + _JITTER) * float(rng.uniform(0.7, 1.0))
        parts.append(Part(ellipsoid((u + du, v, base + h / 2), (ru, rv, h / 2), M.FOLIAGE, 4, 8, rng, _JITTER)))
    return parts


def _clutter(
    st: Street, rng: np.random.Generator, occ: Occupancy, side: float, kerb: float, front: float, setback: float,
    u0: float, u1: float, p_bush: float, p_wall: float,
) -> list[Part]:
    """What stands between the road and the buildings in real streets and is not an object class: shrubs in
    the front yards and on the verge, garden walls and fences along the property line, and now and then a
    bin or a container on the sidewalk. Heights from knee to head, like the bushes, hedges and walls that a
    BEV detector trained on clean scenes mistakes for cars."""
    kh, parts = st.kerb_height, []
    # Garden walls / fences along the property line, in stretches.
    u = u0 + float(rng.uniform(0.0, 8.0))
    while u < u1 - 3.0:
        length = min(float(rng.uniform(5.0, 30.0)), u1 - u)
        if rng.random() < p_wall:
            v = front + side * float(rng.uniform(0.0, 0.3))
            kind = rng.random()
            if kind < 0.45:  # masonry wall
                h, t, mat = float(rng.uniform(0.5, 1.8)), float(rng.uniform(0.2, 0.35)), M.CONCRETE
            elif kind < 0.75:  # fence of boards or panels
                h, t, mat = float(rng.uniform(1.0, 2.0)), 0.05, M.BARK
            else:  # clipped hedge
                h, t, mat = float(rng.uniform(0.8, 1.8)), float(rng.uniform(0.5, 1.0)), M.FOLIAGE
            vv = sorted((v, v + side * t))
            parts.append(Part(box((u, vv[0], kh - 0.05), (u + length, vv[1], kh + h), mat)))
        u += length + float(rng.uniform(2.0, 12.0))
    # Shrubs in the front yard (or against the facade when there is no yard).
    u = u0 + float(rng.uniform(0.0, 6.0))
    while u < u1 - 2.0:
        if rng.random() < p_bush:
            depth = max(setback, 0.8)
            v = front + side * float(rng.uniform(0.5, depth))
            parts += _bush(rng, u, v, kh, float(rng.uniform(0.6, 2.0)), float(rng.uniform(1.0, 4.0)), 1.1)
        u += float(rng.uniform(3.0, 12.0))
    # On the sidewalk by the kerb: shrubs on the verge, bins and containers.
    u = u0 + float(rng.uniform(0.0, 20.0))
    while u < u1 - 2.0:
        r = rng.random()
        if r < 0.5 * p_bush:
            length, h, hw = float(rng.uniform(1.0, 3.0)), float(rng.uniform(0.5, 1.4)), float(rng.uniform(0.35, 0.6))
            v = kerb + side * (hw + 0.15)  # on the sidewalk, clear of the kerb
            fp = (u - length / 2 - 0.2, u + length / 2 + 0.2, v - hw - 0.1, v + hw + 0.1)
            if occ.free(fp):
                occ.add(fp)
                parts += _bush(rng, u, v, kh, h, length, hw)
        elif r < 0.5 * p_bush + 0.15:
            hl, hw, h = float(rng.uniform(0.3, 1.0)), float(rng.uniform(0.3, 0.7)), float(rng.uniform(1.0, 1.6))
            v = kerb + side * (0.3 + hw)
            fp = (u - hl - 0.2, u + hl + 0.2, v - hw - 0.2, v + hw + 0.2)
            if occ.free(fp):
                occ.add(fp)
                parts.append(Part(box((u - hl, v - hw, kh), (u + hl, v + hw, kh + h), M.METAL)))
        u += float(rng.uniform(6.0, 25.0))
    return parts


def static_parts(st: Street, rng: np.random.Generator, occ: Occupancy) -> list[Part]:
    """Ground, sidewalks, yards, buildings, trees, street lamps and signs (street frame, flat ground)."""
    parts = [Part(box((U_MIN, -200.0, -0.5), (U_MAX, 200.0, 0.0), M.ASPHALT), st.asphalt)]
    kh = st.kerb_height
    yard_mat = M.GRASS if rng.random() < 0.5 else M.CONCRETE
    if st.dead_end:
        parts += _buildings_across(st, rng, yard_mat)
    tree_p = float(rng.uniform(0.0, 0.9))
    p_bush, p_wall = float(rng.uniform(0.0, 0.7)), float(rng.uniform(0.0, 0.6))
    for side in (-1.0, 1.0):
        kerb = st.kerb_left if side > 0 else st.kerb_right
        sw = st.sidewalk_left if side > 0 else st.sidewalk_right
        front = kerb + side * sw  # building side of the sidewalk
        setback = float(rng.uniform(0.0, 4.0)) if rng.random() < 0.5 else 0.0
        for u0, u1 in _segments(st, U_MIN, U_MAX):
            v_pair = sorted((kerb, front))
            parts.append(Part(box((u0, v_pair[0], -0.5), (u1, v_pair[1], kh), M.CONCRETE)))
            y_pair = sorted((front, front + side * 150.0))
            parts.append(Part(box((u0, y_pair[0], -0.5), (u1, y_pair[1], kh), yard_mat)))
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
                    parts.append(Part(b, float(rng.uniform(0.5, 1.5))))
                    if setback > 1.5 and rng.random() < 0.4:  # a hedge in the front yard
                        hv = front + side * float(rng.uniform(0.5, setback - 0.6))
                        parts.append(
                            Part(
                                box(
                                    (u, hv - 0.4, kh),
                                    (u + length, hv + 0.4, kh + rng.uniform(0.6, 1.4)),
                                    M.FOLIAGE,
                                )
                            )
                        )
                u += length + (float(rng.uniform(1.0, 6.0)) if rng.random() < 0.3 else 0.0)
            lo, hi = max(u0, -60.0), min(u1, 110.0)  # where the scan sees detail (and objects are placed)
            if hi > lo:
                parts += _clutter(st, rng, occ, side, kerb, front, setback, lo, hi, p_bush, p_wall)
            # Trees and street lamps along the kerb.
            u = u0 + float(rng.uniform(0.0, 10.0))
            while u < u1 - 1.0:
                tv = kerb + side * float(rng.uniform(0.6, 1.0))
                if rng.random() < tree_p:
                    trunk_r, trunk_h = float(rng.uniform(0.1, 0.25)), float(rng.uniform(2.2, 3.5))
                    cr, cz = float(rng.uniform(1.2, 2.8)), float(rng.uniform(1.0, 2.5))
                    parts.append(Part(cylinder_z((u, tv), -0.5, kh + trunk_h + cz, trunk_r, M.BARK)))
                    parts.append(
                        Part(
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
                    parts.append(Part(cylinder_z((u, tv), -0.5, kh + h, 0.08, M.METAL, 6)))
                    tip = (u, tv - side * 1.5, kh + h + 0.3)
                    parts.append(Part(limb((u, tv, kh + h - 0.2), tip, 0.08, 0.08, M.METAL)))
                    parts.append(
                        Part(
                            box(
                                (tip[0] - 0.3, tip[1] - 0.15, tip[2] - 0.15),
                                (tip[0] + 0.3, tip[1] + 0.15, tip[2]),
                                M.METAL,
                            )
                        )
                    )
                    occ.add((u - 0.3, u + 0.3, tv - 0.3, tv + 0.3))
                elif rng.random() < 0.25:  # a traffic sign facing the traffic
                    parts.append(Part(cylinder_z((u, tv), -0.5, kh + 2.6, 0.04, M.METAL, 6)))
                    parts.append(
                        Part(box((u - 0.02, tv - 0.3, kh + 2.0), (u + 0.02, tv + 0.3, kh + 2.6), M.SIGN))
                    )
                    occ.add((u - 0.3, u + 0.3, tv - 0.3, tv + 0.3))
                u += float(rng.uniform(7.0, 16.0))
    return parts
