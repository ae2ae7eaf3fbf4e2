"""Sparse layers on the sparse-block ops: dense or sparse with the same weights.

- :mod:`detector.nn.chain`: ``SparseConvChain`` (convolutions with batch norm and ReLU, optionally residual, run on
  the active blocks of a mask) and ``ActiveBlocks``.
- :mod:`detector.nn.resnet`: ``SparseResidualUnit``, ``SparseStage`` and the PIXOR-style ``SparseResNet`` backbone.
- :mod:`detector.nn.plan` and :mod:`detector.nn.cost`: the execution plan (dense or a tile per stage, per batch)
  from a measured cost model.
- :mod:`detector.nn.block_pass`, :mod:`detector.nn.chunked`, :mod:`detector.nn.geometry`, :mod:`detector.nn.norm`:
  how a chain runs on blocks (the pass, memory-bounded chunks, block geometry, batch norm over tile regions).
"""

from detector.nn.chain import ActiveBlocks, SparseConvChain
from detector.nn.plan import Plan, Planner
from detector.nn.resnet import SparseResidualUnit, SparseResNet, SparseStage

__all__ = ["ActiveBlocks", "Plan", "Planner", "SparseConvChain", "SparseResNet", "SparseResidualUnit", "SparseStage"]
