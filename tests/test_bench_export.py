"""scripts/bench_export.py's graph-break record (torch._dynamo.explain: traced, not compiled) and its line in the
markdown, on tiny modules (the benchmark itself is not run here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _bench_export():
    spec = importlib.util.spec_from_file_location("bench_export", REPO / "scripts" / "bench_export.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Breaking(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(2, 2, 3, padding=1), torch.nn.Conv2d(2, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y)


def test_graph_break_record_counts_the_breaks_and_the_markdown_states_them(tmp_path):
    mod = _bench_export()
    x = torch.rand(1, 2, 8, 8)
    whole = mod.graph_break_record(torch.nn.Conv2d(2, 1, 3), x)
    assert (whole["graphs"], whole["graph_breaks"], whole["reasons"]) == (1, 0, [])
    broken = mod.graph_break_record(_Breaking(), x)
    assert (broken["graphs"], broken["graph_breaks"]) == (2, 1) and len(broken["reasons"]) == 1

    def fails(_x):
        raise RuntimeError("boom")

    assert mod.graph_break_record(fails, x)["error"].startswith("RuntimeError: boom")
    meta = {"cpu": "CPU", "threads": 1, "torch": "2.x", "allocator": {}, "frames": 1, "reps": 1, "block_size": "16",
            "loadavg_start": (0.0, 0.0, 0.0), "graph_breaks": {"small": whole, "kitti": broken}}
    row = {"bev": "small", "variant": "sparse", "backend": "eager", "ms_per_frame": 1.0,
           "max_abs_diff_vs_eager": 0.0, "prepare_s": 0.1}
    mod.write(tmp_path / "export", meta, [row])
    md = (tmp_path / "export.md").read_text()
    assert "graph breaks of the sparse network" in md and "small 0 (1 graph); kitti 1 (2 graphs): " in md
    assert json.loads((tmp_path / "export.json").read_text())["meta"]["graph_breaks"]["kitti"]["graph_breaks"] == 1
