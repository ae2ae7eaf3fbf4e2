"""scripts/bench_loader.py on the tiny simulated dataset."""

from __future__ import annotations

import json

from detector.bench import loader as bench


def test_loader_benchmark_times_both_datasets_and_fills_the_cache(tmp_path, tiny_root):
    out = tmp_path / "bench" / "loader.json"
    assert bench.main([f"root={tiny_root}", "epochs=2", "frames=3", "cache_mb=64", f"out={out}",
                           "extra=bev.x_range=[0,25.6] bev.y_range=[-12.8,12.8]"]) == 0
    r = json.loads(out.read_text())
    assert r["frames"] == 3 and r["epochs"] == 2
    assert set(r["ms_per_frame"]) == {"cache_mb=0", "cache_mb=64"}
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in r["ms_per_frame"].values())
    assert r["cache"]["frames"] == 3 and r["cache"]["mib"] > 0
    md = out.with_suffix(".md").read_text()
    assert "cache_mb=64 (ms / frame)" in md and "| 1 |" in md
