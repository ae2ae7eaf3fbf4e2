"""The KITTI-format LiDAR simulator: an HDL-64E-like scan of procedural street scenes, labeled like KITTI.

One frame (:func:`detector.sim.writer.simulate_frame`):

1. A plausible calibration for KITTI's left colour camera (:func:`detector.sim.sensor.make_calibration`).
2. A street scene (:mod:`detector.sim.scene`: the street, its scenery and traffic; shapes from
   :mod:`detector.sim.meshes` and :mod:`detector.sim.actors`).
3. The scan (:func:`detector.sim.sensor.scan`): open3d's ``RaycastingScene`` casts 64 beams (elevations
   from +2.0° to −24.8°: 32 upper beams 1/3° apart, 32 lower beams about 0.52° apart, like the HDL-64E's two laser
   blocks) × ``columns`` azimuths over 360° from the sensor, 1.70–1.76 m above the road. The HDL-64E S2
   fires about 1.33 M pulses/s, i.e. about 2080 per laser per revolution at 10 Hz (0.17°); the default is
   2083 columns (0.173°), 133 k rays, less those the ego car's roof blocks (``ego_body``: ~6.6 %, low beams
   behind the sensor, where real scans have few points too). A return needs enough signal:
   ``albedo · cos(incidence) · (20 m / r)²`` must exceed ``min_signal`` (so dark surfaces at grazing angles
   and long range drop out), plus a random ``dropout`` (and extra dropout on glass); nothing beyond
   ``max_range``. The range gets Gaussian
   noise (σ = ``range_noise``, clipped at ±3σ) along the ray, so a point keeps its beam's elevation.
   Reflectance = ``albedo · (0.5 + 0.5·cos(incidence))`` × log-normal noise, clipped to [0, 0.99] and
   rounded to 0.01 as in KITTI's files; a weak return (``albedo · (20 m / r)²`` × a log-normal factor of
   σ ``zero_spread`` below ``zero_signal``) reads 0, as ~14 % of KITTI's points do (most of them far away),
   and so does a share of the returns from car paint, glass and tyres (``meshes.DARK``); lane markings and
   zebra crossings are painted (bright), building windows dark.
4. Labels (:func:`detector.sim.labels.label_frame`), following KITTI's rules:

   - candidates are the dynamic objects whose 3D box projects into the 1242×375 image (through P2);
   - the 2D box is the projected 3D box clipped to the image (:func:`~detector.data.kitti_camera.boxes_to_labels`);
   - truncation = the fraction of the projected, unclipped 2D box outside the image;
   - occlusion: ``occlusion_samples`` points are drawn on the object's mesh (area-weighted); of those
     that project into the image, a point is hidden when the ray from the camera's optical centre to
     it first hits something else. Hidden fraction ≤ 0.2 → 0 (fully visible), ≤ 0.5 → 1 (partly
     occluded), ≤ 0.85 → 2 (largely occluded); 3 (unknown) is never written;
   - an object is labeled with its class when it has at least ``MIN_POINTS`` LiDAR returns, a 2D box at
     least ``MIN_HEIGHT_PX`` tall and a hidden fraction ≤ 0.85. Otherwise, if it is still partly
     seen by the camera or the LiDAR, it becomes a ``DontCare`` region (its 2D box), as in KITTI;
     objects neither camera nor LiDAR sees are left out.

5. The road map (:meth:`~detector.sim.street.Street.road_map`): the drivable area (the road between
   the kerbs, and the cross street) as a LiDAR-frame BEV raster over x 0–70.4 m, y −40–40 m at 0.1 m
   (``ROAD_MAP_GRID``), written as ``road_map/%06d.png`` with the grid in ``road_map/grid.json``.

Determinism: every random draw of frame ``i`` comes from ``numpy.random.SeedSequence(seed,
spawn_key=(i,))`` and the ray casting is single-threaded, so a frame's files are byte-identical whatever
the number of worker processes (:func:`detector.sim.writer.generate_dataset`) and whatever the number of
frames generated, given the same library versions and CPU type (Embree's float results may differ in the
last bits between CPU instruction sets).
"""

from detector.sim.sensor import LidarSpec
from detector.sim.writer import generate_dataset, simulate_frame

__all__ = ["LidarSpec", "generate_dataset", "simulate_frame"]
