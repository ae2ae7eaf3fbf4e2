"""The execution plan: for every sparse stage a block size or dense, decided deterministically.

A *stage* is a run of conv chains that share a block size and a mask (the backbone's stem and stages, the
neck's smoothing convolution at each level, the head's tower). Its setting is an int (that tile), ``"dense"``
or ``"auto"``. For ``auto`` the plan takes the cheapest of dense and the candidate tiles under the
:class:`~detector.nn.cost.CostModel`, given

- the shapes (batch, map, channels, kernels, strides of every chain),
- the active blocks: for each candidate tile the number of blocks ``reduce_mask`` activates on the stage's
  mask (first unit at its input resolution, the others at the stage's output resolution), counted on the
  device (``block_activity(...).sum()``) and read for all stages at once: one host sync per plan on a GPU,
- training or inference (fixed costs measured forward, or forward + backward).

It is a pure function of those inputs (:func:`choose`): the same batch gives the same plan, so training can
use it and a resumed run replays the same plans. Under DDP in training the inputs are summed over the ranks
(one all-reduce of the counts) and rank 0's decision is broadcast, so every rank runs every stage the same
way (a stage dense on one rank and sparse on another would pair SyncBatchNorm's all_gather with the sparse
statistics' all_reduce). Ties go to dense, then to the smaller tile.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from detector.errors import ConfigError
from detector.ops import block_activity
from detector.ops.capacity import bucket_for, uses_buckets

from .cost import CostModel, dense_macs, load_or_calibrate, sparse_macs

__all__ = ["DENSE", "AUTO", "CANDIDATES", "StageInput", "Plan", "Planner", "measure", "settle", "choose",
           "stage_macs", "stage_cost", "list_rows", "check_setting"]

DENSE = "dense"
AUTO = "auto"
CANDIDATES = (4, 8, 16, 32)
log = logging.getLogger(__name__)


def check_setting(value: object, what: str) -> int | str:
    """An int >= 1, 'dense' or 'auto' (else a ConfigError naming ``what``)."""
    if value in (AUTO, DENSE) or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ConfigError(f"{what} must be an int >= 1, 'auto' or 'dense', got {value!r}")


@dataclass(frozen=True)
class StageInput:
    """What the plan of one stage depends on. ``units``: its chains (first, then the rest, which share a
    geometry); ``shape``: (N, H, W) of the stage input; ``rest_hw``: the others' input map; ``counts``:
    (tile, active blocks of the first unit, of each other unit) per tile considered - ints, or 0-d tensors on
    the mask's device as :func:`measure` returns them until :func:`settle` reads them; ``recompute``: a training
    step runs the stage's forward twice (activation checkpointing, ``model.checkpoint_stages``)."""

    name: str
    setting: int | str
    units: tuple
    shape: tuple[int, int, int]
    rest_hw: tuple[int, int]
    counts: tuple[tuple[int, int, int], ...]
    recompute: bool = False

    def with_totals(self, n: int, counts: Sequence[tuple[int, int, int]]) -> StageInput:
        return replace(self, shape=(n, *self.shape[1:]), counts=tuple(counts))


@dataclass(frozen=True)
class Plan:
    """Per stage: ``choices[i]`` (a tile or 'dense'), the estimated milliseconds of each option and its
    multiply-accumulates (:func:`stage_macs`: halos included)."""

    names: tuple[str, ...]
    choices: tuple[int | str, ...]
    estimates_ms: tuple[tuple[tuple[int | str, float], ...], ...]
    macs: tuple[tuple[tuple[int | str, int], ...], ...] = ()

    def choice(self, name: str) -> int | str:
        return self.choices[self.names.index(name)]

    def describe(self) -> str:
        """One line per stage: the choice and every option's estimate."""
        lines = []
        for n, c, est in zip(self.names, self.choices, self.estimates_ms, strict=True):
            opts = ", ".join(f"{k}: {v:.2f}" for k, v in est)
            lines.append(f"  {n:<12} {c!s:>5}   estimated ms: {opts}")
        if self.macs:
            lines.append(f"  MACs of the plan / dense {self.mac_ratio():.3f}; with every stage at its fewest MACs "
                         f"(active tiles and halos: the bound) {self.mac_bound():.3f}")
        return "\n".join(lines)

    def mac_ratio(self) -> float:
        """Multiply-accumulates of the chosen options over those of the all-dense run."""
        chosen = sum(dict(m)[c] for c, m in zip(self.choices, self.macs, strict=True))
        return chosen / max(1, sum(dict(m)[DENSE] for m in self.macs))

    def mac_bound(self) -> float:
        """The fewest multiply-accumulates any option gives per stage, over the all-dense run's: the speedup
        bound ``1 / mac_bound()`` that the active tiles and their halos leave (conv stages only)."""
        return sum(min(v for _, v in m) for m in self.macs) / max(1, sum(dict(m)[DENSE] for m in self.macs))

    def as_scalars(self) -> dict[str, float]:
        """``plan/<stage>`` = the tile, 0 for dense, and ``plan/mac_ratio``, ``plan/mac_bound`` (TensorBoard
        scalars)."""
        out = {f"plan/{n}": float(0 if c == DENSE else c) for n, c in zip(self.names, self.choices, strict=True)}
        if self.macs:
            out.update({"plan/mac_ratio": self.mac_ratio(), "plan/mac_bound": self.mac_bound()})
        return out


def measure(name: str, setting: int | str, units: Sequence, x_shape: Sequence[int], mask_out: torch.Tensor | None,
            candidates: Sequence[int], prune: tuple[CostModel, bool] | None = None) -> StageInput:
    """The plan input of one stage: active blocks per candidate tile (only the set tile for an int
    setting; none for dense) on the stage's mask at its output resolution, ``mask_out``: every unit's tiles are
    those whose output holds a pixel of it (the first unit's on its own output map, the others' on theirs, the
    same map).

    ``prune`` (cost model, training): an ``auto`` stage where no candidate could beat dense even with no active
    block at all - a sparse stage's estimate only grows with its blocks - is not measured (no candidate, so
    :func:`choose` takes dense, as it would have on any counts): each count costs a ``block_activity`` launch
    and a sum. Not under DDP, where every rank must measure the same stages (:meth:`Planner.prune`).

    The counts are 0-d tensors on the mask's device (no host sync here); :func:`settle` reads those of all
    stages at once."""
    N, H, W = int(x_shape[0]), int(x_shape[-2]), int(x_shape[-1])
    first = units[0]
    tiles = list(candidates) if setting == AUTO else [] if setting == DENSE else [int(setting)]
    rest_hw = first.geometry(H, W, 16).levels[-1].map_size
    if prune is not None and tiles and setting == AUTO:
        empty = StageInput(name, setting, tuple(units), (N, H, W), tuple(rest_hw), tuple((t, 0, 0) for t in tiles))
        dense = stage_cost(empty, DENSE, *prune)
        if all(stage_cost(empty, t, *prune) >= dense for t in tiles):
            tiles = []
    counts = []
    for t in tiles:
        k1 = block_activity(mask_out, first.geometry(H, W, t).select, tol=first.tol).sum()
        counts.append((t, k1, k1 if len(units) > 1 else 0))  # the other units: the same tiles of the same map
    return StageInput(name, setting, tuple(units), (N, H, W), tuple(rest_hw), tuple(counts))


def settle(inputs: Sequence[StageInput]) -> list[StageInput]:
    """The inputs with every count an int: the tensors among them read in one transfer (one host sync on a
    GPU for the whole plan instead of one per count)."""
    pending = [k for i in inputs for c in i.counts for k in c[1:] if isinstance(k, torch.Tensor)]
    if not pending:
        return list(inputs)
    values = iter(torch.stack([k.reshape(()).to(torch.int64) for k in pending]).tolist())
    return [i.with_totals(i.shape[0], [(c[0], *(next(values) if isinstance(k, torch.Tensor) else int(k)
                                                for k in c[1:])) for c in i.counts]) for i in inputs]


def stage_cost(inp: StageInput, option: int | str, cost: CostModel, training: bool, buckets: bool = True) -> float:
    """Estimated seconds of the stage run dense (``option == 'dense'``) or sparse with that tile on its block lists
    (which hold the bucket of the count, or with ``buckets`` False the count: :func:`list_rows`). A stage that
    recomputes its forward in training (``inp.recompute``) pays the forward once more: a third of the step's
    per-element terms (the backward's two), priced as 4/3 of the step."""
    (N, H, W), (Hr, Wr) = inp.shape, inp.rest_hw
    first, rest = inp.units[0], inp.units[1:]
    again = 4 / 3 if training and inp.recompute else 1.0
    if option == DENSE:
        return again * (cost.dense(first, N, H, W, training) + sum(cost.dense(u, N, Hr, Wr, training) for u in rest))
    _, k1, kr = next(c for c in inp.counts if c[0] == option)
    k1, kr = list_rows(inp, option, k1, kr, buckets=buckets)
    base = "copy" if first.shortcut == "identity" else "zeros"
    return again * (cost.sparse(first, N, H, W, option, k1, base, training) + sum(
        cost.sparse(u, N, Hr, Wr, option, kr, "inplace", training) for u in rest))


def list_rows(inp: StageInput, tile: int, k1: int, kr: int, smallest: int = 8, buckets: bool = True
              ) -> tuple[int, int]:
    """The rows of the block lists a stage runs on at ``tile`` given its counts: the
    smallest bucket (:func:`~detector.ops.capacity.bucket_for`) of the first unit's grid that holds ``k1`` and
    of the other units' grid that holds ``kr`` (0 for a one-unit stage); ``buckets`` False
    (:func:`~detector.ops.capacity.uses_buckets`): the counts themselves (at least one row)."""
    (N, H, W), (Hr, Wr) = inp.shape, inp.rest_hw

    def rows(k: int, unit, h: int, w: int) -> int:  # noqa: ANN001
        total = N * unit.geometry(h, w, tile).block.num_blocks
        return bucket_for(int(k), total, smallest) if buckets else min(max(int(k), 1), total)

    c1 = rows(k1, inp.units[0], H, W)
    if len(inp.units) == 1:
        return c1, 0
    return c1, rows(kr, inp.units[1], Hr, Wr)


def stage_macs(inp: StageInput, option: int | str) -> int:
    """Multiply-accumulates of the stage run dense or sparse with that tile (halos included)."""
    (N, H, W), (Hr, Wr) = inp.shape, inp.rest_hw
    first, rest = inp.units[0], inp.units[1:]
    if option == DENSE:
        return dense_macs(first, N, H, W) + sum(dense_macs(u, N, Hr, Wr) for u in rest)
    _, k1, kr = next(c for c in inp.counts if c[0] == option)
    return sparse_macs(first, H, W, option, k1) + sum(sparse_macs(u, Hr, Wr, option, kr) for u in rest)


def choose(inputs: Sequence[StageInput], cost: CostModel, training: bool, buckets: bool = True) -> Plan:
    """THE decision (pure): per stage its set value, or for 'auto' the option of least estimated cost
    (dense first, then the tiles in increasing order; a later option must be strictly cheaper) on block lists
    (:mod:`detector.nn.capacity`) of a bucket's rows or, ``buckets`` False, of the counts."""
    inputs = settle(inputs)
    choices, estimates, macs = [], [], []
    for inp in inputs:
        options = [DENSE] + sorted(c[0] for c in inp.counts)
        est = [(o, stage_cost(inp, o, cost, training, buckets)) for o in options]
        macs.append(tuple((o, stage_macs(inp, o)) for o in options))
        if inp.setting == AUTO:
            best = est[0]
            for o in est[1:]:
                if o[1] < best[1]:
                    best = o
            choices.append(best[0])
        else:
            choices.append(inp.setting)
        estimates.append(tuple((o, 1e3 * s) for o, s in est))
    return Plan(tuple(i.name for i in inputs), tuple(choices), tuple(estimates), tuple(macs))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Planner:
    """Decides plans (:func:`choose`) with a cost model that is given (``cost``: a CostModel or its dict),
    or loaded from / calibrated into ``cost_file`` (default: :func:`detector.nn.cost.default_cost_file`) at
    first use per device and dtype. ``sync``: under DDP in training, sum the inputs over the ranks and
    broadcast rank 0's plan. The first plan is printed (per training / inference); the first ``report_plans``
    distinct plans are handed to loggers by :meth:`take_new`."""

    def __init__(self, candidates: Sequence[int] = CANDIDATES, cost: CostModel | dict | None = None,
                 cost_file: str | None = None, sync: bool = True) -> None:
        cands = tuple(candidates)
        if not cands or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in cands):
            raise ValueError(f"Planner: candidates must be ints >= 1, got {list(candidates)!r}")
        self.candidates = tuple(sorted(set(cands)))
        self.cost = CostModel.from_dict(dict(cost)) if cost is not None and not isinstance(cost, CostModel) else cost
        self.cost_file = cost_file
        self.sync = sync
        self._models: dict[tuple[str, torch.dtype], CostModel] = {}
        self._memo: dict[tuple, Plan] = {}
        self._seen: set[tuple] = set()
        self._new: list[Plan] = []
        self._printed: set[bool] = set()
        self.report_plans = 10  # distinct plans handed to take_new (TensorBoard text), the first ones
        self.last: Plan | None = None

    def cost_model(self, device: torch.device, dtype: torch.dtype) -> CostModel:
        if self.cost is not None:
            return self.cost
        key = (torch.device(device).type, dtype)
        if key not in self._models:
            self._models[key] = load_or_calibrate(self.cost_file, device, dtype)
        return self._models[key]

    def state(self) -> dict[str, dict]:
        """The cost models this planner has loaded or calibrated, as plain containers (a checkpoint keeps them):
        ``{"<device>/<dtype>": CostModel dict}``; empty when the cost is given (the config has it)."""
        if self.cost is not None:
            return {}
        return {f"{dev}/{str(dtype).removeprefix('torch.')}": m.to_dict() for (dev, dtype), m in self._models.items()}

    def restore(self, state: dict[str, dict]) -> None:
        """Plan with the cost models of :meth:`state` (a resumed run continues with the plans of the run it
        resumes, even where a calibration now would give other constants: one taken on a busy machine is not
        cached). A given cost (the config's) takes precedence."""
        for key, d in state.items():
            dev, _, dtype = key.partition("/")
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"Planner.restore: bad cost model key {key!r}")
            self._models[(dev, getattr(torch, dtype))] = CostModel.from_dict(d)
        self._memo.clear()  # plans decided under the models these replace

    def prune(self, device: torch.device, dtype: torch.dtype, training: bool) -> tuple[CostModel, bool] | None:
        """:func:`measure`'s ``prune``: this planner's cost model, except under DDP in training (every rank
        must then measure the same stages: their counts are summed)."""
        return None if self._shared(training) else (self.cost_model(device, dtype), training)

    def _shared(self, training: bool) -> bool:
        """Whether the plan is decided for all ranks: inputs summed over them, rank 0's plan broadcast."""
        return self.sync and training and _distributed()

    def decide(self, inputs: Sequence[StageInput], device: torch.device, dtype: torch.dtype, training: bool) -> Plan:
        """The plan of these inputs (:func:`choose`)."""
        inputs = settle(inputs)
        shared = self._shared(training)
        if shared:
            inputs = _sum_over_ranks(inputs, device)
        buckets = uses_buckets(device)
        key = (training, buckets, tuple((i.name, i.setting, id(i.units[0]), i.shape, i.rest_hw, i.counts, i.recompute)
                                     for i in inputs))
        plan = self._memo.get(key)
        if plan is None:
            plan = choose(inputs, self.cost_model(device, dtype), training, buckets)
            if len(self._memo) > 1024:
                self._memo.clear()
            self._memo[key] = plan
        if shared:
            plan = _from_rank0(plan, device)
        if plan.choices not in self._seen:
            self._seen.add(plan.choices)
            if len(self._seen) <= self.report_plans:
                self._new.append(plan)
            if training not in self._printed and (not _distributed() or dist.get_rank() == 0):
                self._printed.add(training)
                what = "training" if training else "inference"
                print(f"execution plan ({what}; batch of {inputs[0].shape[0]}; "
                      "it is decided per batch, later ones are logged as plan/<stage> scalars):\n"
                      + plan.describe(), flush=True)
        self.last = plan
        return plan

    def take_new(self) -> list[Plan]:
        """Plans first seen since the last call (for a logger's text entries)."""
        new, self._new = self._new, []
        return new


def _sum_over_ranks(inputs: Sequence[StageInput], device: torch.device) -> list[StageInput]:
    dev = torch.device(device) if dist.get_backend() != "gloo" else torch.device("cpu")
    flat = [i.shape[0] for i in inputs] + [k for i in inputs for c in i.counts for k in c[1:]]
    t = torch.tensor(flat, dtype=torch.int64, device=dev)
    dist.all_reduce(t)
    vals = t.tolist()
    n, pos, out = vals[: len(inputs)], len(inputs), []
    for j, i in enumerate(inputs):
        counts = []
        for c in i.counts:
            counts.append((c[0], vals[pos], vals[pos + 1]))
            pos += 2
        out.append(i.with_totals(n[j], counts))
    return out


def _from_rank0(plan: Plan, device: torch.device) -> Plan:
    dev = torch.device(device) if dist.get_backend() != "gloo" else torch.device("cpu")
    t = torch.tensor([0 if c == DENSE else int(c) for c in plan.choices], dtype=torch.int64, device=dev)
    dist.broadcast(t, src=0)
    choices = tuple(DENSE if v == 0 else int(v) for v in t.tolist())
    return Plan(plan.names, choices, plan.estimates_ms, plan.macs)
