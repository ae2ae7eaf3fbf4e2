"""detector/bench/export.py's (scripts/bench_export.py) graph-break record (torch._dynamo.explain: traced, not
compiled) and its line in the markdown, on tiny modules (the benchmark itself is not run here)."""

from __future__ import annotations

import json

import torch

from detector.bench import export as bench_export


class _Breaking(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(2, 2, 3, padding=1), torch.nn.Conv2d(2, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y)


def test_graph_break_record_counts_the_breaks_and_the_markdown_states_them(tmp_path):
    x = torch.rand(1, 2, 8, 8)
    whole = bench_export.graph_break_record(torch.nn.Conv2d(2, 1, 3), x)
    assert (whole["graphs"], whole["graph_breaks"], whole["reasons"]) == (1, 0, [])
    broken = bench_export.graph_break_record(_Breaking(), x)
    assert (broken["graphs"], broken["graph_breaks"]) == (2, 1) and len(broken["reasons"]) == 1

    def fails(_x):
        raise RuntimeError("boom")

    assert bench_export.graph_break_record(fails, x)["error"].startswith("RuntimeError: boom")
    meta = {"cpu": "CPU", "threads": 1, "torch": "2.x", "allocator": {}, "frames": 1, "reps": 1, "block_size": "16",
            "loadavg_start": (0.0, 0.0, 0.0), "graph_breaks": {"small": whole, "kitti": broken}}
    row = {"bev": "small", "variant": "sparse", "backend": "eager", "ms_per_frame": 1.0,
           "max_abs_diff_vs_eager": 0.0, "prepare_s": 0.1}
    bench_export.write(tmp_path / "export", meta, [row])
    md = (tmp_path / "export.md").read_text()
    assert "graph breaks of the sparse network" in md and "small 0 (1 graph); kitti 1 (2 graphs): " in md
    assert json.loads((tmp_path / "export.json").read_text())["meta"]["graph_breaks"]["kitti"]["graph_breaks"] == 1
