"""scripts/bench_sim2real.py end to end on hand-built KITTI frames and tiny checkpoints: per mask the evaluation's
metrics.json plus recall by distance, a mask the checkpoint cannot run reported as not available, images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from detector.bench import sim2real as bench
from detector.data.kitti_labels import read_label
from tests.eval.test_app import car_root, oracle, predicted_ckpt  # noqa: F401 (fixtures)
from tests.paths import REPO


def _distances(root: Path) -> np.ndarray:
    d = [np.hypot(lab.location[:, 0], lab.location[:, 2]) for lab in
         (read_label(p, with_score=False) for p in sorted((root / "training" / "label_2").glob("*.txt")))]
    return np.concatenate(d)


def test_bench_on_ground_truth_detections(car_root, predicted_ckpt, oracle, tmp_path):  # noqa: F811
    """A model that outputs the ground truth: AP 100 and recall 1 in every band that has ground truth, for every
    mask; each mask's entry is exactly the metrics.json its evaluation wrote, plus the recall."""
    out = tmp_path / "bench" / "sim2real.json"
    assert bench.main([f"ckpt_path={predicted_ckpt}", f"real={car_root}", f"out={out}", "images=1",
                           f"images_dir={tmp_path / 'img'}"]) == 0
    res = json.loads(out.read_text())
    dist = _distances(car_root)  # all 96 cars are inside the TINY grid
    expected_gt = {"0-20": int((dist < 20).sum()), "20-40": int(((dist >= 20) & (dist < 40)).sum()), "40+": 0,
                   "within 40": 96}
    assert expected_gt["0-20"] > 0  # (the other bands: test_recall_counts_a_car_only_above_the_iou)
    for mask in ("none", "ground", "predicted"):
        r = res[mask]
        assert r["Car"]["bev"]["R40"]["moderate"] == 100.0 and r["Car"]["3d"]["R40"]["easy"] == 100.0
        written = json.loads((Path(res["meta"]["output_dir"]) / mask / "metrics.json").read_text())
        assert {k: v for k, v in r.items() if k != "recall"} == written
        for band, n in expected_gt.items():
            rec = r["recall"][band]
            assert rec["gt"] == n, (mask, band)
            want = 1.0 if n else None
            assert rec["recall_bev_0.5"] == want and rec["recall_bev_0.7"] == want
    assert res["meta"]["frames"] == 12 and res["meta"]["checkpoint"] == str(predicted_ckpt)
    md = out.with_suffix(".md").read_text()
    assert "| none | 100.00 | 100.00 | 100.00 | 100.00 |" in md and "| predicted | 100.00" in md
    pngs = sorted(p.name for p in (tmp_path / "img").glob("*.png"))
    assert pngs == ["000000_ground.png", "000000_none.png"]  # the first frame, the first two masks


def test_recall_counts_a_car_only_above_the_iou(tmp_path):
    """Hand-built files: one GT car and a detection shifted along its length. Shift s of a 4 m car (same width):
    IoU = (4 - s) / (4 + s): s = 1 -> 0.6 (found at 0.5, not 0.7), s = 0.2 -> 0.905 (found at both); a GT at 45 m
    without detection counts in 40+ only."""
    from detector.data.kitti_labels import KittiLabels, write_label

    def labels(rows, score=None):
        n = len(rows)
        return KittiLabels(
            name=np.array(["Car"] * n), truncated=np.zeros(n), occluded=np.zeros(n, np.int64), alpha=np.zeros(n),
            bbox=np.tile([100.0, 100.0, 200.0, 200.0], (n, 1)), dimensions=np.tile([1.5, 1.8, 4.0], (n, 1)),
            location=np.array([[0.0, 1.6, z] for z in rows]), rotation_y=np.full(n, np.pi / 2),
            score=None if score is None else np.full(n, score))

    for shift, found in ((1.0, (True, False)), (0.2, (True, True))):
        gt_dir, res_dir = tmp_path / f"gt{shift}", tmp_path / f"res{shift}"
        gt_dir.mkdir()
        res_dir.mkdir()
        write_label(gt_dir / "000000.txt", labels([10.0, 45.0]))
        write_label(res_dir / "000000.txt", labels([10.0 + shift], score=0.9))  # ry = pi/2: length along z
        rec = bench.recall_by_distance(gt_dir, res_dir)
        assert rec["0-20"] == {"gt": 1, "recall_bev_0.5": float(found[0]), "recall_bev_0.7": float(found[1])}
        assert rec["40+"] == {"gt": 1, "recall_bev_0.5": 0.0, "recall_bev_0.7": 0.0}
        assert rec["20-40"] == {"gt": 0, "recall_bev_0.5": None, "recall_bev_0.7": None}
        assert rec["within 40"]["gt"] == 1


def test_predicted_without_a_mask_net_is_not_available(car_root, predicted_ckpt, tmp_path):  # noqa: F811
    """A checkpoint without mask-net weights (as one trained with mask=road_map): mask=predicted is reported as
    not available with the reason; the other masks are evaluated."""
    path = _without_mask_net(predicted_ckpt, tmp_path / "no_mask_net.ckpt")
    out = tmp_path / "sim2real.json"
    assert bench.main([f"ckpt_path={path}", f"real={car_root}", f"out={out}", "images=0",
                           "masks=none,predicted"]) == 0
    res = json.loads(out.read_text())
    assert res["predicted"]["available"] is False and "has no trained mask net" in res["predicted"]["reason"]
    assert 0.0 <= res["none"]["Car"]["bev"]["R40"]["moderate"] <= 100.0
    assert "| predicted | not available: mask: " in out.with_suffix(".md").read_text()


def test_bench_without_real_frames_says_so_in_one_line(car_root, tmp_path):  # noqa: F811
    with pytest.raises(SystemExit, match=r"error: .*missing: no real KITTI frames there"):
        bench.main([f"real={tmp_path / 'missing'}", "ckpt_path=x.ckpt"])
    with pytest.raises(SystemExit, match="unknown mask 'road'"):
        bench.main([f"real={car_root}", "masks=none,road"])


def test_bench_trains_a_checkpoint_when_none_is_given(tiny_root, car_root, tmp_path):  # noqa: F811
    """Without ckpt_path: scripts/train.py on train_root (here with the TINY settings and one step), then the
    evaluation of its checkpoint; the JSON records the training command."""
    from tests.test_train import TINY

    extra = " ".join([*TINY, "trainer.max_steps=1", "trainer.limit_val_batches=0", "evaluate_after=false",
                      "logger=none", "callbacks.model_checkpoint.monitor=null"])
    out = tmp_path / "sim2real.json"
    assert bench.main([f"train_root={tiny_root}", f"real={car_root}", f"out={out}", "images=0", "masks=none",
                           f"extra={extra}"]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["train_command"].startswith(f"python scripts/train.py data.root={tiny_root}")
    assert Path(meta["checkpoint"]).is_file() and "trainer.max_steps=1" in meta["train_command"]


def _without_mask_net(ckpt_path, path: Path) -> Path:
    """``ckpt_path`` without its mask-net weights, as a checkpoint trained with mask=road_map."""
    from detector.callbacks import load_checkpoint

    ckpt = load_checkpoint(ckpt_path)
    ckpt["state_dict"] = {k: v for k, v in ckpt["state_dict"].items() if ".mask_net." not in k}
    ckpt["hyper_parameters"]["config"]["mask"] = {"provider": None, "net": None}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


@pytest.mark.parametrize("broken", ["no calib", "no label_2", "bad calib file"])
def test_a_bad_real_root_is_named_as_the_user_gave_it(car_root, predicted_ckpt, tmp_path, broken):  # noqa: F811
    """The real frames are read through a temporary view (its training/ links the real one): an error about one
    of them names the file under the user's real root, not under /tmp/tmpXXXX/training."""
    import shutil

    real = tmp_path / "real"
    shutil.copytree(car_root, real)
    if broken == "no calib":
        shutil.rmtree(real / "training" / "calib")
        want = str(real / "training" / "calib" / "000000.txt")
    elif broken == "no label_2":
        shutil.rmtree(real / "training" / "label_2")
        want = str(real / "training" / "label_2")
    else:
        (real / "training" / "calib" / "000003.txt").write_text("P2: 1 2\n")
        want = str(real / "training" / "calib" / "000003.txt") + ":1:"
    with pytest.raises(SystemExit) as e:
        bench.main([f"ckpt_path={predicted_ckpt}", f"real={real}", f"out={tmp_path / 'o.json'}", "images=0",
                        "masks=none"])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg
    assert want in msg, msg
    assert msg.count("/training") == msg.count(str(real / "training"))  # no temporary view left in the line
    assert not (tmp_path / "o.json").exists()


def test_predicted_mask_from_a_second_checkpoint(car_root, predicted_ckpt, oracle, tmp_path):  # noqa: F811
    """ckpt_path without a mask net (as make train's, mask=road_map) and predicted_ckpt_path trained with
    mask=predicted: one run evaluates all three masks, predicted with the second checkpoint, under their names."""
    main_ckpt = _without_mask_net(predicted_ckpt, tmp_path / "road" / "checkpoints" / "last.ckpt")
    out = tmp_path / "sim2real.json"
    assert bench.main([f"ckpt_path={main_ckpt}", f"predicted_ckpt_path={predicted_ckpt}", f"real={car_root}",
                           f"out={out}", "images=0"]) == 0
    res = json.loads(out.read_text())
    for mask in ("none", "ground", "predicted"):
        assert res[mask]["Car"]["bev"]["R40"]["moderate"] == 100.0, mask
    assert res["predicted"]["_run"]["checkpoint"] == str(predicted_ckpt)
    assert res["none"]["_run"]["checkpoint"] == res["ground"]["_run"]["checkpoint"] == str(main_ckpt)
    assert res["meta"]["checkpoint"] == str(main_ckpt) and res["meta"]["predicted_checkpoint"] == str(predicted_ckpt)
    md = out.with_suffix(".md").read_text()
    assert "| predicted | 100.00 | 100.00 |" in md and f"mask=predicted: `{predicted_ckpt}`" in md
    with pytest.raises(SystemExit, match="has no predicted"):
        bench.main([f"ckpt_path={main_ckpt}", f"predicted_ckpt_path={predicted_ckpt}", f"real={car_root}",
                        "masks=none"])
    with pytest.raises(SystemExit, match="predicted_ckpt_path=.*missing.ckpt: no such checkpoint"):
        bench.main([f"ckpt_path={main_ckpt}", f"predicted_ckpt_path={tmp_path / 'missing.ckpt'}",
                        f"real={car_root}"])


def test_moonshot_status_and_before_after(car_root, predicted_ckpt, oracle, tmp_path):  # noqa: F811
    """The markdown says where the moonshot stands (from this run's figures and the checkpoint's simulated val)
    and, with baseline= a previous run's JSON (here the committed one without its predicted entry), each mask's
    figures before and after and the masks it lacks."""
    import shutil

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = shutil.copy(predicted_ckpt, run / "checkpoints" / "best.ckpt")
    sv = {"easy": 95.0, "moderate": 91.5, "hard": 90.0}
    (run / "run.json").write_text(json.dumps({"metrics": {"Car": {"bev": {"R40": sv}, "3d": {"R40": sv}}}}))
    # the committed run's JSON without its predicted entry: a baseline that lacks a mask this run has
    base = json.loads((REPO / "benchmarks" / "sim2real_cpu.json").read_text())
    base.pop("predicted", None)
    committed = tmp_path / "baseline.json"
    committed.write_text(json.dumps(base))
    out = tmp_path / "sim2real.json"
    assert bench.main([f"ckpt_path={ckpt}", f"real={car_root}", f"out={out}", "images=0",
                           f"baseline={committed}"]) == 0
    meta = json.loads(out.read_text())["meta"]
    ms = meta["moonshot"]
    assert ms["met"] is True and set(ms["masks"]) == {"none", "ground", "predicted"}
    assert ms["masks"]["none"] == {"real_bev_moderate": 100.0, "recall_within_40_0.5": 1.0,
                                   "sim_val_bev_moderate": 91.5, "met": True}
    b = meta["baseline"]
    assert b["path"] == str(committed) and b["checkpoint"] == base["meta"]["checkpoint"]
    # no before for the mask the baseline lacks
    assert set(b["masks"]) == {"none", "ground"} and b["missing"] == ["predicted"]
    before = base["none"]["Car"]["bev"]["R40"]["moderate"]
    assert b["masks"]["none"]["before"]["bev_moderate"] == before
    assert b["masks"]["none"]["after"] == {"bev_moderate": 100.0, "3d_moderate": 100.0, "recall_within_40_0.5": 1.0,
                                           "recall_within_40_0.7": 1.0}
    md = out.with_suffix(".md").read_text()
    assert "Moonshot (issue 15: real Car BEV AP R40 moderate >= 50" in md and "**met**" in md
    assert f"| none | {before:.2f} | 100.00 | {100.0 - before:+.2f} |" in md
    assert "Not in the baseline: predicted." in md


def test_moonshot_not_met_says_what_is_short():
    mod = bench

    def entry(ap, rec):
        return {"Car": {"bev": {"R40": {"moderate": ap}}, "3d": {"R40": {"moderate": ap / 2}}},
                "recall": {"within 40": {"recall_bev_0.5": rec, "recall_bev_0.7": rec}}}

    result = {"none": entry(22.5, 0.92), "ground": entry(60.0, 0.85),
              "predicted": {"available": False, "reason": "no mask net"}}
    sv = {"bev": {"moderate": 93.9}}
    ms = mod.moonshot(result, ["none", "ground", "predicted"], {"none": sv, "ground": None, "predicted": sv})
    assert ms["met"] is False and set(ms["masks"]) == {"none", "ground"}
    line = mod._moonshot_line(ms)
    assert "**not met**" in line and "none 22.50 AP, recall 0.92, simulated val 93.90 (short of: AP)" in line
    assert "ground 60.00 AP, recall 0.85, simulated val n/a (short of: simulated val)" in line


def test_a_bad_baseline_is_refused_before_evaluating(car_root, tmp_path):  # noqa: F811
    (tmp_path / "b.json").write_text("[1, 2]")
    for path, why in ((tmp_path / "nope.json", "not a readable JSON file"),
                      (tmp_path / "b.json", "not a bench_sim2real JSON")):
        with pytest.raises(SystemExit, match=f"baseline=.*: {why}"):
            bench.main([f"real={car_root}", "ckpt_path=x.ckpt", f"baseline={path}"])
