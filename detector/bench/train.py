"""The README's main run, sparse and its dense twin, trained the same way; final metrics side by side.

    python scripts/bench_train.py [runs=sparse,dense] [root=data/sim_kitti] [out=benchmarks/train_sim_cpu.json]
                                  [extra="..."] [side_by_side=false] [runs_dir=outputs/bench_train] [steps=8]
                                  [seeds=] [from_json=]

``runs``: sparse (the default config, make train's run), dense (its twin), road_map / predicted / ground (the
sparse model under that mask); ``extra``: Hydra overrides added to every run.

``seeds=0,1,2``: every run once per seed (``seed=K``), named ``<run>@<seed>``, each compared with the dense twin
of its own seed; the table adds each run's Car BEV AP R40 moderate and wall time over dense per seed and their
means (``summary``). One run's AP on the 60 val frames moves with the seed alone (benchmarks/train_seeds/ holds
the spread), so "within 0.5 of dense" is judged on the means.
One after the other, the order alternates per seed (sparse, dense, dense, sparse, ...), so a steady drift of
the machine's speed meets both alike.

``side_by_side=true`` runs them at the same time, the cores split evenly between them
(``OMP_NUM_THREADS``): on a machine that other work also loads, both then see the same load, so their
ratio stays fair where one-after-the-other runs would each meet a different load (the table says how it
ran; one thread per run favours the run of more, smaller operations - the sparse one - a little less
than the threads it would share otherwise).

Each run is ``scripts/train.py data.root=ROOT [model=dense]`` in a subprocess (the default schedule,
then the evaluation of its best checkpoint on the val split). Writes
``{"dense": <metric JSON>, "sparse": <metric JSON>, "wall_s": {"dense": .., "sparse": ..}, "fit_s": {..},
"plan": {"sparse": {"mac_ratio", "mac_bound", "steps"}, "dense": null}, ...}`` and a markdown table beside it
(``fit_s``: training alone, without setup and the final evaluation; ``plan``: the mean MACs of the training
steps' execution plans over dense, and the bound their active tiles and halos leave; ``train_step_ms``: each
run's ms per step over its course, from its own TensorBoard log - :func:`logged_step_ms`).

Where a step's time goes (``steps``, 0: skipped): after the runs, each run's best checkpoint trains ``steps`` more
steps in this process (after 2 warm-up steps; AdamW at a small learning rate) on batches of its own training
loader, the runs taking turns step by step, so that a drift of the machine's speed meets them alike; recorded as
``steps_ms[run]``: median ms per step of loading a batch, voxelize, mask, plan, each backbone stage and the
neck + head (forward), loss, backward, optimizer step, and the whole step. ``from_json=PATH`` skips training
and measures the breakdown for the runs and checkpoints of an earlier result (written to ``out``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from detector.cli import parse_args

REPO = Path(__file__).resolve().parents[2]
# sparse: the default config (make train's run); the others: its sparse model under another mask, or the dense twin
OVERRIDES = {"sparse": [], "dense": ["model=dense"], "road_map": ["mask=road_map"], "predicted": ["mask=predicted"],
             "ground": ["mask=ground"]}


def run_key(name: str, seed: int | None) -> str:
    return name if seed is None else f"{name}@{seed}"


def run_name(key: str) -> str:
    """The run of a result key (``sparse@1`` -> ``sparse``)."""
    return key.partition("@")[0]


def _dense_of(key: str) -> str:
    """The dense twin's key beside ``key`` (same seed)."""
    return "dense" + key[len(run_name(key)):]


def _finish(name: str, started: tuple, result: dict) -> None:
    """Wait for one run; record its wall time, metrics, training time and plan summary (nothing if it failed:
    it printed its own error line)."""
    proc, t0, out_dir, cmd, log = started
    code = proc.wait()
    wall = time.time() - t0
    if log is not None:
        log.close()
    if code:
        print(f"error: the {name} run failed (exit {code}); see its output above or in {out_dir / 'train.log'}",
              file=sys.stderr)
        return
    run = json.loads((out_dir / "run.json").read_text())
    result[name] = run["metrics"]
    result["wall_s"][name] = round(wall, 1)
    result.setdefault("fit_s", {})[name] = round(run.get("fit_s", float("nan")), 1)
    result.setdefault("plan", {})[name] = run.get("plan")
    result["runs"][name] = {"command": " ".join(cmd[1:]), "output_dir": str(out_dir), "best_ckpt": run["best_ckpt"]}
    result.setdefault("train_step_ms", {})[name] = logged_step_ms(out_dir / "tensorboard")


def logged_step_ms(tb_dir: Path) -> dict | None:
    """A run's training speed over its course, from its own TensorBoard log: the wall time between consecutive
    ``train/loss`` points over the steps between them, median over the run and over each quarter of it (an
    interval holding a validation is one of many: the medians pass over it). A drift of the machine's speed
    during one-after-the-other runs shows as quarters that differ, where the wall times alone hide it. None
    without a log (logger=none) or with fewer than 8 intervals."""
    import statistics

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for f in sorted(tb_dir.glob("events.out.tfevents.*")) if tb_dir.is_dir() else []:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if "train/loss" in acc.Tags().get("scalars", []):
            points += [(e.step, e.wall_time) for e in acc.Scalars("train/loss")]
    points.sort()
    per_step = [1e3 * (t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(points, points[1:], strict=False) if s1 > s0]
    if len(per_step) < 8:
        return None
    q = len(per_step) // 4
    return {"median": round(statistics.median(per_step), 1),
            "quarters": [round(statistics.median(per_step[i * q:(i + 1) * q]), 1) for i in range(4)]}


def step_breakdown(ckpts: dict[str, str], root: str, steps: int, settings: dict[str, dict] | None = None,
                   train: bool = True) -> dict[str, dict[str, float]]:
    """Median ms per training step, by part (loading a batch, the forward's timed parts - voxelize, mask, plan,
    ``backbone/<stage>`` and their sum ``backbone``, ``head`` (the neck and the head) - then forward, loss,
    backward, optimizer and the step), of each checkpoint's detector on batches of its own training loader; the runs
    take turns step by step. ``settings[run]``: attributes set on that run's detector (e.g.
    ``{"use_data_mask": False}``: one checkpoint timed two ways). ``train`` False: inference
    instead (eval mode, no autograd) on batches of the val loader - forward and step only."""
    import statistics

    import torch
    from omegaconf import open_dict

    from detector.build import load_detector
    from detector.tasks import build_datamodule

    runs, warmup = {}, 2
    for name, path in ckpts.items():
        model, cfg = load_detector(path)
        with open_dict(cfg):
            cfg.data.root = root
        dm = build_datamodule(cfg.data, cfg.mask, model.grid, bool(cfg.model.sparse))
        dm.setup("fit")
        make_loader = dm.train_dataloader if train else dm.val_dataloader
        loader, batches, acc = iter(make_loader()), [], {"load": []}
        for i in range(warmup + steps):
            t = time.perf_counter()
            batch = next(loader, None)
            if batch is None:  # a small split: its next epoch
                loader = iter(make_loader())
                batch = next(loader)
            batches.append(batch)
            if i >= warmup:
                acc["load"].append(time.perf_counter() - t)
        for key, value in (settings or {}).get(name, {}).items():
            setattr(model, key, value)
        model.train(train)
        model.timing = True  # per-stage forward times (synchronizes on CUDA only)
        runs[name] = (model, batches, torch.optim.AdamW(model.parameters(), lr=1e-5), acc)
    for i in range(warmup + steps):
        for model, batches, opt, acc in runs.values():
            t0 = time.perf_counter()
            with torch.set_grad_enabled(train):
                out = model(batches[i])
            t1 = time.perf_counter()
            parts = {"forward": t1 - t0, "step": t1 - t0}
            if train:
                loss, _ = model.loss(out, batches[i])
                t2 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                t3 = time.perf_counter()
                opt.step()
                t4 = time.perf_counter()
                parts = {"forward": t1 - t0, "loss": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3,
                         "step": t4 - t0}
            if i < warmup:
                continue
            for k, v in {**out.times, **parts}.items():
                if k != "start":
                    acc.setdefault(k, []).append(v)
    return {name: {k: round(statistics.median(v) * 1e3, 1) for k, v in acc.items()}
            for name, (_, _, _, acc) in runs.items()}


def _step_table(steps_ms: dict[str, dict[str, float]]) -> list[str]:
    names = sorted(steps_ms, key=lambda n: n == "dense")  # the dense twin last, beside the ratios to it
    ratios = [n for n in names if n != "dense"] if "dense" in steps_ms else []
    rows = ["| part (median ms / step) | " + " | ".join(names) + "".join(f" | {n} / dense" for n in ratios) + " |",
            "|---|" + "---|" * (len(names) + len(ratios))]
    parts = list(dict.fromkeys(k for n in names for k in steps_ms[n]))  # the sparse runs' parts are a superset
    for part in parts:
        vals = [steps_ms[n].get(part) for n in names]
        cells = ["-" if v is None else f"{v:.1f}" for v in vals]
        d = steps_ms["dense"].get(part) if ratios else None
        for n in ratios:
            v = steps_ms[n].get(part)
            cells.append(f"{v / d:.2f}" if v is not None and d else "-")
        rows.append(f"| {part} | " + " | ".join(cells) + " |")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv, {"runs": "sparse,dense", "root": "data/sim_kitti", "out": "benchmarks/train_sim_cpu.json",
                             "extra": "", "side_by_side": False, "runs_dir": "outputs/bench_train", "steps": 8,
                             "seeds": "", "from_json": ""}, __doc__)
    if args["from_json"]:
        result = json.loads(Path(args["from_json"]).read_text())
        missing = [n for n in result["wall_s"] if not Path(result["runs"][n]["best_ckpt"]).is_file()]
        if missing:
            raise SystemExit(f"error: from_json={args['from_json']}: the checkpoint of run {missing[0]!r} is gone "
                             f"({result['runs'][missing[0]]['best_ckpt']})")
        # an earlier result without its command: the runs' arguments it records
        side = str(result["side_by_side"]).lower()
        result.setdefault("command", f"runs={','.join(result['wall_s'])} side_by_side={side}")
        _add_steps(result, args)
        _write(result, Path(args["out"]))
        return 0
    import platform

    import torch

    from detector.machine import allocator_env, cpu_model

    cpu = cpu_model()
    result: dict = {"command": " ".join(argv if argv is not None else sys.argv[1:]), "wall_s": {}, "runs": {},
                    "load_avg_before": os.getloadavg(),
                    "machine": f"{platform.machine()}, {cpu}, {os.cpu_count()} CPUs",
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "env": allocator_env()}
    names = args["runs"].split(",")
    unknown = [n for n in names if n not in OVERRIDES]
    if unknown:
        raise SystemExit(f"error: runs={args['runs']}: unknown run {unknown[0]!r}; choose from {', '.join(OVERRIDES)}")
    try:
        seeds = [int(v) for v in args["seeds"].split(",")] if args["seeds"] else [None]
    except ValueError:
        raise SystemExit(f"error: seeds={args['seeds']!r}: expected integers separated by commas") from None
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"error: seeds={args['seeds']!r}: a seed is listed twice")
    # one after the other, the order alternates per seed (A B, B A, A B, ...): a steady drift meets both alike
    jobs = [(n, s) for i, s in enumerate(seeds) for n in (names if i % 2 == 0 else names[::-1])]
    if seeds != [None]:
        result["seeds"] = seeds
    env = dict(os.environ)
    if args["side_by_side"]:
        threads = max(1, (os.cpu_count() or 1) // len(jobs))
        env["OMP_NUM_THREADS"] = str(threads)
        result["threads"] = threads
    result["side_by_side"] = bool(args["side_by_side"])
    started = {}
    for run, seed in jobs:
        name = run_key(run, seed)
        stamp = time.strftime('%Y-%m-%d_%H-%M-%S')
        out_dir = REPO / args["runs_dir"] / (f"{run}_{stamp}" if seed is None else f"{run}_seed{seed}_{stamp}")
        cmd = [sys.executable, "scripts/train.py", f"data.root={args['root']}", f"paths.output_dir={out_dir}",
               *OVERRIDES[run], *args["extra"].split(), *([] if seed is None else [f"seed={seed}"])]
        print(" ".join(cmd), flush=True)
        log = None
        if args["side_by_side"]:  # two progress bars on one terminal are unreadable: each run logs to a file
            out_dir.mkdir(parents=True, exist_ok=True)
            log = open(out_dir / "train.log", "w")  # noqa: SIM115 (closed when the run ends)
            print(f"  its output: {out_dir / 'train.log'}", flush=True)
        started[name] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log), time.time(), out_dir, cmd,
                         log)
        if not args["side_by_side"]:
            _finish(name, started[name], result)
            if name not in result["wall_s"]:
                return 1
    keys = [run_key(n, s) for n, s in jobs]
    pending = list(keys) if args["side_by_side"] else []
    while pending:  # each run's wall time ends when it ends, not when the one started before it ends
        done = [name for name in pending if started[name][0].poll() is not None]
        for name in done:
            _finish(name, started[name], result)
            pending.remove(name)
        if pending and not done:
            time.sleep(0.2)
    if any(key not in result["wall_s"] for key in keys):
        return 1
    result["load_avg_after"] = os.getloadavg()
    _add_steps(result, args)
    _write(result, Path(args["out"]))
    return 0


def _add_steps(result: dict, args: dict) -> None:
    if args["steps"] > 0:
        import torch

        # with seeds: the first seed's checkpoints (the breakdown's parts do not depend on the seed)
        first = result.get("seeds", [None])[0]
        ckpts = {run_name(k): result["runs"][k]["best_ckpt"] for k in result["wall_s"]
                 if k == run_key(run_name(k), first)}
        result["steps_ms"] = step_breakdown(ckpts, args["root"], args["steps"])
        result["steps_meta"] = {"steps": args["steps"], "threads": torch.get_num_threads(),
                                "command": "python scripts/bench_train.py " + " ".join(
                                    f"{k}={args[k]}" for k in ("root", "steps", "from_json") if args[k] != "")}


def _seed_summary(result: dict) -> dict:
    """Per run: Car BEV AP R40 moderate and wall time over the dense twin at each seed, and their means."""
    import statistics

    out = {}
    for name in dict.fromkeys(run_name(k) for k in result["wall_s"]):
        keys = [run_key(name, s) for s in result["seeds"]]
        ap = [result[k]["Car"]["bev"]["R40"]["moderate"] for k in keys]
        w = result["wall_s"]
        ratio = None if name == "dense" else [w[k] / w[_dense_of(k)] if _dense_of(k) in w else None for k in keys]
        known = [r for r in ratio or [] if r is not None]
        out[name] = {"bev_moderate": ap, "bev_moderate_mean": statistics.fmean(ap),
                     "wall_vs_dense": ratio or [None] * len(keys),
                     "wall_vs_dense_mean": statistics.fmean(known) if known else None}
    return out


def _write(result: dict, out: Path) -> None:
    if result.get("seeds"):
        result["summary"] = _seed_summary(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    rows = ["| model | metric | easy | moderate | hard | wall s |", "|---|---|---|---|---|---|"]
    for name in result["wall_s"]:
        for metric in ("bev", "3d", "2d", "aos"):
            r = result[name]["Car"][metric]["R40"]
            rows.append(f"| {name} | Car {metric} AP R40 | {r['easy']:.2f} | {r['moderate']:.2f} | {r['hard']:.2f} | "
                        f"{result['wall_s'][name]:.0f} |")
    notes = []
    w, f = result["wall_s"], result.get("fit_s", {})
    for name in w:
        d = _dense_of(name)
        if name != d and d in w:
            notes.append(f"{name} / {d}: wall {w[name] / w[d]:.2f}, training (fit) {f[name] / f[d]:.2f}.")
    if result.get("seeds"):
        rows += ["", "Over the seeds (Car BEV AP R40 moderate; wall time over the dense twin of the same seed):", "",
                 "| model | " + " | ".join(f"seed {s}" for s in result["seeds"]) + " | mean |",
                 "|---|" + "---|" * (len(result["seeds"]) + 1)]
        for name, v in result["summary"].items():
            cells = [f"{a:.2f}" + ("" if r is None else f" ({r:.2f}x)") for a, r in zip(v["bev_moderate"],
                                                                                    v["wall_vs_dense"], strict=True)]
            mean = f"{v['bev_moderate_mean']:.2f}" + ("" if v["wall_vs_dense_mean"] is None
                                                      else f" ({v['wall_vs_dense_mean']:.2f}x)")
            rows.append(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    for name, p in result.get("plan", {}).items():
        if p:
            notes.append(f"{name}: the plans of its {p['steps']} training steps convolve {p['mac_ratio']:.2f} of the "
                         f"dense MACs on average; the active tiles and halos bound it at {p['mac_bound']:.2f} (every "
                         f"stage at its fewest MACs), i.e. a conv-only speedup bound of "
                         f"{1 / p['mac_bound'] if p['mac_bound'] else float('inf'):.2f}x.")
    logged = {n: v for n, v in result.get("train_step_ms", {}).items() if v}
    if logged:
        notes.append("Training speed over each run (its TensorBoard log: ms per step between logged steps, loading and "
                     "optimizer included; median, then the medians of the run's four quarters): " + "; ".join(
                         f"{n} {v['median']:.0f} ({' / '.join(f'{x:.0f}' for x in v['quarters'])})"
                         for n, v in logged.items()) + ".")
    if result.get("steps_ms"):
        m = result["steps_meta"]
        notes += ["", f"Where a training step's time goes (`{m['command']}`: each run's best checkpoint, {m['steps']} "
                  f"steps after 2 warm-up ones in one process, the runs taking turns, {m['threads']} threads; the "
                  "backward is not split by stage):", "", *_step_table(result["steps_ms"])]
    out.with_suffix(".md").write_text(
        "# Training on the simulated sample (CPU, 2 cores)\n\n`python scripts/bench_train.py "
        + result["command"] + f"` - {result['machine']}, torch {result['torch']}, "
        + ("the runs side by side, " if result["side_by_side"] else "one run after the other, ")
        + f"{result['threads']} threads each, allocator {result['env']} (load before "
        + f"{result['load_avg_before']}, after {result['load_avg_after']})\n\n" + "\n".join(rows) + "\n\n"
        + "\n".join(notes) + "\n")
    print(out.with_suffix(".md").read_text())
