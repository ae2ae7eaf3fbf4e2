"""detector/bench/gpu_units.py (make gpu-check's rows of the sync-free path): its plumbing on tiny CPU shapes."""

from __future__ import annotations

import json

import pytest

from detector.bench import gpu_units


@pytest.mark.slow  # ~40 s on a busy 2-core machine
def test_cpu_smoke(tmp_path):
    out, md = tmp_path / "u.json", tmp_path / "u.md"
    assert gpu_units.main(["device=cpu", "dtype=float32", "batch=1", "sparsity=0.9",
                           "what=units,backbone,train,profile", "reps=1", f"out={out}", f"md={md}"]) == 0
    rows = json.loads(out.read_text())
    assert {r["bench"] for r in rows} == {"units", "backbone", "train_step", "profile"}
    unit = next(r for r in rows if r["bench"] == "units")
    assert unit["capacity"] >= unit["active_blocks"] and unit["halo_bound_x"] > 1
    assert unit["fwd_bwd_sparse_capacity_ms"] > 0
    step = next(r for r in rows if r["bench"] == "train_step")
    assert step["sparse_capacity_ms"] > 0 and step["sparse_eager_ms"] > 0 and step["dense_ms"] > 0
    assert "## units" in md.read_text()
