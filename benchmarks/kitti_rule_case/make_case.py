"""The constructed case: 3 frames where the devkit's rules and our old ones give different AP.

    python benchmarks/kitti_rule_case/make_case.py benchmarks/kitti_rule_case   # writes label_2/ and results/
"""

import sys
from pathlib import Path

out = Path(sys.argv[1])
(out / "label_2").mkdir(parents=True, exist_ok=True)
(out / "results").mkdir(exist_ok=True)


def line(i, top, bottom, score=None, name="Car"):
    u, x, z = 60 * i, 8.0 * (i % 10) - 40.0, 10.0 + 8.0 * (i // 10)
    s = f"{name} 0.00 0 0.00 {u} {top} {u + 50} {bottom} 1.50 1.60 4.00 {x:.2f} 1.60 {z:.2f} 0.00"
    return s if score is None else f"{s} {score}"

# frame 0: 41 Cars found (distinct scores) + one GT exactly 40.00 px high, not detected.
gt0 = [line(i, "100.00", "150.00") for i in range(41)] + [line(41, "100.00", "140.00")]
dt0 = [line(i, "100.00", "150.00", f"{0.9 - 0.001 * i:.3f}") for i in range(41)]
# frame 1: 20 Cars found, each with a false positive scored 1e-9 below it (a float32 tie).
gt1 = [line(i, "100.00", "150.00") for i in range(20)]
dt1 = [line(i, "100.00", "150.00", f"{0.8 - 0.001 * i:.3f}") for i in range(20)]
dt1 += [line(30 + i, "100.00", "150.00", f"{0.8 - 0.001 * i - 1e-9:.12f}") for i in range(20)]
# frame 2: 2 Cars, one found by a detection scored at the devkit's NO_DETECTION (-1e7).
gt2 = [line(i, "100.00", "150.00") for i in range(2)]
dt2 = [line(0, "100.00", "150.00", "0.7"), line(1, "100.00", "150.00", "-10000000")]
for k, (g, d) in enumerate([(gt0, dt0), (gt1, dt1), (gt2, dt2)]):
    (out / "label_2" / f"{k:06d}.txt").write_text("\n".join(g) + "\n")
    (out / "results" / f"{k:06d}.txt").write_text("\n".join(d) + "\n")
