"""scripts/bench_model.py on a tiny dataset with a trained checkpoint (its own mask network and plan)."""

from __future__ import annotations

import json

from detector.bench import model as bench
from detector.tasks import train
from tests.test_train import _cfg


def test_bench_model_times_a_checkpoint_with_its_bound_and_stage_times(tmp_path, tiny_root):
    ckpt = train(_cfg(tmp_path / "run", tiny_root, "mask=predicted", "model.block_size=auto",
                      "model.head_block_size=auto", "trainer.max_steps=2", "callbacks.model_checkpoint.monitor=null",
                      "evaluate_after=false", "logger=none", "trainer.limit_val_batches=0"))["best_ckpt"]
    out = tmp_path / "bench" / "model.json"
    assert bench.main([f"ckpt_path={ckpt}", f"root={tiny_root}", "masks=none,predicted", "batches=1", "frames=2",
                           "reps=1", f"out={out}"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mask"] for r in rows] == ["none", "predicted"]
    dense, sparse = rows
    assert dense["mac_ratio"] == dense["mac_bound"] == 1.0  # no mask, no plan: every MAC is run
    assert 0 <= sparse["mac_bound"] <= sparse["mac_ratio"] <= 1.0  # the bound is the fewest MACs per stage
    stages = ["stem", "stage1", "stage2", "stage3", "stage4"]
    for r in rows:
        assert list(r["stage_ms"]) == stages and all(v > 0 for v in r["stage_ms"].values())
    assert "MAC bound" in out.with_suffix(".md").read_text()
