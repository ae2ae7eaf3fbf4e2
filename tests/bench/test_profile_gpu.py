"""scripts/profile_gpu.py (run by `make gpu-check` on a GPU) runs on the CPU too: its table and plans."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import REPO


@pytest.mark.slow  # over a minute on a 2-core CPU: make test-all (CI stays under 15 minutes)
def test_profile_script_runs_on_the_cpu_and_writes_its_table(tmp_path):
    out = tmp_path / "profile.md"
    res = subprocess.run([sys.executable, "scripts/profile_gpu.py", "device=cpu", "reps=1", f"out={out}"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    for row in ("kitti dense (no mask)", "kitti sparse block_size=16", "kitti sparse block_size=auto",
                "train dense (no mask)", "train sparse block_size=auto"):
        assert f"| {row} |" in text
    assert "stem:" in text  # the plan of the auto rows is printed
    assert "Top operators by self host time" in text
