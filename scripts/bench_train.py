"""The README's main run, sparse and its dense twin, trained the same way; final metrics side by side.

    python scripts/bench_train.py [runs=sparse,dense] [root=data/sim_kitti] [out=benchmarks/train_sim_cpu.json]
                                  [extra="..."] [side_by_side=false] [runs_dir=outputs/bench_train]

``runs``: sparse (the default config, make train's run), dense (its twin), road_map / predicted / ground (the
sparse model under that mask); ``extra``: Hydra overrides added to every run.

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
steps' execution plans over dense, and the bound their active tiles and halos leave).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from detector.cli import parse_args

REPO = Path(__file__).resolve().parents[1]
# sparse: the default config (make train's run); the others: its sparse model under another mask, or the dense twin
OVERRIDES = {"sparse": [], "dense": ["model=dense"], "road_map": ["mask=road_map"], "predicted": ["mask=predicted"],
             "ground": ["mask=ground"]}


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


def main(argv=None) -> int:
    args = parse_args(argv, {"runs": "sparse,dense", "root": "data/sim_kitti", "out": "benchmarks/train_sim_cpu.json",
                             "extra": "", "side_by_side": False, "runs_dir": "outputs/bench_train"}, __doc__)
    import platform

    import torch

    from detector.machine import cpu_model

    cpu = cpu_model()
    result: dict = {"wall_s": {}, "runs": {}, "load_avg_before": os.getloadavg(),
                    "machine": f"{platform.machine()}, {cpu}, {os.cpu_count()} CPUs",
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")}}
    names = args["runs"].split(",")
    unknown = [n for n in names if n not in OVERRIDES]
    if unknown:
        raise SystemExit(f"error: runs={args['runs']}: unknown run {unknown[0]!r}; choose from {', '.join(OVERRIDES)}")
    env = dict(os.environ)
    if args["side_by_side"]:
        threads = max(1, (os.cpu_count() or 1) // len(names))
        env["OMP_NUM_THREADS"] = str(threads)
        result["threads"] = threads
    result["side_by_side"] = bool(args["side_by_side"])
    started = {}
    for name in names:
        out_dir = REPO / args["runs_dir"] / f"{name}_{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        cmd = [sys.executable, "scripts/train.py", f"data.root={args['root']}", f"paths.output_dir={out_dir}",
               *OVERRIDES[name], *args["extra"].split()]
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
    pending = list(names) if args["side_by_side"] else []
    while pending:  # each run's wall time ends when it ends, not when the one started before it ends
        done = [name for name in pending if started[name][0].poll() is not None]
        for name in done:
            _finish(name, started[name], result)
            pending.remove(name)
        if pending and not done:
            time.sleep(0.2)
    if any(name not in result["wall_s"] for name in names):
        return 1
    result["load_avg_after"] = os.getloadavg()
    out = Path(args["out"])
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
    for name in [n for n in w if n != "dense"] if "dense" in w else []:
        notes.append(f"{name} / dense: wall {w[name] / w['dense']:.2f}, training (fit) {f[name] / f['dense']:.2f}.")
    for name, p in result.get("plan", {}).items():
        if p:
            notes.append(f"{name}: the plans of its {p['steps']} training steps convolve {p['mac_ratio']:.2f} of the "
                         f"dense MACs on average; the active tiles and halos bound it at {p['mac_bound']:.2f} (every "
                         f"stage at its fewest MACs), i.e. a conv-only speedup bound of "
                         f"{1 / p['mac_bound'] if p['mac_bound'] else float('inf'):.2f}x.")
    out.with_suffix(".md").write_text(
        "# Training on the simulated sample (CPU, 2 cores)\n\n`python scripts/bench_train.py "
        + " ".join(argv if argv is not None else sys.argv[1:]) + f"` - {result['machine']}, torch {result['torch']}, "
        + ("the runs side by side, " if result["side_by_side"] else "one run after the other, ")
        + f"{result['threads']} threads each, allocator {result['env']} (load before "
        + f"{result['load_avg_before']}, after {result['load_avg_after']})\n\n" + "\n".join(rows) + "\n\n"
        + "\n".join(notes) + "\n")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
