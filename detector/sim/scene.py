"""A simulated street scene: one triangle mesh in the LiDAR frame with its dynamic objects, and its random
draw (:func:`generate_scene`: a street from :mod:`detector.sim.street`, static parts from
:mod:`detector.sim.scenery`, objects from :mod:`detector.sim.traffic`).

Every dynamic object has a 3D box in the LiDAR frame that is the tight bounding box of its mesh, and whose
KITTI label values (camera-frame bottom centre, dimensions, rotation_y) are exact multiples of 0.01, so the
2-decimal label files describe the meshes exactly (see :func:`quantize_boxes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from detector.data.kitti_calib import Calibration
from detector.data.kitti_camera import boxes_from_camera, boxes_to_camera
from detector.geometry.boxes import Boxes3D, wrap_angle
from detector.sim.meshes import ALBEDO, Material, TriMesh, fit_to_box, rot_z
from detector.sim.scenery import static_parts
from detector.sim.street import Occupancy, Street, sample_street
from detector.sim.traffic import place_objects

M = Material
# Materials whose reflectivity varies per instance (car paint colour, clothes, facades, road surface).
_VARIABLE = np.zeros(len(Material), dtype=bool)
_VARIABLE[[M.PAINT, M.CLOTH, M.FACADE, M.ASPHALT]] = True


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


def quantize_boxes(boxes: np.ndarray, calib: Calibration) -> np.ndarray:
    """[N, 7] LiDAR boxes nearest to ``boxes`` whose KITTI label values (bottom centre in the rectified
    camera frame, h, w, l and rotation_y) are multiples of 0.01, i.e. what a 2-decimal label file stores."""
    boxes = np.asarray(boxes, np.float64).reshape(-1, 7)
    if len(boxes) == 0:
        return boxes
    loc, dims, ry = boxes_to_camera(Boxes3D(boxes), calib)
    loc, dims = np.round(loc, 2), np.round(dims, 2)
    ry = np.round(ry, 2)  # boxes_to_camera gives [-pi, pi): rounding stays within [-3.14, 3.14]
    return boxes_from_camera(loc, dims, ry, calib).tensor.numpy()


def assemble_scene(
    static: Sequence[tuple[TriMesh, float]],
    objects: Sequence[tuple[str, np.ndarray, TriMesh, float, bool]],
    street: Street,
) -> Scene:
    """One scene mesh from LiDAR-frame parts: ``static`` (mesh, reflectivity scale) pairs, and
    ``objects`` (class name, box [7], mesh in the object's frame, reflectivity scale, moving) whose mesh
    is fitted exactly to the box (:func:`~detector.sim.meshes.fit_to_box`) and placed with it."""
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
    st = sample_street(rng)
    occ = Occupancy()
    static = static_parts(st, rng, occ)
    placements = place_objects(st, rng, occ)
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
