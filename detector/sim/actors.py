"""The simulator's object shapes: vehicles, pedestrians and cyclists, as articulated unions of the
primitives of :mod:`detector.sim.meshes` (not single boxes), built at their metric size, ground at z = 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from detector.sim.meshes import Material, TriMesh, box, disc_y, ellipsoid, limb, prism_y, ring_y

# --------------------------------------------------------------------------------------------------
# Vehicles (body + cabin + wheels + plates and lights), built at their metric size, ground at z = 0
# --------------------------------------------------------------------------------------------------
VEHICLE_STYLES = ("sedan", "hatchback", "wagon", "suv", "van", "truck", "trailer")
M = Material

# Side profiles (x as a fraction of the length from -0.5 rear to 0.5 front, z as a fraction of the height),
# counter-clockwise; the cabin is the glass-house above the belt line.
_BODY = {
    "sedan": [
        (-0.5, 0.13),
        (0.5, 0.13),
        (0.5, 0.40),
        (0.46, 0.52),
        (0.17, 0.60),
        (-0.36, 0.63),
        (-0.5, 0.57),
    ],
    "hatchback": [
        (-0.5, 0.13),
        (0.5, 0.13),
        (0.5, 0.40),
        (0.45, 0.52),
        (0.2, 0.60),
        (-0.45, 0.64),
        (-0.5, 0.6),
    ],
    "wagon": [(-0.5, 0.13), (0.5, 0.13), (0.5, 0.40), (0.46, 0.52), (0.2, 0.60), (-0.45, 0.64), (-0.5, 0.6)],
    "suv": [(-0.5, 0.16), (0.5, 0.16), (0.5, 0.45), (0.45, 0.57), (0.22, 0.62), (-0.46, 0.64), (-0.5, 0.6)],
    "van": [(-0.5, 0.12), (0.5, 0.12), (0.5, 0.42), (0.44, 0.52), (-0.5, 0.55)],
}
_CABIN = {
    "sedan": [(-0.37, 0.60), (0.18, 0.58), (-0.03, 1.0), (-0.27, 1.0)],
    "hatchback": [(-0.47, 0.58), (0.2, 0.58), (0.0, 1.0), (-0.40, 1.0)],
    "wagon": [(-0.47, 0.58), (0.2, 0.58), (0.02, 1.0), (-0.46, 1.0)],
    "suv": [(-0.47, 0.60), (0.23, 0.60), (0.07, 1.0), (-0.46, 1.0)],
    "van": [(-0.5, 0.53), (0.44, 0.50), (0.26, 1.0), (-0.5, 1.0)],
}
# Material of each cabin edge (bottom, windscreen, roof, rear window) and of its sides.
_CABIN_SIDES = {
    "sedan": [M.GLASS, M.GLASS, M.PAINT, M.GLASS],
    "hatchback": [M.GLASS, M.GLASS, M.PAINT, M.GLASS],
    "wagon": [M.GLASS, M.GLASS, M.PAINT, M.GLASS],
    "suv": [M.GLASS, M.GLASS, M.PAINT, M.GLASS],
    "van": [M.PAINT, M.GLASS, M.PAINT, M.PAINT],
}


def _wheels(xs: Sequence[float], w: float, radius: float, tyre_w: float) -> list[TriMesh]:
    y = w / 2 - tyre_w / 2 - 0.02
    return [disc_y((x, s * y, radius), radius, tyre_w, M.TYRE) for x in xs for s in (-1.0, 1.0)]


def _plates_and_lights(l: float, w: float, z_plate: float, z_light: float) -> list[TriMesh]:
    out = []
    for s in (-1.0, 1.0):  # front and rear plate, slightly proud of the bumper
        x0 = s * (l / 2)
        out.append(
            box(
                (min(x0, x0 + s * 0.01), -0.26, z_plate - 0.06),
                (max(x0, x0 + s * 0.01), 0.26, z_plate + 0.06),
                M.PLATE,
            )
        )
    for side in (-1.0, 1.0):  # rear lights
        y0 = side * (w / 2 - 0.12)
        out.append(
            box(
                (-l / 2 - 0.01, min(y0, y0 - side * 0.25), z_light - 0.07),
                (-l / 2, max(y0, y0 - side * 0.25), z_light + 0.07),
                M.LAMP,
            )
        )
    return out


def vehicle_mesh(style: str, l: float, w: float, h: float, rng: np.random.Generator) -> TriMesh:
    """A vehicle of about the given size (metres), local frame, ground at z = 0, front towards +x.

    Styles: sedan, hatchback, wagon, suv (KITTI 'Car'), van ('Van'), truck ('Truck': cab + cargo box on
    six wheels), trailer ('Misc': a box on two wheels with a drawbar). Use :func:`fit_to_box` to place it.
    """
    if style not in VEHICLE_STYLES:
        raise ValueError(f"unknown vehicle style {style!r} (expected one of {VEHICLE_STYLES})")
    if style == "truck":
        return _truck(l, w, h, rng)
    if style == "trailer":
        return _trailer(l, w, h, rng)
    body = np.asarray(_BODY[style]) * (l, h)
    cabin = np.asarray(_CABIN[style]) * (l, h)
    inset = 0.08 * w if style != "van" else 0.02 * w
    radius = float(np.clip(0.2 * h + rng.uniform(-0.02, 0.02), 0.28, 0.42))
    wheelbase = (0.60 if style != "van" else 0.62) * l
    bottom = body[0, 1]
    parts = [
        prism_y(body, -w / 2, w / 2, [M.PAINT], M.PAINT),
        prism_y(
            cabin, -w / 2 + inset, w / 2 - inset, _CABIN_SIDES[style], M.GLASS if style != "van" else M.PAINT
        ),
        *_wheels((-wheelbase / 2 + 0.02 * l, wheelbase / 2 + 0.02 * l), w, radius, 0.2),
        *_plates_and_lights(l, w, bottom + 0.12 * h, body[-1, 1] - 0.1 * h),
    ]
    return TriMesh.merge(parts)


def _truck(l: float, w: float, h: float, rng: np.random.Generator) -> TriMesh:
    cab_l = float(rng.uniform(1.8, 2.4))
    radius = 0.5
    x_front = l / 2
    cab = np.array(
        [
            (x_front - cab_l, 0.45),
            (x_front, 0.45),
            (x_front, 0.55 * h),
            (x_front - 0.25, 0.85 * h),
            (x_front - cab_l, 0.88 * h),
        ]
    )
    # The windscreen is the sloped edge (index 2).
    cab_mesh = prism_y(
        cab, -w / 2 + 0.05, w / 2 - 0.05, [M.PAINT, M.PAINT, M.GLASS, M.PAINT, M.PAINT], M.PAINT
    )
    cargo = box((-l / 2, -w / 2, 0.9), (x_front - cab_l - 0.15, w / 2, h), M.PAINT)
    chassis = box((-l / 2 + 0.3, -w / 2 + 0.35, 0.45), (x_front - 0.2, w / 2 - 0.35, 0.9), M.METAL)
    xs = (x_front - 1.3, -l / 2 + 2.2, -l / 2 + 1.1)
    parts = [cab_mesh, cargo, chassis, *_wheels(xs, w, radius, 0.3), *_plates_and_lights(l, w, 0.6, 1.0)]
    return TriMesh.merge(parts)


def _trailer(l: float, w: float, h: float, rng: np.random.Generator) -> TriMesh:
    bar = float(rng.uniform(0.8, 1.2))
    radius = 0.3
    body = box((-l / 2, -w / 2, 0.45), (l / 2 - bar, w / 2, h), M.PAINT)
    drawbar = limb((l / 2 - bar, 0.0, 0.5), (l / 2, 0.0, 0.42), 0.08, 0.08, M.METAL)
    wheels = _wheels((-l / 2 + (l - bar) / 2,), w, radius, 0.18)
    return TriMesh.merge([body, drawbar, *wheels, *_plates_and_lights(l - bar, w, 0.55, 0.7)])


# --------------------------------------------------------------------------------------------------
# People
# --------------------------------------------------------------------------------------------------
def pedestrian_mesh(height: float, stride: float, rng: np.random.Generator) -> TriMesh:
    """A walking person: head, torso, two legs and two arms as articulated limbs.

    ``stride`` (radians, 0 = standing) is the angle of each leg from the vertical; arms swing opposite
    to the legs. Local frame, feet on z = 0, facing +x. The size of the box follows from the pose.
    """
    s = height / 1.75
    leg = 0.88 * s
    hip_z = leg * math.cos(stride)
    torso_top = hip_z + 0.58 * s
    shoulder_y = 0.2 * s * rng.uniform(0.9, 1.1)
    arm_material = M.SKIN if rng.random() < 0.3 else M.CLOTH  # short sleeves
    parts = [
        ellipsoid((0.02 * s, 0.0, torso_top + 0.17 * s), (0.1 * s, 0.085 * s, 0.12 * s), M.SKIN, 4, 8),
        box((-0.11 * s, -shoulder_y, hip_z - 0.05 * s), (0.11 * s, shoulder_y, torso_top), M.CLOTH),
    ]
    for side, sgn in ((-1.0, 1.0), (1.0, -1.0)):
        hip = np.array([0.0, side * 0.09 * s, hip_z])
        foot = hip + leg * np.array([sgn * math.sin(stride), 0.0, -math.cos(stride)])
        parts.append(limb(hip, foot + (0, 0, 0.05 * s), 0.13 * s, 0.14 * s, M.CLOTH))
        parts.append(
            box(
                (foot[0] - 0.06 * s, foot[1] - 0.05 * s, 0.0),
                (foot[0] + 0.2 * s, foot[1] + 0.05 * s, 0.08 * s),
                M.CLOTH,
            )
        )
        shoulder = np.array([0.0, side * (shoulder_y + 0.05 * s), torso_top - 0.04 * s])
        arm_a = -0.8 * sgn * stride
        hand = shoulder + 0.6 * s * np.array([math.sin(arm_a), 0.0, -math.cos(arm_a)])
        parts.append(limb(shoulder, hand, 0.09 * s, 0.09 * s, arm_material))
    mesh = TriMesh.merge(parts)
    lo, _ = mesh.bounds()
    mesh.vertices[:, 2] -= lo[2]
    return mesh


def cyclist_mesh(height: float, rng: np.random.Generator) -> TriMesh:
    """A rider on a bicycle: two tyre rings, frame tubes, handlebar, and a pedalling rider (torso
    leaning forward, one leg up, one down, arms to the handlebar). Local frame, ground at z = 0, facing +x."""
    s = height / 1.72
    r = 0.34
    wb = 1.05 * rng.uniform(0.95, 1.05)
    rear, front = np.array([-wb / 2, 0.0, r]), np.array([wb / 2, 0.0, r])
    crank = np.array([-0.05, 0.0, 0.3])
    saddle = np.array([-0.22, 0.0, 0.72 + 0.25 * (s - 1.0) + 0.2])
    bar = np.array([wb / 2 - 0.12, 0.0, saddle[2] + 0.08])
    parts = [
        ring_y(rear, r, r - 0.06, 0.05, M.TYRE),
        ring_y(front, r, r - 0.06, 0.05, M.TYRE),
        limb(rear, crank, 0.04, 0.04, M.BIKE),
        limb(crank, saddle, 0.04, 0.04, M.BIKE),
        limb(crank, bar - (0, 0, 0.1), 0.045, 0.045, M.BIKE),
        limb(saddle - (0, 0, 0.1), bar - (0, 0, 0.08), 0.04, 0.04, M.BIKE),
        limb(bar - (0, 0, 0.1), front, 0.04, 0.04, M.BIKE),
        box((bar[0] - 0.03, -0.3, bar[2] - 0.02), (bar[0] + 0.03, 0.3, bar[2] + 0.02), M.BIKE),
    ]
    # Rider.
    lean = math.radians(rng.uniform(25, 45))
    hip = saddle + (0, 0, 0.05)
    torso_len = 0.6 * s
    shoulder = hip + torso_len * np.array([math.sin(lean), 0.0, math.cos(lean)])
    parts.append(limb(hip, shoulder, 0.36 * s, 0.22 * s, M.CLOTH))
    head = shoulder + np.array([0.07, 0.0, 0.2 * s])
    parts.append(ellipsoid(head, (0.11 * s, 0.09 * s, 0.12 * s), M.SKIN, 4, 8))
    phase = rng.uniform(0, 2 * math.pi)
    for side, ph in ((-1.0, phase), (1.0, phase + math.pi)):
        pedal = crank + np.array([0.17 * math.cos(ph), side * 0.12, 0.17 * math.sin(ph)])
        h = hip + (0, side * 0.1 * s, 0)
        knee = (h + pedal) / 2 + np.array([0.2 * s, 0.0, 0.05])
        parts.append(limb(h, knee, 0.13 * s, 0.13 * s, M.CLOTH))
        parts.append(limb(knee, pedal, 0.11 * s, 0.11 * s, M.CLOTH))
        sh = shoulder + (0, side * 0.17 * s, -0.03)
        hand = np.array([bar[0], side * 0.25, bar[2]])
        parts.append(limb(sh, hand, 0.08 * s, 0.08 * s, M.CLOTH))
    return TriMesh.merge(parts)
