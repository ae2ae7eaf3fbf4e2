"""The execution plan (detector/nn/plan.py, cost.py): decisions that follow from the cost rule, determinism,
the cost cache's bad files, DDP agreement with different masks per rank, and block_size=auto /
data.batch_size=auto / resume through the real configs."""

from __future__ import annotations

import datetime
import json
import os
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from detector.build import build_grid, build_model
from detector.nn import cost as cost_mod
from detector.nn.chain import SparseConvChain
from detector.nn.cost import CostModel, cost_key, load_or_calibrate
from detector.nn.plan import DENSE, Planner, choose, measure, settle
from detector.nn.resnet import SparseResNet
from detector.tasks import build_datamodule, train
from tests.test_train import _cfg, _final_weights

UNIT = 1e-9  # every per-element constant; blocks convolve as fast as maps


def flat_cost(unit_s: float = 0.0) -> CostModel:
    return CostModel(dense_mac=UNIT, block_mac=((4, UNIT), (8, UNIT), (16, UNIT), (32, UNIT)), move=UNIT, pass_=UNIT,
                     dense_unit=0.0, sparse_unit=unit_s, dense_unit_train=0.0, sparse_unit_train=unit_s)


COST_OVERRIDE = ("model.plan.cost={dense_mac:1e-9,block_mac:[[8,1e-9],[16,1e-9],[32,1e-9]],move:1e-9,pass_:1e-9,"
                 "dense_unit:0,sparse_unit:2e-5,dense_unit_train:0,sparse_unit_train:2e-5}")


def conv_stage(name="conv"):
    torch.manual_seed(0)
    return [SparseConvChain(8, (8,), (3,), (1,), name=name)]


# --- the rule ------------------------------------------------------------------------------------------
def test_choice_follows_the_cost_rule():
    """A 3x3 conv on a 64 x 64 map, no fixed costs, blocks as fast as maps: on an all-ones mask sparse also
    convolves every halo, so dense is cheaper; one active pixel activates one block, and the smallest tile
    (least halo'd area) is cheapest; with 1 s per sparse unit dense wins again."""
    units = conv_stage()
    ones, one_px = torch.ones(1, 1, 64, 64), torch.zeros(1, 1, 64, 64)
    one_px[0, 0, 30, 30] = 1
    inp_all = measure("conv", "auto", units, (1, 64, 64), ones, (8, 16))
    inp_px = measure("conv", "auto", units, (1, 64, 64), one_px, (8, 16))
    assert settle([inp_all])[0].counts == ((8, 64, 0), (16, 16, 0))
    assert settle([inp_px])[0].counts == ((8, 1, 0), (16, 1, 0))
    assert choose([inp_all], flat_cost(), training=False).choices == (DENSE,)
    assert choose([inp_px], flat_cost(), training=False).choices == (8,)
    assert choose([inp_px], flat_cost(unit_s=1.0), training=True).choices == (DENSE,)
    fixed = measure("conv", 16, units, (1, 64, 64), ones, (8, 16))  # a set tile is kept, costs or not
    assert choose([fixed], flat_cost(), training=False).choices == (16,)


def test_estimates_follow_each_cost_model_on_the_same_chain():
    """The parts of an estimate that do not depend on the active blocks are kept per chain, cost model and shape:
    the same chain priced under two cost models gives each model's own figure (the module docstring's terms: a
    3x3 conv 8 -> 8 on 1 x 64 x 64, dense: MACs * dense_mac + BN and ReLU passes over its output; sparse, 5
    blocks of tile 8: each block's halo'd MACs, 3 passes over its output level, its gather and scatter, plus the
    zero map it writes into)."""
    (chain,) = conv_stage()
    macs, px = 64 * 64 * 8 * 8 * 9, 64 * 64 * 8
    block_macs, block_px, moved = 8 * 8 * 8 * 8 * 9, 8 * 8 * 8, (10 * 10 + 8 * 8) * 8
    for k in (1.0, 3.0, 1.0):  # back to the first model: its entries are still its own
        c = CostModel(dense_mac=k * UNIT, block_mac=((8, 2 * k * UNIT),), move=5 * UNIT, pass_=k * 7 * UNIT,
                      dense_unit=0.0, sparse_unit=0.0, dense_unit_train=1e-3, sparse_unit_train=2e-3)
        assert c.dense(chain, 1, 64, 64, training=False) == pytest.approx(macs * k * UNIT + px * 2 * k * 7 * UNIT)
        assert c.dense(chain, 1, 64, 64, training=True) == pytest.approx(
            3 * (macs * k * UNIT + px * 2 * k * 7 * UNIT) + 1e-3)
        per_block = block_macs * 2 * k * UNIT + 3 * block_px * k * 7 * UNIT + moved * 5 * UNIT
        assert c.sparse(chain, 1, 64, 64, 8, 5, "zeros", training=False) == pytest.approx(
            5 * per_block + px * k * 7 * UNIT)
        assert c.sparse(chain, 1, 64, 64, 8, 5, "inplace", training=True) == pytest.approx(3 * 5 * per_block + 2e-3)


def test_a_stage_no_count_could_make_sparse_is_not_measured(monkeypatch):
    """With 1 s per sparse unit no count of active blocks - not even none - makes a candidate cheaper than dense
    (a sparse estimate only grows with its blocks), so the stage is not measured (no reduce_mask) and the plan is
    the unpruned one: dense. Without fixed costs a candidate can win, so the stage is measured as before."""
    import detector.nn.plan as plan_mod

    calls = []
    real = plan_mod.block_activity
    monkeypatch.setattr(plan_mod, "block_activity", lambda *a, **k: calls.append(1) or real(*a, **k))
    units = conv_stage()
    one_px = torch.zeros(1, 1, 64, 64)
    one_px[0, 0, 30, 30] = 1
    costly = flat_cost(unit_s=1.0)
    full = measure("conv", "auto", units, (1, 64, 64), one_px, (8, 16))
    assert len(calls) == 2
    pruned = measure("conv", "auto", units, (1, 64, 64), one_px, (8, 16), prune=(costly, True))
    assert len(calls) == 2 and pruned.counts == ()  # nothing measured
    assert choose([pruned], costly, training=True).choices == choose([full], costly, training=True).choices == (DENSE,)
    kept = measure("conv", "auto", units, (1, 64, 64), one_px, (8, 16), prune=(flat_cost(), False))
    assert len(calls) == 4 and settle([kept])[0].counts == settle([full])[0].counts
    assert choose([kept], flat_cost(), training=False).choices == (8,)
    fixed = measure("conv", 16, units, (1, 64, 64), one_px, (8, 16), prune=(costly, True))  # a set tile
    assert settle([fixed])[0].counts == ((16, 1, 0),)


def test_mac_counts_and_bound_follow_the_halo_rule():
    """Counted by hand: a 3x3 conv 8 -> 8 on a 1 x 64 x 64 map is 64*64*8*8*9 MACs dense; sparse, each active
    8-px tile convolves its 8 x 8 output from a 10 x 10 block (8*8*8*8*9), and two chained 3x3 convs convolve a
    10 x 10 then an 8 x 8 output per tile (halo of the second conv). A projection adds a 1x1 conv over the
    output tile. The bound takes each stage's fewest MACs; the plan's ratio its chosen option's."""
    one = SparseConvChain(8, (8,), (3,), (1,))
    two = SparseConvChain(8, (8, 16), (3, 3), (1, 1), shortcut="projection")
    assert cost_mod.dense_macs(one, 1, 64, 64) == 64 * 64 * 8 * 8 * 9
    assert cost_mod.sparse_macs(one, 64, 64, 8, 3) == 3 * 8 * 8 * 8 * 8 * 9
    assert cost_mod.sparse_macs(two, 64, 64, 8, 1) == 10 * 10 * 8 * 8 * 9 + 8 * 8 * 8 * 16 * 9 + 8 * 8 * 8 * 16
    one_px = torch.zeros(1, 1, 64, 64)
    one_px[0, 0, 30, 30] = 1
    inp = measure("conv", "auto", [one], (1, 64, 64), one_px, (8, 16))
    plan = choose([inp], flat_cost(unit_s=1.0), training=False)  # the fixed cost makes dense the choice
    assert plan.choices == (DENSE,) and plan.mac_ratio() == 1.0
    assert plan.mac_bound() == pytest.approx((8 * 8) / (64 * 64))  # one 8-px tile of 64 x 64
    assert "bound" in plan.describe()


def test_same_inputs_same_plan():
    torch.manual_seed(1)
    mask = (torch.rand(2, 1, 96, 128) > 0.97).float()
    x = torch.randn(2, 5, 96, 128)
    plans = []
    for _ in range(2):  # fresh networks and planners, the same inputs
        torch.manual_seed(0)
        net = SparseResNet(5, stem_channels=8, stage_units=(1, 2), stage_channels=(8, 16), stage_strides=(2, 2),
                           block_size="auto", planner=Planner(cost=flat_cost(1e-4)))
        net.eval()(x, mask)
        plans.append(net.planner.last)
    assert plans[0] == plans[1]
    assert plans[0].names == ("stem", "stage1", "stage2")


# --- the cost cache -------------------------------------------------------------------------------------
def _fake_calibration(monkeypatch, busy: str | None = None) -> list[int]:
    calls = []
    monkeypatch.setattr(cost_mod, "calibrate", lambda device, dtype: calls.append(1) or flat_cost(1e-4))
    monkeypatch.setattr(cost_mod, "machine_busy", lambda device: busy)  # whatever else this machine runs
    return calls


def test_calibration_on_a_busy_machine_is_used_but_not_cached(tmp_path, monkeypatch):
    calls = _fake_calibration(monkeypatch, busy="load 8.4 on 2 CPUs")
    path = tmp_path / "plan_cost.json"
    for expected_calls in (1, 2):  # not cached: measured again, warned again
        with pytest.warns(RuntimeWarning) as rec:
            assert load_or_calibrate(path, "cpu", torch.float32) == flat_cost(1e-4)
        assert len(rec) == 1 and "busy (load 8.4 on 2 CPUs)" in str(rec[0].message)
        assert len(calls) == expected_calls and not path.exists()


def test_distorted_calibration_is_recalibrated_and_not_cached(tmp_path, monkeypatch):
    # forward alone cannot cost more than forward + backward of the same unit: such constants were stalled
    stalled = CostModel.from_dict({**flat_cost(1e-4).to_dict(), "dense_unit": 0.028, "dense_unit_train": 0.0003})
    assert "dense unit" in stalled.distortion() and flat_cost(1e-4).distortion() is None
    path = tmp_path / "plan_cost.json"
    path.write_text(json.dumps({"key": cost_key("cpu", torch.float32), "cost": stalled.to_dict()}))
    calls = _fake_calibration(monkeypatch)
    with pytest.warns(RuntimeWarning, match="distorted calibration: a dense unit"):
        assert load_or_calibrate(path, "cpu", torch.float32) == flat_cost(1e-4)
    assert calls == [1] and CostModel.from_dict(json.loads(path.read_text())["cost"]) == flat_cost(1e-4)
    path.unlink()
    monkeypatch.setattr(cost_mod, "calibrate", lambda device, dtype: calls.append(1) or stalled)
    with pytest.warns(RuntimeWarning, match="not cached"):  # a fresh stalled calibration: used, not kept
        assert load_or_calibrate(path, "cpu", torch.float32) == stalled
    assert not path.exists()


def test_machine_busy_reads_the_load_against_the_cores(monkeypatch):
    monkeypatch.setattr(cost_mod.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cost_mod.os, "getloadavg", lambda: (1.0, 0.0, 0.0))  # this process alone
    assert cost_mod.machine_busy("cpu") is None
    monkeypatch.setattr(cost_mod.os, "getloadavg", lambda: (3.5, 0.0, 0.0))
    assert cost_mod.machine_busy("cpu") == "load 3.5 on 2 CPUs"
    assert cost_mod.machine_busy("cuda") is None


@pytest.mark.parametrize("content", ["{not json", json.dumps({"key": {"machine": "elsewhere"}, "cost": {}}),
                                     "FOREIGN"], ids=["corrupt", "other-machine", "other-torch"])
def test_bad_cost_file_recalibrates_with_one_warning(tmp_path, monkeypatch, content):
    calls = _fake_calibration(monkeypatch)
    path = tmp_path / "plan_cost.json"
    if content == "FOREIGN":  # a good file written under another torch
        content = json.dumps({"key": {**cost_key("cpu", torch.float32), "torch": "0.0.1"},
                              "cost": flat_cost(1.0).to_dict()})
    path.write_text(content)
    with pytest.warns(RuntimeWarning) as rec:
        got = load_or_calibrate(path, "cpu", torch.float32)
    assert len(rec) == 1 and "recalibrating" in str(rec[0].message)
    assert got == flat_cost(1e-4) and calls == [1]
    assert json.loads(path.read_text())["key"] == cost_key("cpu", torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten file is ours now: no warning, no calibration
        assert load_or_calibrate(path, "cpu", torch.float32) == flat_cost(1e-4)
    assert calls == [1]


def test_missing_cost_file_is_calibrated_silently_and_reused(tmp_path, monkeypatch):
    calls = _fake_calibration(monkeypatch)
    path = tmp_path / "sub" / "plan_cost.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planner = Planner(cost_file=str(path))
        assert planner.cost_model(torch.device("cpu"), torch.float32) == flat_cost(1e-4)
        assert Planner(cost_file=str(path)).cost_model(torch.device("cpu"), torch.float32) == flat_cost(1e-4)
    assert calls == [1]


def test_calibration_measures_positive_constants():
    c = cost_mod.calibrate("cpu", torch.float32)
    assert c.dense_mac > 0 and all(v > 0 for _, v in c.block_mac) and c.sparse_unit_train > 0


# --- DDP: different masks per rank, different cost models, one plan ----------------------------------------
def _net(planner):
    torch.manual_seed(0)
    return SparseResNet(4, stem_channels=6, stage_units=(1, 2), stage_channels=(8, 8), stage_strides=(2, 2),
                        block_size="auto", planner=planner).double().train()


def _rank_mask(rank: int) -> torch.Tensor:
    m = torch.zeros(2, 1, 32, 40, dtype=torch.float64)
    if rank == 0:
        m[:, :, 3:6, 4:8] = 1  # a few tiles: sparse pays on its own
    else:
        m[:] = 1  # everything: dense pays on its own
    return m


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        # rank 1 even has another cost model (e.g. another calibration): rank 0's decision is broadcast
        net = _net(Planner(candidates=(4, 8), cost=flat_cost(1e-6 if rank == 0 else 10.0)))
        x = torch.randn(2, 4, 32, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            sum(f.sum() for f in net(x, _rank_mask(rank))).backward()
        torch.save({"choices": net.planner.last.choices}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()  # both ranks done before gloo is torn down (else one may abort)
        dist.destroy_process_group()


def test_ddp_ranks_agree_on_one_plan_from_summed_inputs(tmp_path):
    port = 29700 + os.getpid() % 500
    mp.spawn(_ddp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["choices"] for r in (0, 1)]
    assert got[0] == got[1]
    # = one process planning the whole batch (both ranks' frames) with rank 0's cost model
    net = _net(Planner(candidates=(4, 8), cost=flat_cost(1e-6)))
    mask = torch.cat([_rank_mask(0), _rank_mask(1)])
    inputs = net.plan_inputs((4, 4, 32, 40), mask)
    assert choose(inputs, flat_cost(1e-6), training=True, buckets=False).choices == tuple(got[0])  # the CPU's lists
    alone = choose(net.plan_inputs((2, 4, 32, 40), _rank_mask(0)), flat_cost(1e-6), training=True,
                   buckets=False).choices
    assert alone != tuple(got[0])  # rank 0 alone would have planned otherwise: the sum mattered


# --- through the real configs -----------------------------------------------------------------------------
def test_block_size_auto_through_the_model_config(tmp_path, tiny_root):
    cfg = _cfg(tmp_path, tiny_root, "mask=road_map", "model.block_size=auto", "model.head_block_size=auto",
               COST_OVERRIDE)
    grid = build_grid(cfg.bev)
    det = build_model(cfg.model, cfg.mask, grid)
    batch = next(iter(build_datamodule(cfg.data, cfg.mask, grid, True).val_dataloader()))
    for training in (True, False):
        det.train(training)
        out = det(batch)
        assert out.plan is not None
        assert out.plan.names == ("stem", "stage1", "stage2", "stage3", "stage4", "neck_s4", "neck_s8", "neck_s16",
                                  "head")
        assert all(c == DENSE or c in (4, 8, 16, 32) for c in out.plan.choices)
        assert out.heatmap.shape[-2:] == (grid.H // 4, grid.W // 4) and torch.isfinite(out.heatmap).all()
    det2 = build_model(cfg.model, cfg.mask, grid)
    det2.load_state_dict(det.state_dict())
    assert det2.eval()(batch).plan == out.plan  # a second model on the same batch: the same plan


def test_batch_size_auto_through_the_config(tmp_path, tiny_root):
    """CPU rule: per-frame memory from batches 1 and 2, the budget's share of it, clamped to the number of
    training frames (a tiny model's frame needs far less than the free memory); trial steps leave
    the weights and BN statistics as they were."""
    from detector.batch_size import find_batch_size

    cfg = _cfg(tmp_path, tiny_root, "data.batch_size=auto")
    grid = build_grid(cfg.bev)
    model = build_model(cfg.model, cfg.mask, grid)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    b = find_batch_size(lambda n: build_datamodule(cfg.data, cfg.mask, grid, True, n), model)
    n_train = len(build_datamodule(cfg.data, cfg.mask, grid, True, 1).dataset("train"))
    assert n_train >= 2 and b == n_train
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    result = train(_cfg(tmp_path / "run", tiny_root, "data.batch_size=auto", "trainer.max_steps=1",
                        "evaluate_after=false", "logger=none", "trainer.limit_val_batches=0"))
    assert result["best_ckpt"] is not None


class RecordPlans(L.Callback):
    """Keeps the distinct plans the detector ran (class attribute: the test reads it after train())."""

    seen: list = []

    def on_train_end(self, trainer, pl_module) -> None:
        RecordPlans.seen.append(set(pl_module.model.backbone.planner._seen))


def test_resume_with_a_plan_continues_exactly(tmp_path, tiny_root):
    """4 steps straight == 2 steps, stop, resume, 2 more, with block_size=auto planning every batch."""
    common = ["trainer.max_steps=4", "trainer.max_epochs=-1", "callbacks.model_checkpoint.monitor=null",
              "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.save_top_k=-1",
              "evaluate_after=false", "logger=none", "trainer.limit_val_batches=0", "data.batch_size=1",
              # the stages stay sparse: torch 2.13's CPU backward of a 1x1 stride-2 conv on some small channels-last
              # maps (e.g. [1, 8, 64, 96]) corrupts the heap, and a dense stage runs its projection that way
              "mask=road_map", "model.block_size=[auto,16,16,16,16]", "model.head_block_size=auto", COST_OVERRIDE,
              "+callbacks.plans._target_=tests.nn.test_plan.RecordPlans"]
    RecordPlans.seen = []
    straight = train(_cfg(tmp_path / "a", tiny_root, *common))
    stop = ["+callbacks.stop._target_=tests.test_train.StopAtStep", "+callbacks.stop.step=2"]
    train(_cfg(tmp_path / "b", tiny_root, *common, *stop))
    mid = sorted((tmp_path / "b" / "checkpoints").glob("*step000002.ckpt"))
    resumed = train(_cfg(tmp_path / "c", tiny_root, *common, f"ckpt_path={mid[0]}"))
    a = _final_weights(Path(straight["best_ckpt"]))
    c = _final_weights(Path(resumed["best_ckpt"]))
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=0, atol=0, msg=k)
    plans = RecordPlans.seen[0]  # the plan mixed tiles and dense (else this test would prove little)
    choices = {c for p in plans for c in p}
    assert DENSE in choices and choices - {DENSE}, plans


def test_resume_keeps_the_runs_cost_model(tmp_path, tiny_root, monkeypatch):
    """A cost model calibrated on a busy machine is used but not cached, so a resumed process would calibrate again
    and may get other constants - other plans, another run. Here each calibration returns other constants (the
    first: sparse pays; later ones: a sparse unit costs 10 s, so every auto stage would run dense): the resumed run
    must still plan with the interrupted run's model (kept in the checkpoint) and end with the same weights."""
    calls = []

    def calibrate(device, dtype):
        calls.append(1)
        return flat_cost(2e-5) if len(calls) % 2 else flat_cost(10.0)  # straight: 1st, interrupted: 3rd, resumed: 4th

    monkeypatch.setenv("DETECTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cost_mod, "calibrate", calibrate)
    monkeypatch.setattr(cost_mod, "machine_busy", lambda device: "load 9.0 on 2 CPUs")
    common = ["trainer.max_steps=4", "trainer.max_epochs=-1", "callbacks.model_checkpoint.monitor=null",
              "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.save_top_k=-1",
              "evaluate_after=false", "logger=none", "trainer.limit_val_batches=0", "data.batch_size=1",
              "mask=road_map", "model.block_size=[auto,16,16,16,16]", "model.head_block_size=auto",
              "+callbacks.plans._target_=tests.nn.test_plan.RecordPlans"]
    RecordPlans.seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "calibrated while the machine was busy", each time
        straight = train(_cfg(tmp_path / "a", tiny_root, *common))
        calls.append(1)  # the interrupted run calibrates 3rd (sparse pays), the resumed one would 4th (dense)
        stop = ["+callbacks.stop._target_=tests.test_train.StopAtStep", "+callbacks.stop.step=2"]
        train(_cfg(tmp_path / "b", tiny_root, *common, *stop))
        mid = sorted((tmp_path / "b" / "checkpoints").glob("*step000002.ckpt"))
        resumed = train(_cfg(tmp_path / "c", tiny_root, *common, f"ckpt_path={mid[0]}"))
    assert len(calls) == 3 and not list((tmp_path / "cache").glob("*.json"))  # never cached; resume did not calibrate
    a = _final_weights(Path(straight["best_ckpt"]))
    c = _final_weights(Path(resumed["best_ckpt"]))
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=0, atol=0, msg=k)
    assert any(ch != DENSE for p in RecordPlans.seen[-1] for ch in p[:1])  # the resumed run still ran the stem sparse


def test_tests_never_calibrate_into_the_users_cache():
    from detector.nn.cost import default_cost_file

    path = default_cost_file("cpu", torch.float32)
    assert Path.home() / ".cache" not in path.parents, path
