"""The docs run: every command line README.md and docs/*.md show is run, as written, to exit status 0 without a
traceback - with small data and short schedules added where the documented run would take hours, and the reader's
placeholders filled in (``RUNS``, one entry a documented line, says what was added to each and why). A line that
needs a GPU, several devices or data nobody here can have is composed or parsed only (tests/test_docs.py) and says so
in ``RUNS``; a documented line ``RUNS`` does not cover fails ``test_every_documented_command_is_in_the_table``.

Cost: one Python start-up for all of them. The runner (``python -m tests.test_docs_run PLAN``, below) executes each
script as ``python scripts/X.py ARGS`` would - ``runpy`` with ``sys.argv`` set, Hydra's global state cleared - in a
sandbox folder that stands for the reader's checkout: its ``data/sim_kitti`` is the tiny simulated root
(tests/conftest.py), ``data/kitti_lidar`` (and the other LiDAR-only roots the docs name) that root converted, the
docs' ``/data/kitti`` a KITTI root of the ten real frames of ../shared/kitti_real (with ImageSets) or, where they are
absent, the tiny root; ``outputs/train/<run>/checkpoints/last.ckpt`` (and every ``ckpt_path=...``) the checkpoint the
README's first line trains on the tiny grid, ``<run>`` of docs/custom-data.md the LiDAR-only run its training line
makes. ``PROJECT_ROOT`` is the sandbox, so the configs' ``data/`` and ``outputs/`` are there; nothing is written into
the checkout or ../shared.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.paths import KITTI_REAL, REPO
from tests.test_docs import _commands, _make_lines
from tests.test_train import TINY

# Every training run: the tests' tiny grid and network, one training step (the schedule, validation, the
# best-checkpoint callback, TensorBoard and the final evaluation all still run).
SMALL = (*TINY, "trainer.limit_train_batches=1")
CKPT = "outputs/train/run/checkpoints/last.ckpt"  # the README's first line makes it (SETUP)
LIDAR_CKPT = "run/checkpoints/last.ckpt"  # docs/custom-data.md's LiDAR-only run (SETUP)
EVAL_DIR = "outputs/train/run/eval"  # the evaluation of CKPT that training ends with


@dataclass(frozen=True)
class Run:
    """How a documented line runs here. ``set``: values of the line's own keys replaced (a placeholder the reader
    fills, or a size: frames, seeds, steps); ``extra``: arguments added (sizes, schedules, outputs into the
    sandbox); a key the line sets itself is never added. ``ckpt``: what ``ckpt_path=...`` stands for.
    ``real``: needs ../shared/kitti_real (skipped where it is absent); ``after``: a line whose run must come first
    (it makes this one's input); ``same_as``: a line whose run is this one's too (the same arguments, defaults spelled
    out); ``slow``: why it runs in ``make test-all`` only (``-m slow``: its smallest run
    still costs tens of seconds); ``why``: the reason for anything that is not a plain size."""

    extra: tuple[str, ...] = ()
    set: dict[str, str] = field(default_factory=dict)
    ckpt: str = CKPT
    real: bool = False
    after: str = ""
    same_as: str = ""
    slow: str = ""
    why: str = ""


@dataclass(frozen=True)
class ParseOnly:
    """Composed (Hydra lines) or parsed (key=value lines) by tests/test_docs.py, not run here: ``why``."""

    why: str


def train(*extra: str, **kw) -> Run:
    return Run(extra=(*SMALL, *extra), **kw)


def _tiny_extra(*more: str) -> str:
    """``extra=`` / ``recipe=`` of the benchmarks that start training runs: the tiny grid, one epoch of one step."""
    return " ".join([*SMALL, *more])


# Why a line runs with -m slow only (make test-all): what its smallest run still costs on a 2-core CPU.
BENCH_TRAIN = "two or three training runs in subprocesses: 20-50 s"
FINETUNE = "two folds, each a training run in a subprocess and three evaluations: ~25 s"
EXPORTS = "torch.compile, .pt2 and ONNX of the sparse and the dense network: minutes"
ONNX = "an ONNX export of the checkpoint: ~35 s"
RUNS: dict[str, Run | ParseOnly] = {
    # --- README: training --------------------------------------------------------------------------------------
    "scripts/train.py": train("hydra.run.dir=outputs/train/run",
                              why="SETUP: its checkpoint and evaluation folder are the other lines' <run>"),
    "scripts/train.py mask=road_map": train(),
    "scripts/train.py mask=ground": train(),
    "scripts/train.py model=dense": train(),
    "scripts/train.py bev=kitti data.batch_size=8": train(set={"data.batch_size": "4"},
                                                         why="the tiny root has 5 training frames"),
    "scripts/train.py data.batch_size=auto": train(),
    "scripts/train.py data.batch_size=auto data.memory_budget_mb=8000": train(),
    "scripts/train.py model.checkpoint_stages=[stem,stage1]": train(),
    "scripts/train.py experiment=multiclass": train(),
    "scripts/train.py experiment=kitti_full data.root=/data/kitti": ParseOnly(
        "trainer=gpu (a CUDA device) and PIXOR's full network and grid: composed only"),
    "scripts/train.py trainer=ddp trainer.devices=4": ParseOnly("four devices (DDP): composed only"),
    "scripts/train.py -m model.block_size=8,16,32": train(why="the sweep's three runs, each one step"),
    "scripts/train.py debug=fdr": train(),
    f"scripts/train.py ckpt_path={CKPT}": train("trainer.max_epochs=2",
                                                why="resumes the SETUP run (one epoch) for a second epoch"),
    f"scripts/train.py experiment=finetune init_from={CKPT} data.root=/data/kitti": train(),
    "scripts/train.py callbacks.last_checkpoint.every_n_train_steps=50": train(),
    "scripts/train.py experiment=sim2real": train(),
    # --- README: evaluation, export -----------------------------------------------------------------------------
    f"scripts/evaluate.py ckpt_path={CKPT}": Run(
        why="also docs/custom-data.md's line, where <run> is a LiDAR-only run: that case runs as "
            "'evaluate.py ckpt_path=... data.root=data/other_lidar split=test' below"),
    "scripts/evaluate.py ckpt_path=dummy data=kitti data.root=/data/kitti mask=predicted": Run(),
    "scripts/evaluate.py ckpt_path=dummy mask=none": Run(),
    "scripts/kitti_eval.py gt=DIR/label_2 results=RESULT_DIR split=ImageSets/val.txt out=metrics.json": Run(
        set={"split": "data/sim_kitti/ImageSets/val.txt"},
        why="DIR, RESULT_DIR: the SETUP run's evaluation folder; the split file is its root's"),
    "scripts/export.py ckpt_path=dummy format=torch out=det.pt2": Run(),
    "scripts/export.py ckpt_path=dummy format=onnx out=det.onnx": Run(slow=ONNX),
    "scripts/evaluate.py ckpt_path=dummy backend=onnx": Run(slow=ONNX),
    "scripts/evaluate.py ckpt_path=dummy block_size=8": Run(),
    "scripts/evaluate.py ckpt_path=dummy block_size=dummy": Run(set={"block_size": "dense"}),
    "scripts/evaluate.py ckpt_path=dummy": Run(),
    "scripts/kitti_eval.py gt=benchmarks/kitti_rule_case/label_2 results=benchmarks/kitti_rule_case/results "
    "classes=Car distance=false": Run(why="benchmarks/kitti_rule_case: the committed case, linked into the sandbox"),
    "scripts/estimate_memory.py bev=kitti batches=1,2,4,8,16 sparsity=0.8": Run(
        extra=("available_mb=64000",),
        why="the memory it checks against fixed, so that the answer does not depend on this machine's"),
    # --- README / docs: data ------------------------------------------------------------------------------------
    "scripts/make_dataset.py out=data/my_sim frames=1000 seed=7": Run(set={"frames": "2"}, extra=("columns=600",)),
    "scripts/make_dataset.py out=data/sim_lidar frames=300 format=lidar": Run(set={"frames": "2"},
                                                                                extra=("columns=600",)),
    "scripts/inspect_dataset.py root=data/sim_kitti": Run(),
    "scripts/inspect_dataset.py root=data/kitti_lidar": Run(),
    "scripts/inspect_dataset.py root=/data/kitti": Run(),
    "scripts/inspect_dataset.py root=dummy": Run(set={"root": "data/sim_kitti"}),
    "scripts/convert_dataset.py root=/data/kitti out=data/kitti_lidar": Run(
        set={"out": "converted/kitti_lidar"}, why="data/kitti_lidar is the sandbox's (made from the tiny root)"),
    "scripts/convert_dataset.py root=/data/kitti out=data/kitti_lidar fov_only=true": Run(
        set={"out": "converted/kitti_lidar_fov"}, why="data/kitti_lidar is the sandbox's (made from the tiny root)"),
    "scripts/compare_domains.py sim=data/sim_kitti real=/data/kitti out=outputs/domains": Run(
        extra=("max_frames=3",)),
    "scripts/visualize.py root=data/sim_kitti frame=000010 ckpt_path=dummy": Run(
        set={"frame": "000005"}, why="the tiny root's frames are 000000-000005"),
    "scripts/visualize.py root=/data/kitti frame=000008 ckpt_path=dummy mask=ground mode=bev": Run(real=True),
    "scripts/visualize.py root=data/kitti_lidar frame=<id>": Run(set={"frame": "000004"}),
    # --- docs/custom-data.md: LiDAR-only ------------------------------------------------------------------------
    "scripts/train.py data=lidar data.root=data/kitti_lidar model.classes=[Car,Truck]": train(),
    "scripts/train.py data=lidar data.root=data/kitti_lidar data.train_split=train data.val_split=val": train(
        "hydra.run.dir=run", why="SETUP: the LiDAR-only <run> of kitti_eval's and evaluate's lines"),
    "scripts/train.py data=lidar data.root=data/my_lidar model.classes=[Car,Truck,Bus] bev=kitti": train(),
    "scripts/train.py data=lidar model.classes=[Car,Tractor] +model.coder.anchors.Tractor=[4.5,2.2,2.8,-0.3] "
    "+data.classes.Tractor=0.6": train(),
    "scripts/evaluate.py ckpt_path=dummy data.root=data/other_lidar split=test": Run(ckpt=LIDAR_CKPT),
    "scripts/kitti_eval.py gt=run/eval/label_2 results=run/eval/data": Run(),
    # --- docs/predict.md ----------------------------------------------------------------------------------------
    f"scripts/predict.py ckpt_path={CKPT} input=scan.pcd": Run(),
    "scripts/predict.py ckpt_path=dummy input=my_clouds/ out=predictions/": Run(),
    "scripts/predict.py ckpt_path=dummy input=kitti/training/velodyne/000008.bin "
    "calib=kitti/training/calib/000008.txt image=kitti/training/image_2/000008.png": Run(real=True),
    "scripts/predict.py ckpt_path=dummy input=my_clouds/ skip_bad=true mask=ground": Run(),
    "scripts/predict.py ckpt_path=dummy input=my_clouds/ score_threshold=0.5 filter_files=true": Run(),
    # --- docs/real-kitti.md -------------------------------------------------------------------------------------
    "scripts/train.py data=kitti data.root=/data/kitti mask=predicted": train(),
    "scripts/train.py data=kitti data.root=/data/kitti mask=ground": train(),
    "scripts/analyze_errors.py run=outputs/eval/run root=/data/kitti": Run(
        set={"run": EVAL_DIR, "root": "data/sim_kitti"},
        why="also the README's line; <run>: the SETUP run's evaluation folder, of data/sim_kitti (its root)"),
    "scripts/analyze_errors.py run=outputs/eval/run score_threshold=0.5 level=distance": Run(
        set={"run": EVAL_DIR}, why="<run>: the SETUP run's evaluation folder"),
    "scripts/bench_sim2real.py ckpt_path=dummy": Run(extra=("images=1",), real=True),
    "scripts/bench_sim2real.py extra=experiment=sim2real out=benchmarks/sim2real_aug_cpu.json "
    "images_dir=benchmarks/sim2real_aug baseline=benchmarks/sim2real_cpu.json": Run(
        set={"extra": "experiment=sim2real " + _tiny_extra()}, extra=("images=1",), real=True,
        slow="a training run in a subprocess, then three evaluations on the real frames: ~45 s",
        why="the run it trains first is the tiny one; baseline: the committed file, copied into the sandbox"),
    "scripts/finetune_cv.py ckpt_path=dummy": Run(
        extra=("folds=2", "recipe=" + _tiny_extra()), real=True, slow=FINETUNE,
        why="two folds; each fine-tuning run the tiny one (the README's line; real-kitti.md's is the same)"),
    f"scripts/finetune_cv.py ckpt_path={CKPT}": Run(
        extra=("folds=2", "recipe=" + _tiny_extra()), real=True, slow=FINETUNE,
        why="the same run as the README's line"),
    "scripts/finetune_cv.py ckpt_path=dummy recipe=optimizer.lr=1e-3 trainer.max_epochs=50 "
    "out=outputs/finetune_cv_lr.json": Run(
        set={"recipe": "optimizer.lr=1e-3 " + _tiny_extra()}, extra=("folds=2",), real=True, slow=FINETUNE,
        why="two folds; the recipe's 50 epochs: one step"),
    # --- benchmarks (README's results table, docs/speed.md) ------------------------------------------------------
    "scripts/predict.py": ParseOnly("docs/predict.md names the program; its command lines follow on the page"),
    "scripts/bench_loader.py": Run(extra=("epochs=1", "frames=2", "out=outputs/loader.json")),
    # bench_train resolves root= and runs_dir= from the checkout, not the current folder: "{sandbox}" is the sandbox
    "scripts/bench_train.py runs=sparse,dense seeds=0,1,2,3,4,5 steps=0": Run(
        slow=BENCH_TRAIN,
        set={"seeds": "0,1"}, extra=("root={sandbox}/data/sim_kitti", "runs_dir={sandbox}/outputs/bench_train",
                                   "extra=" + _tiny_extra(), "out=outputs/bench_train_seeds.json"),
        why="two seeds of tiny runs"),
    "scripts/bench_train.py runs=sparse,dense seeds=dummy steps=0": Run(
        slow=BENCH_TRAIN,
        set={"seeds": "0,1"}, extra=("root={sandbox}/data/sim_kitti", "runs_dir={sandbox}/outputs/bench_train",
                                   "extra=" + _tiny_extra(), "out=outputs/bench_train_seeds.json"),
        why="the same run as the README's line"),
    "scripts/bench_train.py runs=sparse,road_map,dense side_by_side=true steps=8 seeds=0,1,2": Run(
        slow=BENCH_TRAIN,
        set={"steps": "1", "seeds": "0"},
        extra=("root={sandbox}/data/sim_kitti", "runs_dir={sandbox}/outputs/bench_train",
               "extra=" + _tiny_extra(), "out=outputs/bench_train_side.json"),
        why="one seed of tiny runs, one step of the breakdown"),
    "scripts/bench_train.py runs=sparse,road_map,dense": Run(
        slow=BENCH_TRAIN,
        extra=("steps=1", "root={sandbox}/data/sim_kitti", "runs_dir={sandbox}/outputs/bench_train",
               "extra=" + _tiny_extra(), "out=outputs/bench_train_three.json"),
        why="tiny runs, one step of the breakdown"),
    "scripts/bench_train.py runs=sparse,dense steps=16": Run(
        slow=BENCH_TRAIN,
        set={"steps": "1"}, extra=("root={sandbox}/data/sim_kitti", "runs_dir={sandbox}/outputs/bench_train",
                                   "extra=" + _tiny_extra(), "out=outputs/bench_train_steps.json"),
        why="tiny runs, one step of the breakdown"),
    "scripts/bench_train.py from_json=RESULT.json steps=16": Run(
        slow=BENCH_TRAIN,
        set={"from_json": "outputs/bench_train_side.json", "steps": "1"},
        extra=("out=outputs/bench_train_again.json",),
        after="scripts/bench_train.py runs=sparse,road_map,dense side_by_side=true steps=8 seeds=0,1,2",
        why="RESULT.json: the side-by-side line's result"),
    "scripts/bench_invariance.py ckpt_path=dummy": Run(
        extra=("ways=8;dense", "out=outputs/invariance.json"),
        why="two ways of the five: a tile and dense"),
    "scripts/bench_tradeoff.py ckpt_path=dummy": Run(extra=("thresholds=0.5", "dilations=0", "frames=1")),
    "scripts/bench_model.py block_size=auto head_block_size=auto": Run(
        extra=("bev=small", "arch=default", "batches=1", "frames=1", "reps=1", "mask_train_steps=2",
               "out=outputs/model_cpu.json")),
    "scripts/bench_model.py bev=kitti ckpt_path=dummy": Run(
        extra=("batches=1", "frames=1", "reps=1", "out=outputs/model_ckpt.json"),
        why="bev=kitti gives way to the checkpoint's grid, as the script says"),
    "scripts/bench_mask.py variants=c3,c5,c7,c5w32": Run(
        extra=("steps=2", "batches=1", "reps=1", "thresholds=0.5", "out=outputs/mask_screen.json",
               "extra=" + " ".join(a for a in SMALL if "block_size" not in a)),
        why="the tiny grid; the plan's tiles left to it (bench_mask measures the plan's MACs)"),
    "scripts/bench_export.py frames=2 reps=3 block_size=16": Run(
        set={"frames": "1", "reps": "1"}, extra=("bevs=small", "out=outputs/export"), slow=EXPORTS,
        why="bev=small only (bev=kitti: PIXOR's 800 x 704 grid, compiled)"),
    "scripts/bench_export.py bevs=small,kitti backends=eager,compile,pt2,onnx block_size=16": Run(
        same_as="scripts/bench_export.py frames=2 reps=3 block_size=16", slow=EXPORTS,
        why="bev=small only: then the README's line with its default backends spelled out"),
    "scripts/bench_step.py bev=kitti data.batch_size=2": Run(
        set={"bev": "small", "data.batch_size": "1"}, extra=(*TINY, "steps=1", "warmup=1"),
        why="the tests' tiny grid and network, one timed step"),
    "scripts/bench_memory.py bevs=small,kitti batches=1,2,4,8,16 sparsities=dense,0.5,0.7,0.9": Run(
        set={"bevs": "small", "batches": "1", "sparsities": "0.9"}, extra=("out=outputs/memory",)),
}

# The docs' make lines, none run here (tests/test_docs.py checks that each names a target of the Makefile): why.
MAKE = {
    "make train": "setup, data (300 frames), kernels, inspect_dataset, train.py: its two script lines run above",
    'make train ARGS="..."': "as make train; ARGS are train.py's overrides, whose lines run above",
    "make test": "this suite",
    "make test-all": "this suite with -m slow",
    "make bench": "the benchmarks at full size (an hour): their documented lines run above at their smallest",
    "make data": "scripts/make_dataset.py with 300 frames: make_dataset's lines run above",
    "make kernels": "the kernels are built (or loaded) by the first import of every run above",
    "make kernels-cuda": "needs nvcc and a 5.5 GB CUDA build of torch",
    "make gpu-check": "needs a CUDA GPU",
    "make gpu-check ARGS=--dry-run": "tests/bench/test_gpu_check.py runs the dry run with out= in a tmp folder (as "
                                     "written it makes build/gpu_check in the checkout)",
    'make gpu-check ARGS="wheels=build/wheels data=data/gpu_check out=/tmp/gpu_check"':
        "needs a CUDA GPU and prepared wheels",
    "make lint": "ruff: CI's own step",
    "make setup": "makes .venv, which this suite runs in",
    "make sysdeps": "installs libusb with apt-get (as root)",
}


def _key(script: str, args: list[str]) -> str:
    return " ".join([script, *args])


def _documented() -> dict[str, list[str]]:
    """Each documented command line (placeholders filled as tests/test_docs.py fills them) with the docs it is in."""
    found: dict[str, list[str]] = {}
    for doc, script, args in _commands():
        found.setdefault(_key(script, args), []).append(doc)
    return found


def test_every_documented_command_is_in_the_table():
    """A new command line in the README or docs/ needs its entry in RUNS (run, with what) or MAKE; an entry whose
    line left the docs goes too."""
    documented, makes = _documented(), set(_make_lines())
    missing = set(documented) - set(RUNS)
    assert not missing, f"documented command lines RUNS does not cover: {missing}"
    assert not set(RUNS) - set(documented), f"RUNS entries no doc shows any more: {set(RUNS) - set(documented)}"
    assert not makes - set(MAKE), f"documented make lines MAKE does not cover: {makes - set(MAKE)}"
    assert not set(MAKE) - makes, f"MAKE entries no doc shows any more: {set(MAKE) - makes}"
    for key, entry in RUNS.items():
        if isinstance(entry, Run):
            args = dict(a.split("=", 1) for a in key.split()[1:] if "=" in a)
            assert set(entry.set) <= set(args), f"{key}: set= names keys the line does not have"
            for first in (entry.after, entry.same_as):
                assert not first or isinstance(RUNS.get(first), Run), f"{key}: {first} is not a run"


def _snapshot() -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file where a command's default output would land in the checkout (benchmarks/,
    data/) and of the real frames."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for top in (REPO / "benchmarks", REPO / "data", KITTI_REAL)
            for p in (top.rglob("*") if top.is_dir() else []) if p.is_file()}


# --- the sandbox and the plan ---------------------------------------------------------------------------------
def _has_real() -> bool:
    return (KITTI_REAL / "training" / "velodyne").is_dir()


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` mirrors ``src``: its folders made, each file a symbolic link (nothing copied, ``src`` untouched)."""
    for p in src.rglob("*"):
        target = dst / p.relative_to(src)
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(p)


def _make_sandbox(box: Path, tiny_root: Path) -> None:
    import numpy as np

    from detector.data.convert import convert_kitti_to_lidar
    from detector.data.pointcloud import write_point_cloud

    (box / "data").mkdir(parents=True)
    (box / "data" / "sim_kitti").symlink_to(tiny_root)
    kitti = box / "kitti"  # the docs' /data/kitti
    if _has_real():
        (kitti / "ImageSets").mkdir(parents=True)
        (kitti / "training").symlink_to(KITTI_REAL / "training")
        ids = sorted(p.stem for p in (KITTI_REAL / "training" / "velodyne").glob("*.bin"))
        (kitti / "ImageSets" / "train.txt").write_text("\n".join(ids[:-3]) + "\n")
        (kitti / "ImageSets" / "val.txt").write_text("\n".join(ids[-3:]) + "\n")
    else:
        kitti.symlink_to(tiny_root)
    lidar = box / "data" / "kitti_lidar"
    convert_kitti_to_lidar(tiny_root, lidar)
    for name in ("lidar", "my_lidar"):  # data=lidar's default root; docs/custom-data.md's own dataset
        (box / "data" / name).symlink_to(lidar)
    other = box / "data" / "other_lidar"  # "elsewhere": another LiDAR-only root, with a test split
    for part in ("points", "labels"):
        _link_tree(lidar / part, other / part)
    (other / "ImageSets").mkdir()
    (other / "ImageSets" / "test.txt").write_text("".join(f"{p.stem}\n" for p in sorted((lidar / "points").iterdir())))
    points = np.fromfile(tiny_root / "training" / "velodyne" / "000004.bin", dtype=np.float32).reshape(-1, 4)
    write_point_cloud(box / "scan.pcd", points)
    (box / "my_clouds").mkdir()
    write_point_cloud(box / "my_clouds" / "000004.bin", points)
    write_point_cloud(box / "my_clouds" / "000005.npy",
                      np.fromfile(tiny_root / "training" / "velodyne" / "000005.bin", dtype=np.float32).reshape(-1, 4))
    (box / "benchmarks").mkdir()
    (box / "benchmarks" / "kitti_rule_case").symlink_to(REPO / "benchmarks" / "kitti_rule_case")
    shutil.copy(REPO / "benchmarks" / "sim2real_cpu.json", box / "benchmarks" / "sim2real_cpu.json")


def _argv(key: str, entry: Run, box: Path) -> list[str]:
    """The documented line's arguments as run here: placeholders filled, ``set`` and ``extra`` applied."""
    doc_args = next(a for d, s, a in _commands() if _key(s, a) == key)
    kitti = str(box / "kitti")
    out = []
    for a in doc_args:
        k, eq, v = a.partition("=")
        if eq and k in entry.set:
            v = entry.set[k]
        elif eq and v == "dummy" and k == "ckpt_path":
            v = entry.ckpt
        v = v.replace("/data/kitti", kitti).replace("DIR/label_2", f"{EVAL_DIR}/label_2")
        v = v.replace("RESULT_DIR", f"{EVAL_DIR}/data")
        out.append(f"{k}={v}" if eq else a)
    own = {a.partition("=")[0].lstrip("+~") for a in out}
    out += [e.replace("{sandbox}", str(box)) for e in entry.extra if e.partition("=")[0].lstrip("+~") not in own]
    return out


def _plan(keys: list[str], box: Path) -> list[dict]:
    """The runs of ``keys`` (the SETUP lines and every ``after=`` first), each distinct argument list once."""
    setup = [k for k, e in RUNS.items() if isinstance(e, Run) and e.why.startswith("SETUP")]
    order: list[str] = []

    def add(k: str) -> None:
        entry = RUNS[k]
        for first in (entry.after, entry.same_as):
            if first:
                add(first)
        if k not in order:
            order.append(k)

    for k in [*setup, *keys]:
        add(k)
    plan, seen = [], {}
    for k in order:
        script = k.split(" ", 1)[0]
        argv = _argv(RUNS[k].same_as or k, RUNS[RUNS[k].same_as or k], box)
        sig = json.dumps([script, sorted(argv)])  # the same arguments in another order: the same run
        if sig in seen:
            seen[sig]["keys"].append(k)
            continue
        seen[sig] = {"keys": [k], "script": script, "argv": argv}
        plan.append(seen[sig])
    return plan


RUN_KEYS = [k for k, e in RUNS.items() if isinstance(e, Run) and not e.slow]
SLOW_KEYS = [k for k, e in RUNS.items() if isinstance(e, Run) and e.slow]


@pytest.fixture(scope="module")
def docs_run(request, tiny_root, tmp_path_factory) -> dict:
    """Runs the selected lines (and the SETUP lines) in one runner process; {line: result}."""
    selected = [item.callspec.params["line"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "line" in item.callspec.params]
    keys = [k for k in RUNS if k in selected and (_has_real() or not RUNS[k].real)]
    box = tmp_path_factory.mktemp("docs_run")
    _make_sandbox(box, tiny_root)
    before = _snapshot()
    plan = _plan(keys, box)
    (box / "plan.json").write_text(json.dumps(plan))
    started, cpu = time.time(), _children_cpu()
    env = {**os.environ, "PROJECT_ROOT": str(box)}
    env.pop("HYDRA_FULL_ERROR", None)
    slow = any(RUNS[k].slow for k in keys)
    r = subprocess.run([sys.executable, "-m", "tests.test_docs_run", str(box)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=3600 if slow else 900)
    results = {}
    for line in (box / "results.jsonl").read_text().splitlines() if (box / "results.jsonl").is_file() else []:
        res = json.loads(line)
        for k in res["keys"]:
            results[k] = res
    print(f"\ndocs run: {len(plan)} runs in {time.time() - started:.0f} s, {_children_cpu() - cpu:.0f} s of CPU "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs):")
    for res in sorted({id(v): v for v in results.values()}.values(), key=lambda v: -v["seconds"]):
        print(f"  {res['seconds']:6.1f} s  rc {res['rc']}  {res['script']} {' '.join(res['argv'])[:160]}")
    return {"results": results, "runner": r, "box": box, "untouched": (before, _snapshot())}


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _check(line: str, docs_run: dict) -> None:
    entry = RUNS[line]
    if entry.real and not _has_real():
        pytest.skip("needs ../shared/kitti_real (real KITTI frames)")
    res = docs_run["results"].get(line)
    if res is None:
        r = docs_run["runner"]
        pytest.fail(f"not run: the runner stopped (status {r.returncode}): {r.stderr[-3000:]}")
    log = Path(res["log"]).read_text(errors="replace")
    command = f"python {res['script']} {' '.join(res['argv'])}"
    assert res["rc"] == 0, f"`{command}` exited with status {res['rc']}:\n{log[-4000:]}"
    assert "Traceback (most recent call last)" not in log, f"`{command}` printed a traceback:\n{log[-4000:]}"


# --- the runner -------------------------------------------------------------------------------------------------
def _run_one(script: str, argv: list[str], log: Path) -> int:
    """``python SCRIPT ARGV`` in this process: its output (and its subprocesses') into ``log``; the exit status."""
    import logging
    import runpy
    import traceback
    import warnings

    import torch
    from hydra.core.global_hydra import GlobalHydra

    saved_env, saved_cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    sys.stdout.flush()
    sys.stderr.flush()
    fds = os.dup(1), os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    rc = 0
    try:
        GlobalHydra.instance().clear()
        sys.argv = [script, *argv]
        with warnings.catch_warnings():
            runpy.run_path(str(REPO / script), run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # what python would print and exit 1 with
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        GlobalHydra.instance().clear()
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
            h.close()
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        torch.set_num_threads(threads)
    return rc


def _runner(box: Path) -> None:
    plan = json.loads((box / "plan.json").read_text())
    (box / "logs").mkdir(exist_ok=True)
    os.chdir(box)
    with open(box / "results.jsonl", "w") as out:
        for i, run in enumerate(plan):
            log = box / "logs" / f"{i:02d}_{re.sub(r'[^a-z_]', '', Path(run['script']).stem)}.log"
            t = time.time()
            rc = _run_one(run["script"], run["argv"], log)
            out.write(json.dumps({**run, "rc": rc, "seconds": round(time.time() - t, 2), "log": str(log)}) + "\n")
            out.flush()


if __name__ == "__main__":
    _runner(Path(sys.argv[1]))


@pytest.mark.parametrize("line", RUN_KEYS, ids=RUN_KEYS)
def test_documented_command_runs(line, docs_run):
    _check(line, docs_run)


@pytest.mark.slow
@pytest.mark.parametrize("line", SLOW_KEYS, ids=SLOW_KEYS)
def test_documented_slow_command_runs(line, docs_run):
    _check(line, docs_run)


def test_the_docs_run_writes_nothing_into_the_checkout(docs_run):
    """Every output went into the sandbox: the checkout's benchmarks/ and data/ and the real frames are as they were."""
    before, after = docs_run["untouched"]
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, f"the documented commands wrote {changed[:10]}"
