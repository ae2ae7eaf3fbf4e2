"""Prepared GPU check: build the sbnet CUDA kernels for this GPU, run the `gpu` tests and the GPU benchmarks.

    python3 scripts/gpu_check.py [wheels=DIR] [out=DIR] [data=DIR] [budget=480] [--dry-run]
    make gpu-check ARGS="wheels=build/wheels data=data/gpu_check out=/tmp/gpu_check"

For a Linux machine with an NVIDIA GPU whose ``python3`` already has a CUDA build of torch (2.4+),
lightning, tensorboard, numpy and pytest, and no internet. It uses the interpreter it runs under for
every step (the Makefile calls the machine's ``python3``, not .venv), and never needs open3d. This module
imports only the standard library: ``scripts/gpu_check.py`` loads it by its path, without importing the
package. Steps, each with its own timeout inside a total budget (default 480 s = 8 minutes); a step that
times out is named in the summary and the later steps still run while budget is left:

1. ``probe``   torch, CUDA, the GPU and its capability, nvcc (CUDA_HOME), the Python packages;
2. ``wheels``  ``pip install --no-index --no-deps --target build/gpu_check/site DIR/*.whl`` (hydra-core,
               omegaconf, antlr4-python3-runtime); that folder goes first on PYTHONPATH of every later step;
3. ``build``   the extension with CUDA (``detector.ops._library.build(with_cuda=True)``), MAX_JOBS = cores,
               TORCH_CUDA_ARCH_LIST = the device's capability (e.g. 9.0);
4. ``pytest``  ``pytest -m gpu tests`` (junit XML to out/pytest_gpu.xml);
5. ``gpu_units`` ``detector/bench/gpu_units.py``: the sync-free path of issue 42 (capacity buckets, fused Triton
   kernels, CUDA graphs) against dense eager and dense captured, float32 and bfloat16: the stage-1 bottleneck unit at
   50 % / 90 % sparsity, batch 1 and 8 (forward; forward + backward on lists of the count and of a bucket), the
   bev=kitti backbone per batch, a training step at batch 8, kernels and host syncs per forward; merged into
   sparse_gpu.*, model_gpu.* and profile_gpu.md (the files that come back stay at 8);
6. ``bench_sparse`` with ``device=cuda dtype=float32|bfloat16`` at 50 % and 90 % sparsity, every forward call's
   output checked; its peers beside the conv3x3 rows: the cuDNN dense twin, our unit and spconv's SubMConv2d on the
   same active pixels where spconv imports (its CUDA wheel and its dependencies in ``wheels=DIR``), else the spconv
   cells say skipped, with the note why; and ``bench_model`` (float32) on the dataset ``data`` with masks
   ``none,predicted`` (road_map and ground masks need open3d), skipped when ``data`` holds no dataset;
7. ``profile`` ``scripts/profile_gpu.py``: the detector dense, sparse at a fixed tile and with the plan, timed
   and profiled (kernels and host syncs per run, top operators) at bev=kitti and on make train's model.

Output in ``out`` (default build/gpu_check/out), at most 8 files so that all of it comes back from the
device machine: ``summary.json`` (per step: command, status passed/failed/timed_out/skipped, seconds,
output tail), ``gpu_check.log`` (every step's output), ``pytest_gpu.xml``, ``sparse_gpu.{json,md}`` (both
dtypes in one file: rows tagged with ``device`` and ``dtype``), ``model_gpu.{json,md}`` and ``profile_gpu.md``. Exit
status 0 when every step passed.

``--dry-run``, and any run on a machine without a CUDA GPU (or without torch), checks the CPU-side
preparation (scripts and sources exist, wheels folder readable and holding wheels, out writable, each
command's key=value arguments known to its benchmark module) and prints the plan; exit status 0 unless a check
failed. tests/bench/test_gpu_check.py runs it in the default suite.

Preparing the inputs here (the GPU machine has no internet; both folders are git-ignored, so name them in
the device tool's ``carry``):

    .venv/bin/python -m pip wheel --no-deps -w build/wheels hydra-core==1.3.8 omegaconf==2.3.1 \\
        antlr4-python3-runtime==4.9.3    # pure Python; antlr4 4.9.3 is an sdist only, `pip wheel` builds it
    .venv/bin/python scripts/make_dataset.py out=data/gpu_check frames=25    # the simulator needs open3d: here
                                 # ~1.9 MB a frame: 25 frames (5 val, 20 train) = ~48 MB of the 64 MiB carried

spconv for the peers row is not among them: its CUDA wheels for Python 3.12 (``pip download --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 spconv-cu126==2.3.8``: 67 MiB, and
cumm-cu126 0.7.11: 25 MiB, beside pccm, ccimport, fire, pybind11) are more than the 64 MiB the device tool carries.

then, with the device tool: ``run(command="python3 scripts/gpu_check.py wheels=build/wheels
data=data/gpu_check out=$OUT", carry=["build/wheels", "data/gpu_check"], timeout_s=600)``, and copy
``sparse_gpu.*`` / ``model_gpu.*`` from the files that come back into benchmarks/.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "gpu_check"
DTYPES = ("float32", "bfloat16")
DEFAULTS = {"wheels": "", "out": str(WORK / "out"), "data": "data/gpu_check", "budget": 480}
UNITS = "detector/bench/gpu_units.py"
CAPS = {"probe": 60, "wheels": 60, "build": 240, "pytest": 180, "gpu_units": 170, "bench_sparse": 120,
        "bench_model": 150, "profile": 150}
PROBE = (
    "import importlib.util as u, json, torch\n"
    "from torch.utils.cpp_extension import CUDA_HOME\n"
    "cuda = torch.cuda.is_available()\n"
    "print(json.dumps({'torch': torch.__version__, 'cuda': cuda, 'cuda_home': CUDA_HOME,\n"
    "    'device': torch.cuda.get_device_name(0) if cuda else None,\n"
    "    'capability': list(torch.cuda.get_device_capability(0)) if cuda else None,\n"
    "    'packages': {m: u.find_spec(m) is not None for m in\n"
    "        ('lightning', 'tensorboard', 'numpy', 'pytest', 'hydra', 'omegaconf', 'open3d')}}))\n"
)


def parse(argv: list[str]) -> tuple[dict, bool]:
    args, dry = dict(DEFAULTS), False
    for a in argv:
        if a in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        if a == "--dry-run":
            dry = True
            continue
        key, sep, value = a.partition("=")
        if not sep or key not in DEFAULTS:
            raise SystemExit(f"error: unexpected argument {a!r} (expected --dry-run or key=value with key in: "
                             f"{', '.join(DEFAULTS)})")
        args[key] = int(value) if key == "budget" else value
    for key in ("wheels", "out"):  # the steps run in the repository root
        args[key] = str(Path(args[key]).resolve()) if args[key] else ""
    return args, dry


def script_keys(path: Path) -> set[str]:
    """The key=value arguments a benchmark takes (``path``: its module in detector/bench/): the string keys of
    its dict literals that hold ``out``."""
    keys: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
            names = {k.value for k in node.keys}
            if "out" in names:
                keys |= names
    return keys


def has_dataset(data: str) -> bool:
    return (REPO / data / "ImageSets" / "val.txt").is_file()


def plan(args: dict) -> list[dict]:
    """The steps after the probe: name, command (argv), and files they write into out."""
    py, out, work = sys.executable, Path(args["out"]), WORK
    steps = []
    if args["wheels"]:
        wheels = sorted(str(p) for p in Path(args["wheels"]).glob("*.whl"))
        steps.append({"name": "wheels", "cmd": [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                                "--no-compile", "--no-cache-dir", "--upgrade", "--target",
                                                str(work / "site"), *wheels]})
    steps.append({"name": "build", "cmd": [py, "-c", "from detector.ops import _library; "
                                          "print(_library.build(with_cuda=True, verbose=True))"]})
    steps.append({"name": "pytest", "cmd": [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                           "--continue-on-collection-errors", f"--junitxml={out / 'pytest_gpu.xml'}",
                                           "tests"]})
    # the sync-free, fused, captured path (issue 42's goal rows) before the older benchmarks: if the budget runs
    # out, they are what is cut. Dense baseline: the faster of eager and eager captured as a CUDA graph (compile=false:
    # inductor's compiles of the dense units would take most of the budget; `compile=true` adds them).
    steps.append({"name": "gpu_units", "units": True,
                  "cmd": [py, "-m", "detector.bench.gpu_units", "device=cuda", f"dtype={','.join(DTYPES)}",
                          "batch=1,8", "sparsity=0.5,0.9",
                          "what=units,backbone,train,profile", "reps=10", "compile=false",
                          f"out={work / 'gpu_units.json'}", f"md={work / 'gpu_units.md'}"]})
    for dtype in DTYPES:
        base = ["device=cuda", f"dtype={dtype}"]
        steps.append({"name": f"bench_sparse[{dtype}]", "bench": "sparse", "dtype": dtype,
                      "cmd": [py, "scripts/bench_sparse.py", *base, "sparsity=0.5,0.9", "spconv=true",
                              f"out={work / f'sparse_gpu_{dtype}.json'}", f"md={work / f'sparse_gpu_{dtype}.md'}"]})
    # the whole detector: float32 only (bfloat16 shows the same picture, and a second run would not fit the budget)
    steps.append({"name": "bench_model[float32]", "bench": "model", "dtype": "float32",
                  "skip": None if has_dataset(args["data"]) else f"no dataset at data={args['data']}",
                  "cmd": [py, "scripts/bench_model.py", "device=cuda", "dtype=float32", f"root={args['data']}",
                          "masks=none,predicted", "batches=1,8", f"out={work / 'model_gpu_float32.json'}"]})
    steps.append({"name": "profile",
                  "cmd": [py, "scripts/profile_gpu.py", "device=cuda", f"out={out / 'profile_gpu.md'}"]})
    return steps


def check_preparation(args: dict, steps: list[dict]) -> tuple[list[str], list[str]]:
    """CPU-side checks: (errors, warnings)."""
    errors, warnings = [], []
    for rel in (UNITS, "detector/ops/triton_blocks.py", "detector/nn/graphs.py", "scripts/bench_sparse.py",
                "scripts/bench_model.py", "detector/bench/sparse.py",
                "detector/bench/model.py", "tests/ops/test_cuda.py", "kernels/ops.cpp",
                "detector/ops/_library.py"):
        if not (REPO / rel).is_file():
            errors.append(f"{rel} is missing")
    if not list((REPO / "kernels" / "cuda").glob("*.cu")):
        errors.append("kernels/cuda/*.cu: no CUDA sources")
    if args["wheels"]:
        w = Path(args["wheels"])
        if not (w.is_dir() and os.access(w, os.R_OK | os.X_OK)):
            errors.append(f"wheels={w}: not a readable folder")
        elif not list(w.glob("*.whl")):
            errors.append(f"wheels={w}: holds no *.whl")
    else:
        warnings.append("no wheels=DIR: hydra-core/omegaconf must already be importable (bench_model needs them)")
    try:
        out = Path(args["out"])
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            errors.append(f"out={out}: not writable")
    except OSError as e:
        errors.append(f"out={args['out']}: {e}")
    for s in steps:
        if not all(isinstance(c, str) and c for c in s["cmd"]):
            errors.append(f"{s['name']}: malformed command {s['cmd']!r}")
        if s.get("skip"):
            warnings.append(f"{s['name']} will be skipped: {s['skip']}")
        if "bench" in s or s.get("units"):
            known = script_keys(REPO / (UNITS if s.get("units") else f"detector/bench/{s['bench']}.py"))
            for a in s["cmd"][3 if s.get("units") else 2:]:
                key = a.partition("=")[0]
                if key not in known:
                    warnings.append(f"{s['cmd'][1]} does not take {key}= (yet): {s['name']} would fail")
    return errors, warnings


def run_step(step: dict, env: dict, timeout: float, log) -> dict:
    """Run one step in its own process group, its output appended to the log; kill the group on timeout."""
    log.write(f"\n===== {step['name']}: {shlex.join(step['cmd'])} (timeout {timeout:.0f} s)\n".encode())
    log.flush()
    start = log.tell()
    t0 = time.monotonic()
    proc = subprocess.Popen(step["cmd"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
        status = "passed" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc, status = proc.wait(), "timed_out"
    seconds = time.monotonic() - t0
    log.flush()
    with open(log.name, "rb") as f:
        f.seek(start)
        tail = f.read().decode(errors="replace")[-3000:]
    print(f"  {step['name']}: {status} (rc {rc}, {seconds:.0f} s)", flush=True)
    return {"name": step["name"], "cmd": step["cmd"], "status": status, "rc": rc, "seconds": round(seconds, 1),
            "tail": tail}


def junit_counts(path: Path) -> dict:
    """tests / failures / errors / skipped of a pytest junit XML (zeros when it is missing)."""
    import xml.etree.ElementTree as ET

    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    if path.is_file():
        for suite in ET.parse(path).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
    return counts


def merge_benches(steps: list[dict], results: list[dict], out: Path) -> list[str]:
    """One JSON and one markdown per bench in out, both dtypes (rows tagged with device and dtype)."""
    written = []
    for bench in ("sparse", "model"):
        merged, md = [], [f"# {bench} benchmark on the GPU\n"]
        for s, r in zip(steps, results, strict=True):
            if s.get("bench") != bench or r["status"] != "passed":
                continue
            js = Path(next(a for a in s["cmd"] if a.startswith("out=")).partition("=")[2])
            if not js.is_file():
                continue
            data = json.loads(js.read_text())
            rows = data if isinstance(data, list) else [data]
            merged += [dict(row, device=row.get("device", "cuda"), dtype=row.get("dtype", s["dtype"]))
                       if isinstance(row, dict) else row for row in rows]
            if js.with_suffix(".md").is_file():
                md.append(f"## dtype={s['dtype']}\n\n{js.with_suffix('.md').read_text()}\n")
        if merged:
            (out / f"{bench}_gpu.json").write_text(json.dumps(merged, indent=1) + "\n")
            (out / f"{bench}_gpu.md").write_text("\n".join(md))
            written += [f"{bench}_gpu.json", f"{bench}_gpu.md"]
    return written


def merge_units(steps: list[dict], results: list[dict], out: Path) -> list[str]:
    """gpu_units' rows into the files that come back (at most 8): units into sparse_gpu.*, the backbone and
    the training step into model_gpu.*, the kernel and sync counts into profile_gpu.md."""
    # gpu_units writes its file after every section: a step that failed (a section's error is a row) or ran out of
    # time still brings back what it measured, each row marked with the step's status
    step = next(((s, r) for s, r in zip(steps, results, strict=True)
                 if s.get("units") and r["status"] in ("passed", "failed", "timed_out")), None)
    js = WORK / "gpu_units.json"
    if step is None or not js.is_file():
        return []
    rows = [dict(r, step=step[1]["status"]) for r in json.loads(js.read_text())]
    written = []
    for name, benches in (("sparse", ("units", "errors")), ("model", ("backbone", "train_step"))):
        sel = [r for r in rows if r.get("bench") in benches]
        if not sel:
            continue
        jf, mf = out / f"{name}_gpu.json", out / f"{name}_gpu.md"
        old = json.loads(jf.read_text()) if jf.is_file() else []
        jf.write_text(json.dumps((old if isinstance(old, list) else [old]) + [dict(r, device="cuda") for r in sel],
                                 indent=1) + "\n")
        md = mf.read_text() if mf.is_file() else f"# {name} benchmark on the GPU\n"
        mf.write_text(md + "\n" + _units_md(sel))
        written += [jf.name, mf.name]
    prof = [r for r in rows if r.get("bench") == "profile"]
    if prof:
        pf = out / "profile_gpu.md"
        pf.write_text((pf.read_text() if pf.is_file() else "") + "\n" + _units_md(prof))
        written.append(pf.name)
    return written


def _units_md(rows: list[dict]) -> str:
    out = []
    for bench in dict.fromkeys(r["bench"] for r in rows):
        sel = [r for r in rows if r["bench"] == bench]
        keys = [k for k in sel[0] if k != "bench"]
        out += [f"## {bench} (sync-free capacity path: {UNITS})", "", "| " + " | ".join(keys) + " |",
                "|" + "---|" * len(keys)]
        out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in sel] + [""]
    return "\n".join(out)


def probe_python() -> dict:
    """torch, CUDA and the packages of this interpreter, asked in a child process (it may lack torch)."""
    try:
        res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=CAPS["probe"],
                             cwd=REPO)
        lines = (res.stdout if res.returncode == 0 else res.stderr).strip().splitlines() or ["(no output)"]
        return json.loads(lines[-1]) if res.returncode == 0 else {"cuda": False, "error": lines[-1]}
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return {"cuda": False, "error": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    args, dry = parse(sys.argv[1:] if argv is None else argv)
    t_start = time.monotonic()
    steps = plan(args)
    errors, warnings = check_preparation(args, steps)
    for e in errors:
        print(f"error: {e}")
    if errors:
        return 2
    probe = probe_python()
    cap = probe.get("capability")
    gpu = bool(probe.get("cuda")) and probe.get("cuda_home") is not None
    print(f"gpu_check: python {sys.executable}; probe {json.dumps(probe)}")
    arch = f"{cap[0]}.{cap[1]}" if cap else "(the device's capability)"
    print(f"plan (budget {args['budget']} s; env MAX_JOBS={os.cpu_count()} TORCH_CUDA_ARCH_LIST={arch}):")
    for s in steps:
        print(f"  {s['name']:<22} [{CAPS[s['name'].split('[')[0]]:>3} s] {shlex.join(s['cmd'])}")
    for w in warnings:
        print(f"warning: {w}")
    if dry or not gpu:
        why = "--dry-run" if dry else f"no CUDA GPU here ({probe.get('error') or 'torch.cuda unavailable or no nvcc'})"
        print(f"gpu_check: preparation checked; nothing run ({why})")
        return 0

    out = Path(args["out"])
    env = dict(os.environ, PYTHONUNBUFFERED="1", MAX_JOBS=str(os.cpu_count() or 1), TORCH_CUDA_ARCH_LIST=arch,
               CUDA_HOME=probe["cuda_home"])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORK / "site"), str(REPO), env.get("PYTHONPATH")) if p)
    WORK.mkdir(parents=True, exist_ok=True)
    results = []
    with open(out / "gpu_check.log", "wb") as log:
        for s in steps:
            left = args["budget"] - (time.monotonic() - t_start)
            if s.get("skip") or left < 10:
                reason = s.get("skip") or "total budget spent"
                print(f"  {s['name']}: skipped ({reason})")
                results.append({"name": s["name"], "cmd": s["cmd"], "status": "skipped", "reason": reason})
                continue
            results.append(run_step(s, env, min(CAPS[s["name"].split("[")[0]], left), log))
            if s["name"] == "pytest":  # a run in which every gpu test skipped checked nothing
                results[-1]["junit"] = counts = junit_counts(out / "pytest_gpu.xml")
                if results[-1]["status"] == "passed" and counts["tests"] <= counts["skipped"]:
                    results[-1]["status"] = "failed"
                    print("  pytest: every gpu test skipped: counted as failed")
    written = merge_benches(steps, results, out)
    written = sorted(set(written) | set(merge_units(steps, results, out)))
    ok = all(r["status"] == "passed" for r in results)
    summary = {"ok": ok, "budget_s": args["budget"], "elapsed_s": round(time.monotonic() - t_start, 1),
               "probe": probe, "timed_out": [r["name"] for r in results if r["status"] == "timed_out"],
               "skipped": [r["name"] for r in results if r["status"] == "skipped"],
               "files": written, "steps": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"gpu_check: {'all steps passed' if ok else 'FAILED'} in {summary['elapsed_s']} s; "
          f"timed out: {summary['timed_out'] or 'none'}; results in {out}")
    return 0 if ok else 1
