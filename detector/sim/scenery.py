"""The static scenery of a street scene: ground, sidewalks, yards, buildings, trees, lamps and signs
(street frame, flat ground)."""

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


def static_parts(st: Street, rng: np.random.Generator, occ: Occupancy) -> list[Part]:
    """Ground, sidewalks, yards, buildings, trees, street lamps and signs (street frame, flat ground)."""
    parts = [Part(box((U_MIN, -200.0, -0.5), (U_MAX, 200.0, 0.0), M.ASPHALT), st.asphalt)]
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
