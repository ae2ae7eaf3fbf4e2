"""The README's main run, sparse and its dense twin, trained the same way; final metrics side by side.

    python scripts/bench_train.py [runs=sparse,dense] [root=data/sim_kitti] [out=benchmarks/train_sim_cpu.json]
                                  [extra="..."]   (Hydra overrides added to every run)

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
OVERRIDES = {"sparse": [], "dense": ["model=dense"]}


def main(argv=None) -> int:
    args = parse_args(argv, {"runs": "sparse,dense", "root": "data/sim_kitti", "out": "benchmarks/train_sim_cpu.json",
                             "extra": ""}, __doc__)
    import platform

    import torch

    from detector.machine import cpu_model

    cpu = cpu_model()
    result: dict = {"wall_s": {}, "runs": {}, "load_avg_before": os.getloadavg(),
                    "machine": f"{platform.machine()}, {cpu}, {os.cpu_count()} CPUs",
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")}}
    for name in args["runs"].split(","):
        out_dir = REPO / "outputs" / "bench_train" / f"{name}_{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        cmd = [sys.executable, "scripts/train.py", f"data.root={args['root']}", f"paths.output_dir={out_dir}",
               *OVERRIDES[name], *args["extra"].split()]
        print(" ".join(cmd), flush=True)
        t0 = time.time()
        if subprocess.run(cmd, cwd=REPO).returncode:  # the run printed its error line
            return 1
        run = json.loads((out_dir / "run.json").read_text())
        result[name] = run["metrics"]
        result["wall_s"][name] = round(time.time() - t0, 1)
        result.setdefault("fit_s", {})[name] = round(run.get("fit_s", float("nan")), 1)
        result.setdefault("plan", {})[name] = run.get("plan")
        result["runs"][name] = {"command": " ".join(cmd[1:]), "output_dir": str(out_dir), "best_ckpt": run["best_ckpt"]}
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
    if {"sparse", "dense"} <= set(result["wall_s"]):
        w, f = result["wall_s"], result["fit_s"]
        notes.append(f"sparse / dense: wall {w['sparse'] / w['dense']:.2f}, "
                     f"training (fit) {f['sparse'] / f['dense']:.2f}.")
    for name, p in result.get("plan", {}).items():
        if p:
            notes.append(f"{name}: the plans of its {p['steps']} training steps convolve {p['mac_ratio']:.2f} of the "
                         f"dense MACs on average; the active tiles and halos bound it at {p['mac_bound']:.2f} (every "
                         f"stage at its fewest MACs), i.e. a conv-only speedup bound of "
                         f"{1 / p['mac_bound'] if p['mac_bound'] else float('inf'):.2f}x.")
    out.with_suffix(".md").write_text(
        "# Training on the simulated sample (CPU, 2 cores)\n\n`python scripts/bench_train.py "
        + " ".join(argv if argv is not None else sys.argv[1:]) + f"` - {result['machine']}, torch {result['torch']}, "
        + f"{result['threads']} threads, allocator {result['env']} (load before "
        + f"{result['load_avg_before']}, after {result['load_avg_after']})\n\n" + "\n".join(rows) + "\n\n"
        + "\n".join(notes) + "\n")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
