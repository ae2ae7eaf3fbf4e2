"""Sparse layers on the sparse-block ops: dense or sparse with the same weights.

- :mod:`detector.nn.chain`: ``SparseConvChain`` (convolutions with batch norm and ReLU, optionally residual: dense,
  or on a list of the active blocks of a mask - the one sparse engine).
- :mod:`detector.nn.capacity`: a whole network on block lists, one host read per batch.
- :mod:`detector.nn.resnet`: ``SparseResidualUnit``, ``SparseStage`` and the PIXOR-style ``SparseResNet`` backbone.
- :mod:`detector.nn.plan` and :mod:`detector.nn.cost`: the execution plan (dense or a tile per stage, per batch)
  from a measured cost model.
- :mod:`detector.nn.geometry`, :mod:`detector.nn.norm`: block geometry, batch norm over tile regions.
"""

from detector.nn.chain import SparseConvChain
from detector.nn.plan import Plan, Planner
from detector.nn.resnet import SparseResidualUnit, SparseResNet, SparseStage

__all__ = ["Plan", "Planner", "SparseConvChain", "SparseResNet", "SparseResidualUnit", "SparseStage"]
