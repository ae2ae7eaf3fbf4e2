"""Synchronized batch norm of the sparse units across processes (DDP with sync_batchnorm).

Two CPU processes (gloo) each run a sparse residual unit on their half of a batch, with their own
masks (one process has no active block at all in the second case; in the third, one process splits its
blocks into several chunks under a tiny memory budget - statistics passes - while the other runs one chunk,
so their collectives must come in the same order); outputs, weight gradients and running statistics must
equal one process running the whole batch. On the exact path and on the capacity path, with lists of the counts
(the CPU's) and lists padded past them (a GPU's).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from detector.nn.resnet import SparseResidualUnit

pytestmark = pytest.mark.slow


def _unit() -> SparseResidualUnit:
    torch.manual_seed(0)
    u = SparseResidualUnit(6, 8, bottleneck=True, stride=2, block_size=4).double()
    for m in u.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return u


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 20, 24, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 1, 20, 24, generator=g) > 0.8).double()
    return x, mask


def _padded(unit: SparseResidualUnit, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The unit on a list of every block of the grid (padding rows past the count, as a GPU's buckets have)."""
    from detector.nn import capacity as cp

    m = unit.binary(mask)
    return cp.chain_capacity(unit, x, cp.chain_list(unit, m, unit.block_size, 10**6), m)


def _worker(rank: int, world: int, port: int, empty_rank1: bool, out_dir: str, path: str = "counts") -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        unit = nn.SyncBatchNorm.convert_sync_batchnorm(_unit()).train()
        x, mask = _data()
        if empty_rank1:
            mask[2:] = 0
        xs, ms = x[2 * rank : 2 * rank + 2], mask[2 * rank : 2 * rank + 2]
        y = unit(xs, ms) if path == "counts" else _padded(unit, xs, ms)
        y.pow(2).sum().backward()
        grads = {k: p.grad for k, p in unit.named_parameters()}
        for g in grads.values():  # DDP averages gradients; we sum them (the loss is a sum)
            dist.all_reduce(g)
        torch.save({"y": y.detach(), "grads": grads, "buffers": dict(unit.named_buffers())},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:  # both ranks done before either tears gloo down (else one may abort: "terminate called ...")
        dist.barrier()
        dist.destroy_process_group()


CASES = [(False, "counts"), (True, "counts"), (False, "padded"), (True, "padded")]


@pytest.mark.parametrize("empty_rank1, path", CASES)
def test_sparse_unit_statistics_are_synchronized_across_processes(tmp_path, empty_rank1, path):
    port = 29500 + (os.getpid() % 1000) + 10 * CASES.index((empty_rank1, path))
    mp.spawn(_worker, args=(2, port, empty_rank1, str(tmp_path), path), nprocs=2, join=True)
    ref = _unit().train()
    x, mask = _data()
    if empty_rank1:
        mask[2:] = 0
    y = ref(x, mask, dense=True)  # one process, the whole map, the mask applied
    y.pow(2).sum().backward()
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    torch.testing.assert_close(torch.cat([p["y"] for p in parts]), y.detach())
    for k, p in ref.named_parameters():
        torch.testing.assert_close(parts[0]["grads"][k], p.grad, msg=k)
        torch.testing.assert_close(parts[1]["grads"][k], p.grad, msg=k)
    for k, b in ref.named_buffers():
        torch.testing.assert_close(parts[0]["buffers"][k], b, msg=k)
        torch.testing.assert_close(parts[1]["buffers"][k], b, msg=k)
