"""The CPU-side preparation of `make gpu-check` (scripts/gpu_check.py): dry run, step runner, outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from detector.bench import gpu_check
from tests.paths import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_dry_run_checks_the_preparation_and_prints_the_plan(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "hydra_core-1.3.8-py3-none-any.whl").write_bytes(b"")
    res = _dry_run(f"wheels={wheels}", f"out={tmp_path / 'out'}", "budget=300")
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout
    assert "plan (budget 300 s" in text and "nothing run (--dry-run)" in text
    assert f"--target {REPO / 'build' / 'gpu_check' / 'site'} {wheels / 'hydra_core-1.3.8-py3-none-any.whl'}" in text
    assert "_library.build(with_cuda=True" in text
    assert f"-m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors " \
           f"--junitxml={tmp_path / 'out' / 'pytest_gpu.xml'} tests" in text
    for dtype in ("float32", "bfloat16"):
        assert f"scripts/bench_sparse.py device=cuda dtype={dtype}" in text
    assert "scripts/bench_model.py device=cuda dtype=float32" in text
    assert f"scripts/profile_gpu.py device=cuda out={tmp_path / 'out' / 'profile_gpu.md'}" in text
    assert "masks=none,predicted" in text  # the road_map and ground masks need open3d
    assert (tmp_path / "out").is_dir()


def test_dry_run_fails_on_a_wheels_folder_without_wheels(tmp_path):
    res = _dry_run(f"wheels={tmp_path}", f"out={tmp_path / 'out'}")
    assert res.returncode == 2 and f"error: wheels={tmp_path}: holds no *.whl" in res.stdout
    res = _dry_run(f"wheels={tmp_path / 'missing'}", f"out={tmp_path / 'out'}")
    assert res.returncode == 2 and "not a readable folder" in res.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "wheel=x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unexpected argument 'wheel=x'" in bad.stderr


def test_script_keys_reads_the_bench_arguments():
    keys = gpu_check.script_keys(REPO / "detector" / "bench" / "sparse.py")
    assert {"out", "md", "sparsity", "quick"} <= keys
    assert {"out", "root", "masks"} <= gpu_check.script_keys(REPO / "detector" / "bench" / "model.py")


def test_run_step_passes_fails_and_kills_a_timed_out_group(tmp_path):
    py = sys.executable
    with open(tmp_path / "log", "wb") as log:
        ok = gpu_check.run_step({"name": "ok", "cmd": [py, "-c", "print('hello')"]}, None, 30, log)
        bad = gpu_check.run_step({"name": "bad", "cmd": [py, "-c", "raise SystemExit(3)"]}, None, 30, log)
        t0 = time.monotonic()
        # the child's own child sleeps too: the whole process group must go
        slow = gpu_check.run_step({"name": "slow", "cmd": [
            py, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
        ]}, None, 1, log)
        elapsed = time.monotonic() - t0
    assert ok["status"] == "passed" and "hello" in ok["tail"] and ok["rc"] == 0
    assert bad["status"] == "failed" and bad["rc"] == 3
    assert slow["status"] == "timed_out" and elapsed < 20
    assert (tmp_path / "log").read_text().count("=====") == 3


def test_merge_benches_tags_rows_with_device_and_dtype(tmp_path):
    steps, results = [], []
    for dtype in ("float32", "bfloat16"):
        js = tmp_path / f"sparse_gpu_{dtype}.json"
        js.write_text(json.dumps([{"layer": "conv3x3", "speedup": 2.0}]))
        js.with_suffix(".md").write_text(f"| table {dtype} |\n")
        # as the real step: out= is not the last argument (md= follows it)
        steps.append({"name": f"bench_sparse[{dtype}]", "bench": "sparse", "dtype": dtype,
                      "cmd": ["x", f"out={js}", f"md={js.with_suffix('.md')}"]})
        results.append({"status": "passed"})
    steps.append({"name": "bench_model[float32]", "bench": "model", "dtype": "float32", "cmd": ["x", "out=/nope"]})
    results.append({"status": "timed_out"})
    out = tmp_path / "out"
    out.mkdir()
    assert gpu_check.merge_benches(steps, results, out) == ["sparse_gpu.json", "sparse_gpu.md"]
    rows = json.loads((out / "sparse_gpu.json").read_text())
    assert [(r["device"], r["dtype"], r["layer"]) for r in rows] == [("cuda", "float32", "conv3x3"),
                                                                     ("cuda", "bfloat16", "conv3x3")]
    md = (out / "sparse_gpu.md").read_text()
    assert "## dtype=float32" in md and "| table bfloat16 |" in md


def test_merge_units_keeps_what_a_cut_short_run_measured(tmp_path, monkeypatch):
    """gpu_units writes its rows after every section: a step that ran out of time (or failed in one section) still
    brings back its rows, each marked with the step's status; the errors go with the units' table."""
    monkeypatch.setattr(gpu_check, "WORK", tmp_path)
    (tmp_path / "gpu_units.json").write_text(json.dumps([
        {"bench": "units", "batch": 1, "sparse_capacity_x": 1.5},
        {"bench": "errors", "section": "train", "dtype": "float32", "error": "RuntimeError: boom"}]))
    out = tmp_path / "out"
    out.mkdir()
    steps = [{"name": "gpu_units", "units": True, "cmd": ["x"]}]
    assert gpu_check.merge_units(steps, [{"status": "timed_out"}], out) == ["sparse_gpu.json", "sparse_gpu.md"]
    rows = json.loads((out / "sparse_gpu.json").read_text())
    assert [(r["bench"], r["step"]) for r in rows] == [("units", "timed_out"), ("errors", "timed_out")]
    assert "RuntimeError: boom" in (out / "sparse_gpu.md").read_text()
    assert gpu_check.merge_units(steps, [{"status": "skipped"}], tmp_path / "none") == []


def test_make_target_uses_the_machines_python3():
    # --no-print-directory: under `make test` the parent make's MAKEFLAGS would add "Entering directory" lines
    res = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", "ARGS=--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "python3 scripts/gpu_check.py --dry-run"
