"""Memory estimate (detector/memory.py) vs the allocator's measured peak on a small model, the one-line answer
for a batch that cannot fit, and data.batch_size=auto's predicted-vs-measured line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from detector.bench import estimate_memory
from detector.bench import memory as bench_memory
from detector.build import build_grid, build_model
from detector.memory import MB, estimate, measure_peak, stage_shares, tensor_bytes
from detector.nn import norm
from detector.tasks import build_datamodule
from tests.paths import REPO

from .test_train import _cfg

# bev=small's grid and the shipped CPU model (configs/model/sparse.yaml; the tiny test model's overrides undone),
# fixed tiles. The estimate's dense-conv input copy is measured on this layout (a narrower stem does not copy).
SMALL = ["model.backbone.stem_channels=24", "model.backbone.stage_channels=[48,64,96,128]",
         "model.neck_channels=64", "model.head_channels=64", "model.block_size=16", "model.head_block_size=16",
         "bev.x_range=[0,51.2]", "bev.y_range=[-19.2,19.2]", "bev.z_resolution=0.35",
         "model.backbone.stage_units=[1,2,2,1]"]


def _setup(tmp_path, tiny_root, dense: bool):
    # a data-side mask (road_map): the tests set the computation mask themselves
    cfg = _cfg(tmp_path, tiny_root, *SMALL, "mask=none" if dense else "mask=road_map")
    grid = build_grid(cfg.bev)
    torch.manual_seed(0)
    return cfg, grid, build_model(cfg.model, cfg.mask, grid)


def _batch(cfg, grid, b: int, share: float | None):
    data_cfg = cfg.data.copy()
    data_cfg.batch_size = b
    batch = next(iter(build_datamodule(data_cfg, cfg.mask, grid, share is not None).train_dataloader()))
    if share is None:
        return dataclasses.replace(batch, mask=None)
    g = torch.Generator().manual_seed(b)
    coarse = (torch.rand(b, 1, -(-grid.H // 16), -(-grid.W // 16), generator=g) < share).float()
    mask = coarse.repeat_interleave(16, 2).repeat_interleave(16, 3)[:, :, : grid.H, : grid.W].contiguous()
    return dataclasses.replace(batch, mask=mask)


def _fresh(batch):
    """The batch with a mask tensor of its own, as every batch a loader gives: what the model derives from a mask
    (its binary form, its strided copies) is made once per mask tensor, and the warm-up's must not be reused."""
    return batch if batch.mask is None else dataclasses.replace(batch, mask=batch.mask.clone())


def _measure(model, batch, train: bool) -> float:
    if not train:
        model.eval()
        with torch.no_grad():
            model(_fresh(batch))
            batch = _fresh(batch)
            folded = [t for m in model.modules() if m in norm._FOLDED for t in norm._FOLDED[m][1]]  # folded weights
            base = tensor_bytes([*model.parameters(), *model.buffers(), *folded, batch.points, batch.mask])
            return (base + measure_peak(lambda: model(batch), torch.device("cpu"))) / MB
    model.train()
    opt = torch.optim.Adam(model.parameters())

    def step():
        loss, _ = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    batch = _fresh(batch)
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    base = tensor_bytes([*model.parameters(), *model.buffers(), *state, batch.points, batch.mask])
    return (base + measure_peak(step, torch.device("cpu"))) / MB


@pytest.mark.parametrize("share", [None, 0.5, 0.2])
@pytest.mark.parametrize("train", [True, False])
def test_estimate_within_ten_percent_of_the_allocator_peak(tmp_path, tiny_root, share, train):
    cfg, grid, model = _setup(tmp_path, tiny_root, share is None)
    for b in (1, 3):
        batch = _batch(cfg, grid, b, share)
        est = estimate(model, b, None if share is None else share, train, mask=batch.mask).peak_mb
        measured = _measure(model, batch, train)
        assert abs(est - measured) <= 0.10 * measured, (b, est, measured)


@pytest.mark.parametrize("train", [True, False])
def test_the_mask_nets_share_of_the_estimate_within_ten_percent(tmp_path, tiny_root, train):
    """mask=predicted (make train's): what the mask net adds to the peak - its own tensors and, in training,
    the object mask its prediction is combined with - estimated within 10 % of what it adds to the measured
    peak: the same network with a data-side mask (road_map) given the very mask the net computed."""
    cfg = _cfg(tmp_path, tiny_root, *SMALL, "mask=predicted")
    grid = build_grid(cfg.bev)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.mask, grid)
    twin_cfg = _cfg(tmp_path, tiny_root, *SMALL, "mask=road_map")
    masks = []  # the mask each forward computed on (training: the union with the object mask)
    model.register_forward_hook(lambda module, args, out: masks.append(out.mask))
    for b in (1, 3):
        batch = _batch(cfg, grid, b, None)
        measured = _measure(model, batch, train)
        mask = masks[-1].clone()  # the measured forward's
        assert 0 <= float(mask.mean()) < 1
        est = estimate(model, b, 1.0, train, mask=mask)
        torch.manual_seed(0)
        twin = build_model(twin_cfg.model, twin_cfg.mask, grid)
        twin_measured = _measure(twin, dataclasses.replace(batch, mask=mask), train)
        added, est_added = measured - twin_measured, (est.peak - estimate(twin, b, 1.0, train, mask=mask).peak) / MB
        assert est.per_stage["mask_net"] > 0 and added > 0
        assert abs(est_added - added) <= 0.10 * added, (b, est_added, added)


def test_stage_shares_count_the_mask_blocks(tmp_path, tiny_root):
    cfg, grid, model = _setup(tmp_path, tiny_root, False)
    n = len(model.backbone.stages) + len(model.neck.smooth) + 1
    ones = torch.ones(2, 1, grid.H, grid.W)
    assert stage_shares(model, ones) == [1.0] * n
    assert stage_shares(model, torch.zeros(2, 1, grid.H, grid.W)) == [0.0] * n
    # a sparser mask never needs more blocks, and the estimate grows with them
    half = _batch(cfg, grid, 2, 0.3).mask
    s = stage_shares(model, half)
    assert 0.0 < s[0] < 1.0 and all(0.0 < x <= 1.0 for x in s)  # deeper tiles cover more: up to all active
    assert estimate(model, 2, s, True).peak < estimate(model, 2, 1.0, True).peak


def test_estimate_command_names_the_largest_batch_that_fits():
    cmd = [sys.executable, str(REPO / "scripts" / "estimate_memory.py"), "bev=kitti", "batches=1,64",
           "sparsity=0.7", "available_mb=3000"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 1, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("batch 64 does not fit") and "the largest batch that fits is" in last
    best = int(last.rsplit(" ", 1)[1])
    rows = {(int(p[0]), p[1]): float(p[2]) for p in (line.split() for line in r.stdout.splitlines()) if
            len(p) == 8 and p[0].isdigit()}
    assert rows[(1, "train")] <= 2700 < rows[(64, "train")] and best >= 1
    bad = subprocess.run([*cmd[:2], "sparsity=lots"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and bad.stderr.startswith("error:")




@pytest.mark.parametrize(("arg", "words"), [
    ("batches=a", ("batches='a'", "not an integer")),
    ("batches=1,2.5", ("batches='1,2.5'", "'2.5' is not an integer")),
    ("batches=0,4", ("batches='0,4'", ">= 1")),
    ("batches=-2", ("batches='-2'", ">= 1")),
    ("sparsity=lots", ("sparsity='lots'", "not a number")),
    ("sparsity=1.5", ("sparsity='1.5'", "[0, 1]")),
    ("sparsity=0.5,-0.1", ("sparsity='0.5,-0.1'", "[0, 1]")),
    ("sparsity=nan", ("sparsity='nan'", "[0, 1]")),
    ("margin=1", ("margin='1'", "[0, 1)")),
    ("margin=-0.1", ("margin='-0.1'", "[0, 1)")),
    ("margin=x", ("margin='x'", "not a number")),
    ("available_mb=0", ("available_mb='0'", "> 0")),
    ("available_mb=lots", ("available_mb='lots'", "not a number")),
])
def test_estimate_command_refuses_a_bad_value_in_one_line_naming_the_key(arg, words, capsys):
    assert estimate_memory.main([arg]) == 1
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {arg.split('=')[0]}="), out.err
    assert all(w in lines[0] for w in words), lines[0]
    assert out.out == ""  # refused before the model is built or a row printed


def test_estimate_command_accepts_the_edges_of_each_range():
    parse = estimate_memory.parse_own
    own = {"batches": "1, 16", "sparsity": "0,1", "available_mb": "auto", "margin": "0"}
    assert parse(own) == ([1, 16], [1.0, 0.0], None, 0.0)
    assert parse({**own, "sparsity": "dense", "available_mb": "512", "margin": "0.99"}) == ([1, 16], None, 512.0,
                                                                                           0.99)
    assert parse({**own, "sparsity": "0.7"})[1] == pytest.approx(0.3)  # one number: the active share everywhere


def test_bench_memory_render_only_rewrites_the_markdown_from_the_json(tmp_path, capsys):
    meta = {"cpu": "Some CPU", "torch": "2.x", "threads": 2, "allocator": {},
            "commands": ["python scripts/bench_memory.py"], "notes": ["a note edited by hand"]}
    rows = [{"bev": "small", "batch": 1, "sparsity": "0.5", "mode": "train", "estimate_mb": 10.0, "measured_mb": 11.0,
             "error_pct": -9.1},
            {"bev": "kitti", "batch": 16, "sparsity": "dense", "mode": "train", "estimate_mb": 9000.0,
             "measured_mb": None, "note": "not measured: estimate above limit_mb=3500.0"}]
    out = tmp_path / "memory"
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}))
    before = out.with_suffix(".json").read_text()
    bench_memory.main([f"out={out}", "render_only=true"])
    md = out.with_suffix(".md").read_text()
    assert out.with_suffix(".json").read_text() == before  # nothing measured, the JSON untouched
    assert "a note edited by hand" in md and "- `python scripts/bench_memory.py`" in md
    # a row measured before the mask tile and checkpoint were recorded: 16-px tiles, no checkpointed stage
    assert "| small | 1 | 0.5 | 16 | - | - | train | 10.0 | 11.0 | -9.1 |" in md
    assert "| kitti | 16 | dense | - | - | - | train | 9000.0 | - | not measured" in md
    assert "1 measured rows; |error| <= 10 % in 1" in md
    # what sparsity means in this table, and that estimate_memory's is another thing
    assert "sparsity = share of the mask's random tiles" in md
    assert "deeper stages' shares are those of the same mask's real blocks" in md
    assert "estimate_memory.py's sparsity=, the inactive share at every stage" in md
    with pytest.raises(SystemExit, match="error: render_only=true: .*does not exist"):
        bench_memory.main([f"out={tmp_path / 'none'}", "render_only=true"])


def test_bench_memory_merge_keeps_the_rows_and_machines_of_earlier_runs(tmp_path, tiny_root):
    """merge=true: rows this run does not redo are kept, and a table measured on two machines says both (a
    merge once replaced the earlier runs' CPU with the last run's)."""
    old_row = {"bev": "kitti", "batch": 16, "sparsity": "dense", "mode": "train", "estimate_mb": 9000.0,
               "measured_mb": 8990.0, "error_pct": 0.1}
    meta = {"cpu": "An Older CPU (runs 1-2)", "torch": "0.0-old", "threads": 2, "allocator": {},
            "commands": ["python scripts/bench_memory.py a", "python scripts/bench_memory.py b"], "notes": []}
    out = tmp_path / "memory"
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": [old_row]}))
    bench_memory.main([f"out={out}", f"root={tiny_root}", "bevs=small", "batches=1",
                                         "sparsities=dense", "modes=infer", "merge=true"])
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["rows"][0] == old_row and len(res["rows"]) == 2 and res["rows"][1]["mode"] == "infer"
    from detector.machine import cpu_model

    assert res["meta"]["cpu"] == f"An Older CPU (runs 1-2); {cpu_model()} (run 3 on)"
    assert res["meta"]["torch"] == f"0.0-old; {torch.__version__} (run 3 on)"
    assert len(res["meta"]["commands"]) == 3


def test_batch_size_auto_takes_the_stated_budget(tmp_path, tiny_root, capsys):
    """data.memory_budget_mb: the largest batch whose estimate fits that budget (on any device), confirmed by a
    real step whose measured peak fits it too; a budget below batch 2's estimate gives 1."""
    from detector.batch_size import find_batch_size, probe_shares

    cfg, grid, model = _setup(tmp_path, tiny_root, False)
    make_dm = lambda n: build_datamodule(cfg.data, cfg.mask, grid, True, n)  # noqa: E731
    shares = probe_shares(model, make_dm)
    est = [estimate(model, b, shares, train=True).peak / MB for b in (1, 2, 3)]
    budget = (est[1] + est[2]) / 2  # batch 2 fits by the estimate, batch 3 does not
    b = find_batch_size(make_dm, model, budget_mb=budget)
    line = capsys.readouterr().out
    assert f"data.memory_budget_mb={budget:g}" in line
    measured = float(line.split("measured ")[-1].split(" MB")[0])
    assert b in (1, 2) and measured <= budget, line  # 1 only if the real step needed more than the budget
    assert find_batch_size(make_dm, model, budget_mb=(est[0] + est[1]) / 2) == 1


def test_batch_size_auto_prices_the_mask_the_model_computes(tmp_path, tiny_root):
    """mask=predicted: the data carries no mask, the model makes it - the estimate takes that mask's blocks (at the
    first step the warm-up's union with the boxes), not a dense network's."""
    from detector.batch_size import probe_shares

    cfg = _cfg(tmp_path, tiny_root, *SMALL, "mask=predicted")
    grid = build_grid(cfg.bev)
    model = build_model(cfg.model, cfg.mask, grid)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shares = probe_shares(model, lambda n: build_datamodule(cfg.data, cfg.mask, grid, True, n))
    assert shares is not None and 0 < shares[0] < 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    dense_cfg = _cfg(tmp_path, tiny_root, *SMALL, "model=dense", "mask=none")
    dense = build_model(dense_cfg.model, dense_cfg.mask, grid)
    assert probe_shares(dense, lambda n: build_datamodule(dense_cfg.data, dense_cfg.mask, grid, False, n)) is None
