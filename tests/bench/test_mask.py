"""scripts/bench_mask.py on a tiny dataset: variants parsed, trained, measured per threshold, written."""

from __future__ import annotations

import json

import pytest

from detector.bench import mask as bench
from tests.nn.test_plan import COST_OVERRIDE
from tests.test_train import TINY


def test_mask_screen_on_a_tiny_dataset(tmp_path, tiny_root):
    out = tmp_path / "screen.json"
    # the tiny grid and model; the plan (block_size=auto, the config's) on constant costs, not this machine's timing
    extra = " ".join([*(o for o in TINY if not o.startswith(("trainer.", "callbacks.", "model.block_size",
                                                             "model.head_block_size"))), COST_OVERRIDE])
    # threshold 0.999: nothing that sure after 2 steps -> an empty mask, still reported (no MACs, no recall)
    assert bench.main(["variants=c2,c3w8m0.5", "thresholds=0.3,0.999", "steps=2", "batches=1",
                        f"root={tiny_root}", f"out={out}", f"extra={extra}"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["threshold"]) for r in rows] == [("c2", 0.3), ("c2", 0.999), ("c3w8m0.5", 0.3),
                                                              ("c3w8m0.5", 0.999)]
    assert (rows[0]["num_convs"], rows[2]["num_convs"], rows[2]["channels"], rows[2]["margin"]) == (2, 3, 8, 0.5)
    for r in rows:
        assert r["ms_fwd_bwd"] > 0
        for split in ("train", "val"):
            assert 0 <= r[split]["macs"] <= 1 and 0 <= r[split]["recall"] <= 1 and 0 <= r[split]["covered"] <= 1
    for lo, hi in ((rows[0], rows[1]), (rows[2], rows[3])):  # a higher threshold keeps no more cells
        for split in ("train", "val"):
            assert hi[split]["macs"] <= lo[split]["macs"] and hi[split]["recall"] <= lo[split]["recall"]
    assert out.with_suffix(".md").read_text().count("| c3w8m0.5 |") == 2


def test_mask_screen_names_a_bad_variant(tmp_path):
    with pytest.raises(SystemExit, match="variants: 'x5'"):
        bench.main(["variants=x5", f"out={tmp_path / 's.json'}"])


def test_mask_screen_at_fixed_tiles(tmp_path, tiny_root):
    """Fixed tiles (no 'auto' stage) are priced too: the plan is the configured tiles' (it used to stop on a missing
    plan); a lower threshold's mask never convolves less, and a mask of (nearly) everything on fixed 8-px tiles
    convolves more than the dense run - their halos - where the plan would have run it dense."""
    out = tmp_path / "screen.json"
    extra = " ".join([*(o for o in TINY if not o.startswith(("trainer.", "callbacks.", "model.block_size",
                                                             "model.head_block_size"))), COST_OVERRIDE,
                      "model.block_size=8", "model.head_block_size=8"])
    assert bench.main(["variants=c2", "thresholds=0.0001,0.999", "steps=2", "batches=1", f"root={tiny_root}",
                       f"out={out}", f"extra={extra}"]) == 0
    rows = json.loads(out.read_text())["rows"]
    for split in ("train", "val"):
        assert rows[0][split]["macs"] > 1 and rows[1][split]["macs"] <= rows[0][split]["macs"]
