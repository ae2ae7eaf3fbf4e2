"""scripts/bench_train.py on a tiny dataset: both runs side by side, the table and the plan summary."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.test_plan import COST_OVERRIDE
from tests.test_train import REPO, TINY


def _script():
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "scripts" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_train_side_by_side_writes_both_runs(tmp_path, tiny_root):
    extra = [o for o in TINY if not o.startswith(("model.block_size", "model.head_block_size"))]
    extra += ["model.block_size=auto", "model.head_block_size=auto", COST_OVERRIDE, "trainer.max_steps=2",
              "logger=none", "trainer.limit_val_batches=0", "callbacks.model_checkpoint.monitor=null"]
    out = tmp_path / "train.json"
    assert _script().main([f"root={tiny_root}", f"out={out}", "side_by_side=true", f"runs_dir={tmp_path / 'runs'}",
                           "steps=2", "extra=" + " ".join(extra)]) == 0
    res = json.loads(out.read_text())
    assert set(res["wall_s"]) == {"sparse", "dense"} and res["side_by_side"] and res["threads"] >= 1
    assert all(res["wall_s"][n] >= res["fit_s"][n] > 0 for n in ("sparse", "dense"))
    assert res["plan"]["dense"] is None  # the dense twin has no mask, no plan
    p = res["plan"]["sparse"]
    assert p["steps"] == 2 and 0 <= p["mac_bound"] <= p["mac_ratio"] <= 1
    for n in ("sparse", "dense"):
        assert (tmp_path / "runs").glob(f"{n}_*/train.log") and res[n]["Car"]["bev"]["R40"]["moderate"] >= 0
    md = out.with_suffix(".md").read_text()
    assert "side by side" in md and "sparse / dense: wall" in md and "bound" in md
    # where a step's time goes: every part of the step measured for both, the plan for the sparse run only
    steps = res["steps_ms"]
    assert res["steps_meta"]["steps"] == 2 and set(steps) == {"sparse", "dense"}
    for n in ("sparse", "dense"):
        s = steps[n]
        assert all(s[k] > 0 for k in ("load", "voxelize", "forward", "backward", "optimizer", "step", "backbone/stem"))
        assert s["step"] >= s["forward"] and s["step"] >= s["backward"]
    assert "plan" in steps["sparse"] and "plan" not in steps["dense"]
    assert "| part (median ms / step) | sparse | dense | sparse / dense |" in md and "| backward |" in md


def test_step_breakdown_from_an_earlier_result(tmp_path, tiny_root):
    """from_json=: the breakdown for the runs and checkpoints an earlier result records, no training; a result
    whose checkpoint is gone is refused in one line naming the run."""
    extra = [o for o in TINY if not o.startswith(("model.block_size", "model.head_block_size"))]
    extra += ["model.block_size=16", "model.head_block_size=16", "trainer.max_steps=1", "logger=none",
              "trainer.limit_val_batches=0", "callbacks.model_checkpoint.monitor=null"]
    first = tmp_path / "first.json"
    mod = _script()
    assert mod.main([f"root={tiny_root}", f"out={first}", "runs=dense", f"runs_dir={tmp_path / 'runs'}", "steps=0",
                     "extra=" + " ".join(extra)]) == 0
    assert "steps_ms" not in json.loads(first.read_text())
    again = tmp_path / "again.json"
    assert mod.main([f"root={tiny_root}", f"out={again}", f"from_json={first}", "steps=1"]) == 0
    res = json.loads(again.read_text())
    assert res["wall_s"] == json.loads(first.read_text())["wall_s"] and res["steps_ms"]["dense"]["step"] > 0
    gone = json.loads(first.read_text())
    gone["runs"]["dense"]["best_ckpt"] = str(tmp_path / "nowhere.ckpt")
    first.write_text(json.dumps(gone))
    with pytest.raises(SystemExit, match="run 'dense' is gone"):
        mod.main([f"root={tiny_root}", f"out={again}", f"from_json={first}"])


def test_side_by_side_wall_time_is_each_runs_own(tmp_path, monkeypatch):
    """The run started first but ending last must not lend its end time to the others (it did: all equal)."""
    import time

    mod = _script()
    durations = {"sparse": 2.0, "dense": 0.1}
    ap = {"easy": 1.0, "moderate": 1.0, "hard": 1.0}
    METRICS = {"Car": {m: {"R40": ap} for m in ("bev", "3d", "2d", "aos")}}

    class FakeRun:  # a training run that takes its duration and writes run.json like scripts/train.py
        def __init__(self, cmd, **kw):
            self.out = next(a.split("=", 1)[1] for a in cmd if a.startswith("paths.output_dir="))
            self.end = time.time() + durations["dense" if "model=dense" in cmd else "sparse"]

        def poll(self):
            if time.time() < self.end:
                return None
            run = {"metrics": METRICS, "fit_s": 0.3, "best_ckpt": ""}
            (mod.Path(self.out) / "run.json").write_text(json.dumps(run))
            return 0

        def wait(self):
            while self.poll() is None:
                time.sleep(0.01)
            return 0

    monkeypatch.setattr(mod.subprocess, "Popen", FakeRun)
    out = tmp_path / "train.json"
    assert mod.main(["root=x", f"out={out}", "side_by_side=true", f"runs_dir={tmp_path / 'runs'}", "steps=0"]) == 0
    wall = json.loads(out.read_text())["wall_s"]
    assert wall["dense"] < 1.0 < 2.0 <= wall["sparse"]


def test_logged_step_ms_reads_the_runs_own_log(tmp_path):
    """Hand-built log: train/loss every 10 steps; the first 10 intervals 1 s apart (100 ms per step), the next 30
    2 s apart (200 ms per step), and one of them holds a 30-s validation. Rule: per-step ms of each interval,
    median over all and over each quarter (10 intervals each); the validation interval is one of the 40."""
    from torch.utils.tensorboard import SummaryWriter

    log = tmp_path / "tensorboard"
    w = SummaryWriter(str(log))
    t = 1000.0
    w.add_scalar("train/loss", 1.0, 0, walltime=t)
    for i in range(40):
        t += 1.0 if i < 10 else 2.0
        if i == 25:
            t += 30.0  # a validation inside this interval
        w.add_scalar("train/loss", 1.0, 10 * (i + 1), walltime=t)
        w.add_scalar("train/other", 0.0, 10 * (i + 1), walltime=t + 0.5)  # other tags do not count
    w.close()
    got = _script().logged_step_ms(log)
    assert got == {"median": 200.0, "quarters": [100.0, 200.0, 200.0, 200.0]}
    assert _script().logged_step_ms(tmp_path / "none") is None  # logger=none: no log
