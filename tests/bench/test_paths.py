"""scripts/bench_paths.py: one checkpoint timed on both sparse paths, training step and inference, taking turns."""

from __future__ import annotations

import json

from detector.bench import paths as bench
from detector.tasks import train
from tests.test_train import _cfg


def test_both_paths_timed_in_training_and_inference(tmp_path, tiny_root):
    run = train(_cfg(tmp_path / "run", tiny_root, "trainer.max_steps=1", "callbacks.model_checkpoint.monitor=null",
                     "evaluate_after=false", "logger=none", "model.block_size=8", "model.head_block_size=8"))
    out = tmp_path / "paths.json"
    assert bench.main([f"ckpt_path={run['best_ckpt']}", f"root={tiny_root}", "steps=2", f"out={out}"]) == 0
    res = json.loads(out.read_text())
    for mode in ("train_ms", "inference_ms"):
        exact, capacity = res[mode]["exact"], res[mode]["capacity"]
        assert "backbone" in exact and "network" not in exact  # each model ran its own path
        assert "network" in capacity and "backbone" not in capacity
        assert exact["step"] > 0 and capacity["step"] > 0
    assert "backward" in res["train_ms"]["capacity"] and "backward" not in res["inference_ms"]["capacity"]
    assert res["capacity_over_exact"]["train_step"] == round(
        res["train_ms"]["capacity"]["step"] / res["train_ms"]["exact"]["step"], 3)
    md = out.with_suffix(".md").read_text()
    assert "| part (median ms) | exact | capacity | capacity / exact |" in md and res["meta"]["steps"] == 2
