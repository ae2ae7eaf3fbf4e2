"""Triangle meshes for the LiDAR simulator: materials, the mesh type and its primitives.

Every shape is built in its own local frame (x forward, y left, z up, metres, the ground at z = 0) and
carries a material per triangle (:class:`Material`); the simulator turns materials into reflectivity.
:func:`fit_to_box` maps a shape exactly onto a 3D box, so the box is the tight axis-aligned bounding box
of the mesh in the object's frame and every LiDAR return from the object lies inside or on its box.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class Material(IntEnum):
    """Surface types; :data:`ALBEDO` gives their LiDAR reflectivity (0..1)."""

    ASPHALT = 0
    CONCRETE = 1  # sidewalks, kerbs
    GRASS = 2
    FACADE = 3  # building walls (windows are added procedurally where rays hit)
    ROOF = 4
    FOLIAGE = 5
    BARK = 6
    METAL = 7  # poles, lamp arms
    SIGN = 8  # retro-reflective traffic signs
    PAINT = 9  # vehicle body (colour varies per vehicle)
    GLASS = 10  # vehicle windows
    TYRE = 11
    PLATE = 12  # licence plates (retro-reflective)
    LAMP = 13  # rear lights / reflectors
    SKIN = 14
    CLOTH = 15  # clothing (varies per person)
    BIKE = 16


# Nominal reflectivity per material (instances of PAINT, CLOTH, FACADE and ASPHALT vary around it).
ALBEDO = np.array(
    [0.45, 0.45, 0.50, 0.40, 0.30, 0.50, 0.30, 0.45, 1.00, 0.40, 0.06, 0.05, 1.00, 0.85, 0.45, 0.35, 0.35],
    dtype=np.float32,
)
# Extra probability that a ray hitting the material gives no return (glass mostly transmits).
DROPOUT = np.zeros(len(Material), dtype=np.float32)
DROPOUT[Material.GLASS] = 0.5
# Probability that a return from the material reads reflectance 0: glossy paint, glass and rubber send little
# light back diffusely (on KITTI's real frames ~44 % of the points on Cars read 0, against ~9 % on the ground).
DARK = np.zeros(len(Material), dtype=np.float32)
DARK[[Material.PAINT, Material.GLASS, Material.TYRE]] = (0.3, 0.7, 0.7)


@dataclass
class TriMesh:
    """``vertices`` [V, 3] float64, ``triangles`` [T, 3] int64 (vertex indices), ``material`` [T] uint8."""

    vertices: np.ndarray
    triangles: np.ndarray
    material: np.ndarray

    @classmethod
    def merge(cls, meshes: Sequence[TriMesh]) -> TriMesh:
        if not meshes:
            return cls(np.zeros((0, 3)), np.zeros((0, 3), np.int64), np.zeros(0, np.uint8))
        offsets = np.cumsum([0] + [len(m.vertices) for m in meshes[:-1]])
        return cls(
            np.concatenate([m.vertices for m in meshes]),
            np.concatenate([m.triangles + o for m, o in zip(meshes, offsets, strict=True)]),
            np.concatenate([m.material for m in meshes]),
        )

    def transformed(self, rotation: np.ndarray, translation: Sequence[float] = (0.0, 0.0, 0.0)) -> TriMesh:
        """``rotation @ v + translation`` for every vertex."""
        v = self.vertices @ np.asarray(rotation, dtype=np.float64).T + np.asarray(
            translation, dtype=np.float64
        )
        return TriMesh(v, self.triangles, self.material)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self.vertices.min(axis=0), self.vertices.max(axis=0)

    def areas(self) -> np.ndarray:
        a, b, c = (self.vertices[self.triangles[:, k]] for k in range(3))
        return 0.5 * np.linalg.norm(np.cross(b - a, c - a), axis=1)


# --------------------------------------------------------------------------------------------------
# Rotations and primitives
# --------------------------------------------------------------------------------------------------
def rot_z(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def rot_y(a: float) -> np.ndarray:
    """Rotation about +y; a positive angle tips +x downwards (towards -z)."""
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


_BOX_TRIS = np.array(
    [
        [0, 2, 1],
        [1, 2, 3],
        [4, 5, 6],
        [5, 7, 6],
        [0, 1, 4],
        [1, 5, 4],
        [2, 6, 3],
        [3, 6, 7],
        [0, 4, 2],
        [2, 4, 6],
        [1, 3, 5],
        [3, 7, 5],
    ]
)
# Vertex k of a box has corner bits (x: k & 1, y: k >> 1 & 1, z: k >> 2 & 1).
_BOX_BITS = np.array([[k & 1, (k >> 1) & 1, (k >> 2) & 1] for k in range(8)], dtype=np.float64)


def box(lo: Sequence[float], hi: Sequence[float], material: int) -> TriMesh:
    """Axis-aligned box from corner ``lo`` to corner ``hi``."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    return TriMesh(lo + _BOX_BITS * (hi - lo), _BOX_TRIS.copy(), np.full(12, material, np.uint8))


def limb(start: Sequence[float], end: Sequence[float], width: float, depth: float, material: int) -> TriMesh:
    """A box of cross-section ``depth`` × ``width`` whose axis runs from ``start`` to ``end`` (legs, arms,
    bicycle tubes). The ``width`` side stays as close to the y axis as the direction allows."""
    start, end = np.asarray(start, np.float64), np.asarray(end, np.float64)
    d = end - start
    length = float(np.linalg.norm(d))
    e3 = d / length
    e2 = np.array([0.0, 1.0, 0.0]) - e3[1] * e3
    if np.linalg.norm(e2) < 1e-6:  # axis along y: take x for the depth side
        e2 = np.array([0.0, 0.0, 1.0]) - e3[2] * e3
    e2 /= np.linalg.norm(e2)
    e1 = np.cross(e2, e3)
    m = box((-depth / 2, -width / 2, 0.0), (depth / 2, width / 2, length), material)
    return m.transformed(np.stack([e1, e2, e3], axis=1), start)


def prism_y(
    profile_xz: np.ndarray, y0: float, y1: float, side_materials: Sequence[int], cap_material: int
) -> TriMesh:
    """Extrude a convex polygon given counter-clockwise in the (x, z) plane from y = y0 to y = y1.

    ``side_materials[k]`` is the material of the face swept by polygon edge k → k+1; the two caps
    (faces at y0 and y1) take ``cap_material``.
    """
    p = np.asarray(profile_xz, np.float64)
    k = len(p)
    v = np.concatenate(
        [
            np.stack([p[:, 0], np.full(k, y0), p[:, 1]], axis=1),
            np.stack([p[:, 0], np.full(k, y1), p[:, 1]], axis=1),
        ]
    )
    i = np.arange(k)
    j = (i + 1) % k
    sides = np.concatenate([np.stack([i, j, i + k], 1), np.stack([j, j + k, i + k], 1)])
    fan = np.arange(1, k - 1)
    caps = np.concatenate(
        [
            np.stack([np.zeros(k - 2, int), fan + 1, fan], 1),
            np.stack([np.full(k - 2, k), fan + k, fan + 1 + k], 1),
        ]
    )
    side_mat = np.asarray(side_materials, np.uint8)
    if side_mat.size == 1:
        side_mat = np.full(k, side_mat.item(), np.uint8)
    if side_mat.size != k:
        raise ValueError(f"prism_y: {k} edges but {side_mat.size} side materials")
    mats = np.concatenate([side_mat, side_mat, np.full(2 * (k - 2), cap_material, np.uint8)])
    return TriMesh(v, np.concatenate([sides, caps]).astype(np.int64), mats)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@functools.cache
def _unit_cylinder(sides: int) -> TriMesh:
    """Radius 1, axis along y from -0.5 to 0.5 (a read-only template)."""
    a = np.linspace(0.0, 2 * math.pi, sides, endpoint=False)
    m = prism_y(np.stack([np.cos(a), np.sin(a)], axis=1), -0.5, 0.5, [0], 0)
    return TriMesh(_readonly(m.vertices), _readonly(m.triangles), m.material)


def disc_y(center: Sequence[float], radius: float, width: float, material: int, sides: int = 10) -> TriMesh:
    """A solid cylinder whose axis is parallel to y (wheels)."""
    t = _unit_cylinder(sides)
    v = t.vertices * (radius, width, radius) + np.asarray(center, np.float64)
    return TriMesh(v, t.triangles, np.full(len(t.triangles), material, np.uint8))


def cylinder_z(
    center_xy: Sequence[float], z0: float, z1: float, radius: float, material: int, sides: int = 8
) -> TriMesh:
    """A vertical cylinder (trunks, poles)."""
    t = _unit_cylinder(sides)
    v = t.vertices[:, [0, 2, 1]] * (radius, radius, z1 - z0) + (center_xy[0], center_xy[1], (z0 + z1) / 2)
    return TriMesh(v, t.triangles, np.full(len(t.triangles), material, np.uint8))


@functools.cache
def _ring_topology(sides: int) -> np.ndarray:
    """Triangles of a tube whose vertices come in 4 circles of ``sides`` (inner at y0, inner at y1, outer
    at y0, outer at y1): inner surface, outer surface and the two annular caps, as quads between circles."""
    k = np.arange(sides)
    j = (k + 1) % sides
    tris = []
    for a, b in ((0, 1), (2, 3), (0, 2), (1, 3)):
        qa, qb = a * sides, b * sides
        tris.append(np.stack([qa + k, qa + j, qb + k], axis=1))
        tris.append(np.stack([qa + j, qb + j, qb + k], axis=1))
    return _readonly(np.concatenate(tris))


def ring_y(
    center: Sequence[float], r_out: float, r_in: float, width: float, material: int, sides: int = 14
) -> TriMesh:
    """A tyre seen as a tube: the annulus between radii ``r_in`` and ``r_out`` extruded along y (a
    bicycle wheel without its spokes, so rays pass through the middle)."""
    a = np.linspace(0.0, 2 * math.pi, sides, endpoint=False)
    rings = [(r_in, -width / 2), (r_in, width / 2), (r_out, -width / 2), (r_out, width / 2)]
    v = np.concatenate(
        [np.stack([r * np.cos(a), np.full(sides, y), r * np.sin(a)], axis=1) for r, y in rings]
    )
    t = _ring_topology(sides)
    return TriMesh(v + np.asarray(center, np.float64), t, np.full(len(t), material, np.uint8))


@functools.cache
def _unit_sphere(rings: int, segments: int) -> TriMesh:
    lat = np.linspace(0.0, math.pi, rings + 1)[1:-1]
    lon = np.linspace(0.0, 2 * math.pi, segments, endpoint=False)
    la, lo = np.meshgrid(lat, lon, indexing="ij")
    dirs = np.stack([np.sin(la) * np.cos(lo), np.sin(la) * np.sin(lo), np.cos(la)], axis=-1).reshape(-1, 3)
    dirs = np.concatenate([[[0.0, 0.0, 1.0]], dirs, [[0.0, 0.0, -1.0]]])
    n_in = rings - 1
    tris = []
    idx = lambda r, s: 1 + r * segments + (s % segments)  # noqa: E731
    bottom = 1 + n_in * segments
    for s in range(segments):
        tris.append([0, idx(0, s), idx(0, s + 1)])
        tris.append([bottom, idx(n_in - 1, s + 1), idx(n_in - 1, s)])
        for r in range(n_in - 1):
            tris.append([idx(r, s), idx(r + 1, s), idx(r + 1, s + 1)])
            tris.append([idx(r, s), idx(r + 1, s + 1), idx(r, s + 1)])
    t = np.asarray(tris, np.int64)
    return TriMesh(_readonly(dirs), _readonly(t), np.zeros(len(t), np.uint8))


def ellipsoid(
    center: Sequence[float],
    radii: Sequence[float],
    material: int,
    rings: int = 5,
    segments: int = 8,
    rng: np.random.Generator | None = None,
    jitter: float = 0.0,
) -> TriMesh:
    """A closed UV-sphere scaled to ``radii``; with ``rng`` each vertex moves radially by up to
    ±``jitter`` (a fraction of the radius) for irregular shapes (tree crowns, bushes)."""
    t = _unit_sphere(rings, segments)
    dirs = t.vertices
    if rng is not None and jitter > 0:
        dirs = dirs * (1.0 + rng.uniform(-jitter, jitter, size=(len(dirs), 1)))
    v = dirs * np.asarray(radii, np.float64) + np.asarray(center, np.float64)
    return TriMesh(v, t.triangles, np.full(len(t.triangles), material, np.uint8))


def fit_to_box(mesh: TriMesh, dims: Sequence[float]) -> TriMesh:
    """Scale and centre ``mesh`` so its bounding box is exactly [-l/2, l/2] × [-w/2, w/2] × [-h/2, h/2]
    for ``dims`` = (l, w, h): the box of the object, in its own frame."""
    lo, hi = mesh.bounds()
    dims = np.asarray(dims, np.float64)
    v = (mesh.vertices - lo) / (hi - lo)  # exactly 0 and 1 at the extremes
    return TriMesh((v - 0.5) * dims, mesh.triangles, mesh.material)
