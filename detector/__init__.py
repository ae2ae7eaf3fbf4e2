"""detector: LiDAR BEV 3D object detection with sparse-block convolutions (README.md).

Importing the package loads the sbnet kernels when they are already built and up to date (a shared-library load,
no compiling), so that ``torch.export.load`` of a saved ``.pt2`` program, which calls ``torch.ops.sbnet.*``, works
after ``import detector``; the first use of the ops builds them otherwise (or ``make kernels``).
"""

from detector.ops._library import load_built as _load_built

_load_built()
