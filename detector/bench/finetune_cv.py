"""Fine-tuning on a few labeled real frames, measured by cross-validation: how much a fine-tuning recipe lifts a
simulator-trained checkpoint on real frames it never saw.

    python scripts/finetune_cv.py ckpt_path=CKPT [real=../shared/kitti_real] [folds=4] [recipe="k=v k=v"]
                                  [out=benchmarks/finetune_cv.json] [work=outputs/finetune_cv/<time>]

``real`` (relative to the repository root) is a KITTI-format folder with ``training/{velodyne,label_2,calib}``; its
labeled frames are split into ``folds`` folds (sorted ids dealt round-robin: fold i holds out ids[i::folds], so 10
frames and 4 folds hold out 3, 3, 2 and 2 and fine-tune on the other 7, 7, 8 and 8). Each frame is held out exactly
once. Per fold, a KITTI root ``work/fold<i>/root`` links ``real``/training (nothing is copied) and lists the frames
to fine-tune on in ``ImageSets/train.txt`` and the held-out ones in ``val.txt``; then

- before: the checkpoint as it is, scored on the held-out frames (:func:`detector.tasks.evaluate_checkpoint`, the code
  of ``scripts/evaluate.py``, with the checkpoint's own mask);
- fine-tuning: ``scripts/train.py init_from=CKPT experiment=finetune data.root=<fold root>`` in a subprocess, with the
  checkpoint's config groups (its ``bev``, ``model`` and ``mask`` choices, so that every tensor loads), then the
  ``recipe`` overrides; its wall time is the fold's;
- after: its last checkpoint scored on the same held-out frames by the same code;
- fitted: that checkpoint scored on the frames it was fine-tuned on (what the recipe can fit at all: a fitted AP far
  above the held-out one says the frames are too few to generalize from, one as low says the recipe under-fits).

The recipe never sees a held-out frame: ``experiment=finetune`` keeps no best-by-validation checkpoint. Figures: Car
BEV and 3D AP R40 moderate before and after per fold, their mean over folds, and the pooled AP over every frame, each
scored by the fold's model that never saw it (a few frames a fold make each fold's AP coarse: the pooled figure
counts every held-out Car once); per fold, the wall time of the fine-tuning command (start-up, GT database, plan,
training) and of its training loop (``fit_s``). Writes OUT (JSON) and a markdown table beside it, with the machine
(CPU model, threads, allocator settings, load average before and after).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from detector.cli import parse_args
from detector.resources import outputs_dir

REPO = Path(__file__).resolve().parents[2]
# The goal: real-frame Car BEV AP R40 moderate lifted to this on held-out frames, by a recipe a user runs in
# at most this many seconds on a 2-core CPU.
GOAL = {"bev_moderate": 50.0, "wall_s": 900.0}
# The config groups whose choice shapes the weights: a fine-tuning run takes the checkpoint's.
SHAPING = ("bev", "model", "mask")


@dataclass(frozen=True)
class Fold:
    """One fold: the frames it fine-tunes on and those it holds out (disjoint)."""

    index: int
    train: tuple[str, ...]
    held_out: tuple[str, ...]


def make_folds(ids: list[str], folds: int) -> list[Fold]:
    """``folds`` folds of the sorted ``ids``: fold i holds out ids[i::folds] and fine-tunes on the rest."""
    ids = sorted(ids)
    if not 2 <= folds <= len(ids):
        raise SystemExit(f"error: folds={folds}: between 2 and the number of labeled frames ({len(ids)})")
    out = []
    for i in range(folds):
        held = ids[i::folds]
        out.append(Fold(i, tuple(f for f in ids if f not in held), tuple(held)))
    return out


def labeled_frames(real: Path) -> list[str]:
    """The ids of ``real``/training's point clouds that have a label file."""
    tr = real / "training"
    return sorted(p.stem for p in (tr / "velodyne").glob("*.bin") if (tr / "label_2" / f"{p.stem}.txt").is_file())


def build_fold_root(real: Path, fold: Fold, root: Path) -> Path:
    """A KITTI root at ``root`` whose training/ links ``real``/training and whose ImageSets list the fold's frames:
    ``train.txt`` those it fine-tunes on, ``val.txt`` those it holds out."""
    from detector.data.kitti import write_imageset

    root.mkdir(parents=True, exist_ok=True)
    (root / "training").symlink_to((real / "training").resolve(), target_is_directory=True)
    (root / "ImageSets").mkdir()
    write_imageset(root / "ImageSets" / "train.txt", list(fold.train))
    write_imageset(root / "ImageSets" / "val.txt", list(fold.held_out))
    return root


def checkpoint_choices(ckpt: str | Path) -> list[str]:
    """``group=option`` for the checkpoint's :data:`SHAPING` config groups, as its run chose them (none where its
    saved config does not say)."""
    from detector.callbacks import load_checkpoint

    saved = (load_checkpoint(ckpt).get("hyper_parameters") or {}).get("config") or {}
    choices = saved.get("choices") or {}
    return [f"{g}={choices[g]}" for g in SHAPING if choices.get(g)]


def car_moderate(metrics: dict) -> dict[str, float]:
    """{"bev": AP, "3d": AP}: Car R40 moderate of a metric JSON."""
    return {m: metrics["Car"][m]["R40"]["moderate"] for m in ("bev", "3d")}


def pooled(eval_dirs: list[Path], perfect: bool = False) -> dict[str, float]:
    """Car BEV / 3D AP R40 moderate over the scored files (``label_2``, ``data``) of several evaluations together.

    ``perfect``: the ground truth itself as the detections (score 1): the ceiling of these frames. KITTI's R40 AP
    samples precision at 40 recall points and takes one score threshold per true positive at most, so with N scored
    ground truths of a level it cannot exceed (N - 1) / 40 when N < 41 (a frame or two hold a few Cars)."""
    from dataclasses import replace

    import numpy as np

    from detector.data.kitti_labels import read_label
    from detector.eval.kitti_metric import evaluate

    gts, dts = [], []
    for d in eval_dirs:
        for gt in sorted((d / "label_2").glob("*.txt")):
            gts.append(read_label(gt, with_score=False))
            dts.append(replace(gts[-1], score=np.ones(len(gts[-1].name))) if perfect
                       else read_label(d / "data" / gt.name, with_score=True))
    return car_moderate(evaluate(gts, dts, classes=["Car"], metrics=("bev", "3d"), distance_ranges=None).to_json())


def finetune(ckpt: str, root: Path, run_dir: Path, overrides: list[str]) -> tuple[dict, float, list[str]]:
    """``scripts/train.py init_from=CKPT experiment=finetune data.root=ROOT ...`` in a subprocess; returns (its
    run.json, wall seconds of the whole command, the command)."""
    cmd = [sys.executable, "scripts/train.py", f"init_from={ckpt}", "experiment=finetune", f"data.root={root}",
           f"paths.output_dir={run_dir}", "evaluate_after=false", *overrides]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    if subprocess.run(cmd, cwd=REPO).returncode:  # the run printed its error line
        raise SystemExit(1)
    wall = time.time() - t0
    run = json.loads((run_dir / "run.json").read_text())
    if not run.get("best_ckpt"):
        raise SystemExit(f"error: {run_dir}: fine-tuning wrote no checkpoint")
    return run, wall, cmd


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def mean_ceiling(folds: list[dict]) -> float | None:
    """The mean over folds of their Car BEV ceilings (None where a fold has none)."""
    vals = [f.get("ceiling", {}).get("bev") for f in folds]
    return None if not vals or None in vals else sum(vals) / len(vals)


def markdown(result: dict, argv: list[str]) -> str:
    m = result["meta"]
    g = m["goal"]
    lines = [
        "# Fine-tuning on a few labeled real frames: cross-validation (CPU)", "",
        f"`python scripts/finetune_cv.py {' '.join(argv)}` - {m['machine']}, torch {m['torch']}, {m['threads']} "
        f"threads, allocator {m['env']} (load before {m['load_avg_before']}, after {m['load_avg_after']})", "",
        f"Checkpoint: `{m['checkpoint']}`; real frames: {m['frames']} of `{m['real']}`, {m['folds']} folds; "
        f"fine-tuning command per fold: `{m['command']}`", "",
        "| fold | fine-tuned on | held out | Car BEV AP R40 moderate before | after | fitted | ceiling | Car 3D AP "
        "R40 moderate before | after | fitted | wall s (training loop) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in result["folds"]:
        fit = f.get("fitted", {})
        lines.append(f"| {f['fold']} | {len(f['train'])} | {', '.join(f['held_out'])} | {_fmt(f['before']['bev'])} | "
                     f"{_fmt(f['after']['bev'])} | {_fmt(fit.get('bev'))} | {_fmt(f.get('ceiling', {}).get('bev'))} | "
                     f"{_fmt(f['before']['3d'])} | "
                     f"{_fmt(f['after']['3d'])} | {_fmt(fit.get('3d'))} | {f['wall_s']:.0f} ({f['fit_s']:.0f}) |")
    mean, pool = result["mean"], result["pooled"]
    pfit = pool.get("fitted", {})
    lines.append(f"| mean | | | {_fmt(mean['before']['bev'])} | {_fmt(mean['after']['bev'])} | | | "
                 f"{_fmt(mean['before']['3d'])} | {_fmt(mean['after']['3d'])} | | {mean['wall_s']:.0f} |")
    lines.append("| pooled (held out: every frame by the fold that held it out; fitted: every fold's own frames) | | "
                 f"| {_fmt(pool['before']['bev'])} | {_fmt(pool['after']['bev'])} | {_fmt(pfit.get('bev'))} | "
                 f"{_fmt(pool.get('ceiling', {}).get('bev'))} | "
                 f"{_fmt(pool['before']['3d'])} | {_fmt(pool['after']['3d'])} | {_fmt(pfit.get('3d'))} | |")
    met = result["goal_met"]
    lines += ["", "Fitted: the fine-tuned checkpoint scored on the frames it was fine-tuned on (not a test figure: how "
              "much of them the recipe fits). Ceiling: what a perfect detector scores on the held-out frames (their "
              "own ground truth as detections): KITTI's R40 AP cannot exceed (N - 1) / 40 for N < 41 scored Cars, so "
              "a few frames cap it well below 100 (the fitted frames' ceiling: "
              f"{_fmt(pool.get('fitted_ceiling', {}).get('bev'))}).", "",
              f"Goal: held-out Car BEV AP R40 moderate >= {g['bev_moderate']:.0f} (mean over folds) with a "
              f"fine-tuning run of <= {g['wall_s']:.0f} s: {'**met**' if met else '**not met**'}. A perfect detector "
              f"scores {_fmt(pool.get('ceiling', {}).get('bev'))} pooled on these held-out frames, "
              f"{_fmt(mean_ceiling(result['folds']))} on the mean of the folds."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, {"ckpt_path": "", "real": "../shared/kitti_real", "folds": 4, "recipe": "",
                             "out": "benchmarks/finetune_cv.json", "work": ""}, __doc__)
    ckpt = args["ckpt_path"]
    if not ckpt:
        raise SystemExit("error: ckpt_path= is required (a make train checkpoint, e.g. outputs/train/<time>/"
                         "checkpoints/last.ckpt)")
    ckpt = str(Path(ckpt).resolve())
    real = Path(args["real"]) if Path(args["real"]).is_absolute() else REPO / args["real"]
    if not (real / "training" / "velodyne").is_dir():
        raise SystemExit(f"error: real={args['real']}: no KITTI frames there (expected training/velodyne, label_2, "
                         "calib)")
    folds = make_folds(labeled_frames(real), args["folds"])
    work = Path(args["work"] or outputs_dir() / "finetune_cv" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"error: work={work}: not empty (one folder per measurement)")

    import torch
    from hydra import compose, initialize_config_dir

    from detector.machine import allocator_env, cpu_model
    from detector.resources import config_dir
    from detector.tasks import evaluate_checkpoint

    overrides = [*checkpoint_choices(ckpt), *args["recipe"].split()]
    meta: dict = {"load_avg_before": [round(v, 2) for v in os.getloadavg()],
                  "machine": f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} CPUs",
                  "cpu_model": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "env": allocator_env(), "checkpoint": ckpt, "real": args["real"], "folds": len(folds),
                  "frames": sum(len(f.held_out) for f in folds), "recipe": args["recipe"], "work": str(work),
                  "goal": GOAL}
    rows, before_dirs, after_dirs, fitted_dirs = [], [], [], []
    for fold in folds:
        fdir = work / f"fold{fold.index}"
        root = build_fold_root(real, fold, fdir / "root")
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            data_cfg = compose("eval", overrides=["data=kitti", f"data.root={root}", "ckpt_path=unused"]).data
        before = car_moderate(evaluate_checkpoint(ckpt, data_cfg, fdir / "before", split="val"))
        run, wall, cmd = finetune(ckpt, root, fdir / "run", overrides)
        after = car_moderate(evaluate_checkpoint(run["best_ckpt"], data_cfg, fdir / "after", split="val"))
        fitted = car_moderate(evaluate_checkpoint(run["best_ckpt"], data_cfg, fdir / "fitted", split="train"))
        before_dirs.append(fdir / "before")
        after_dirs.append(fdir / "after")
        fitted_dirs.append(fdir / "fitted")
        rows.append({"fold": fold.index, "train": list(fold.train), "held_out": list(fold.held_out),
                     "before": before, "after": after, "fitted": fitted,
                     "ceiling": pooled([fdir / "after"], perfect=True), "wall_s": round(wall, 1),
                     "fit_s": round(run["fit_s"], 1), "checkpoint": run["best_ckpt"]})
        meta["command"] = " ".join(["python", *cmd[1:]]).replace(str(root), "<fold root>").replace(
            str(fdir / "run"), "<run dir>")
        print(f"fold {fold.index}: held out {', '.join(fold.held_out)}: Car BEV AP R40 moderate "
              f"{before['bev']:.2f} -> {after['bev']:.2f} ({wall:.0f} s)", flush=True)

    def mean(key: str, metric: str) -> float:
        return sum(r[key][metric] for r in rows) / len(rows)

    result = {"folds": rows,
              "mean": {"before": {m: mean("before", m) for m in ("bev", "3d")},
                       "after": {m: mean("after", m) for m in ("bev", "3d")},
                       "wall_s": sum(r["wall_s"] for r in rows) / len(rows)},
              "pooled": {"before": pooled(before_dirs), "after": pooled(after_dirs),
                         "fitted": pooled(fitted_dirs), "ceiling": pooled(after_dirs, perfect=True),
                         "fitted_ceiling": pooled(fitted_dirs, perfect=True)}}
    result["goal_met"] = bool(result["mean"]["after"]["bev"] >= GOAL["bev_moderate"]
                              and max(r["wall_s"] for r in rows) <= GOAL["wall_s"])
    meta["load_avg_after"] = [round(v, 2) for v in os.getloadavg()]
    result["meta"] = meta
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    md = markdown(result, argv)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0
