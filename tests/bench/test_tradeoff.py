"""scripts/bench_tradeoff.py on a tiny dataset and a tiny checkpoint with a mask network."""

from __future__ import annotations

import json
from pathlib import Path

from detector.bench import tradeoff as bench
from detector.tasks import train
from tests.test_train import _cfg


def test_tradeoff_curve_on_a_tiny_checkpoint(tmp_path, tiny_root):
    ckpt = train(_cfg(tmp_path / "run", tiny_root, "mask=predicted", "trainer.max_steps=2",
                      "callbacks.model_checkpoint.monitor=null", "evaluate_after=false", "logger=none",
                      "trainer.limit_val_batches=0"))["best_ckpt"]
    out = tmp_path / "bench" / "tradeoff.json"
    # threshold 0.999: an untrained mask net predicts nothing that sure -> an empty mask, still reported
    assert bench.main([f"ckpt_path={ckpt}", f"root={tiny_root}", "thresholds=0.01,0.999", "dilations=0,1",
                           f"out={out}", f"tb={tmp_path / 'tb'}"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["dense", "t0.01/d0", "t0.01/d1", "t0.999/d0", "t0.999/d1"]
    for r in rows:
        assert 0 <= r["ap_bev_moderate"] <= 100 and r["ms_per_frame"] > 0 and r["speedup_vs_dense"] > 0
    for r in rows[1:]:
        assert set(r["tiles"]) == {"1", "2", "4", "8", "16"} and 0 <= r["mask_recall"] <= 1
    assert rows[1]["tiles"]["16"] >= rows[3]["tiles"]["16"]  # a lower threshold keeps at least as many tiles
    assert rows[1]["tiles"]["1"] <= rows[2]["tiles"]["1"]  # dilation only adds cells
    empty = rows[3]
    assert empty["tiles"] == {k: 0.0 for k in empty["tiles"]} and empty["mask_recall"] == 0.0
    for suffix in (".md", ".png"):
        assert out.with_suffix(suffix).stat().st_size > 0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert all(r["dense_ms_per_frame"] > 0 for r in rows[1:])
    assert "t0.999/d0" in out.with_suffix(".md").read_text()


def test_tradeoff_refuses_a_missing_checkpoint(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="no such checkpoint"):
        bench.main([f"ckpt_path={tmp_path / 'none.ckpt'}"])
    assert not Path(tmp_path / "none.ckpt").exists()
