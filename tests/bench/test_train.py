"""scripts/bench_train.py on a tiny dataset: both runs side by side, the table and the plan summary."""

from __future__ import annotations

import json

import pytest

from detector.bench import train as bench
from tests.nn.test_plan import COST_OVERRIDE
from tests.test_train import TINY


@pytest.mark.slow  # over a minute on a 2-core CPU: make test-all (CI stays under 15 minutes)
def test_bench_train_side_by_side_writes_both_runs(tmp_path, tiny_root):
    extra = [o for o in TINY if not o.startswith(("model.block_size", "model.head_block_size"))]
    extra += ["model.block_size=auto", "model.head_block_size=auto", COST_OVERRIDE, "trainer.max_steps=2",
              "logger=none", "trainer.limit_val_batches=0", "callbacks.model_checkpoint.monitor=null"]
    out = tmp_path / "train.json"
    assert bench.main([f"root={tiny_root}", f"out={out}", "side_by_side=true", f"runs_dir={tmp_path / 'runs'}",
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
    mod = bench
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

    mod = bench
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
    got = bench.logged_step_ms(log)
    assert got == {"median": 200.0, "quarters": [100.0, 200.0, 200.0, 200.0]}
    assert bench.logged_step_ms(tmp_path / "none") is None  # logger=none: no log


def test_seeds_run_every_model_per_seed_against_its_own_dense_twin(tmp_path, monkeypatch):
    """seeds=3,7: each run once per seed (its command ends with seed=K), one after the other in the order
    sparse, dense, dense, sparse (a drift meets both alike); each seed's run is compared with that seed's dense
    twin, and the summary's means are the plain means over the seeds. Hand-set durations and APs: seed 3 sparse
    0.2 s / dense 0.4 s, seed 7 sparse 0.3 s / dense 0.3 s -> ratios about 0.5 and 1.0, mean about 0.75; BEV
    moderate 90 / 94 (sparse), 95 / 93 (dense) -> means 92 and 94."""
    import time

    mod = bench
    plan = {("sparse", "3"): (0.2, 90.0), ("dense", "3"): (0.4, 95.0), ("sparse", "7"): (0.3, 94.0),
            ("dense", "7"): (0.3, 93.0)}
    order = []

    class FakeRun:
        def __init__(self, cmd, **kw):
            self.out = next(a.split("=", 1)[1] for a in cmd if a.startswith("paths.output_dir="))
            key = ("dense" if "model=dense" in cmd else "sparse", cmd[-1].removeprefix("seed="))
            assert cmd[-1].startswith("seed=")
            order.append(key)
            self.duration, ap = plan[key]
            metric = {"R40": {"easy": ap, "moderate": ap, "hard": ap}}
            self.metrics = {"Car": {m: metric for m in ("bev", "3d", "2d", "aos")}}

        def wait(self):
            time.sleep(self.duration)
            (mod.Path(self.out) / "run.json").write_text(
                json.dumps({"metrics": self.metrics, "fit_s": self.duration, "best_ckpt": ""}))
            return 0

    def popen(cmd, **kw):
        mod.Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("paths.output_dir="))).mkdir(parents=True)
        return FakeRun(cmd, **kw)

    monkeypatch.setattr(mod.subprocess, "Popen", popen)
    out = tmp_path / "train.json"
    assert mod.main(["root=x", f"out={out}", "seeds=3,7", f"runs_dir={tmp_path / 'runs'}", "steps=0"]) == 0
    assert order == [("sparse", "3"), ("dense", "3"), ("dense", "7"), ("sparse", "7")]
    res = json.loads(out.read_text())
    assert set(res["wall_s"]) == {"sparse@3", "dense@3", "sparse@7", "dense@7"} and res["seeds"] == [3, 7]
    s = res["summary"]["sparse"]
    assert s["bev_moderate"] == [90.0, 94.0] and s["bev_moderate_mean"] == pytest.approx(92.0)
    assert s["wall_vs_dense"][0] == pytest.approx(0.5, abs=0.1) and s["wall_vs_dense"][1] == pytest.approx(1.0, abs=0.2)
    assert s["wall_vs_dense_mean"] == pytest.approx((s["wall_vs_dense"][0] + s["wall_vs_dense"][1]) / 2)
    assert res["summary"]["dense"]["bev_moderate_mean"] == pytest.approx(94.0)
    md = out.with_suffix(".md").read_text()
    assert "sparse@3 / dense@3: wall" in md and "| sparse | 90.00 (" in md and "| 92.00 (" in md
    with pytest.raises(SystemExit, match="listed twice"):
        mod.main(["root=x", f"out={out}", "seeds=3,3"])
    with pytest.raises(SystemExit, match="integers"):
        mod.main(["root=x", f"out={out}", "seeds=a"])
