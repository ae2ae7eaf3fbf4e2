"""The application's metric end to end: a model that outputs the ground truth scores AP 100 through
validation and evaluate_checkpoint; validation and evaluation agree for the same checkpoint and decode
settings; the result files give metrics.json; the README's evaluation command parses and runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from detector.commands import kitti_eval
from detector.data.kitti import write_imageset, write_points
from detector.data.kitti_camera import boxes_to_labels
from detector.data.kitti_labels import write_label
from detector.data.structures import Detections
from detector.geometry.boxes import Boxes3D
from detector.models.detector import BevDetector
from detector.tasks import evaluate_checkpoint, train
from tests.conftest import make_calib
from tests.paths import REPO
from tests.test_train import _cfg

N_FRAMES, CARS = 12, 8  # 96 cars, all easy: AP 100 needs at least 41 counted GT per level


@pytest.fixture(scope="module")
def car_root(tmp_path_factory) -> Path:
    """A hand-built KITTI-format root: 12 frames of 8 Cars inside the TINY BEV grid (x 6–20 m, |y| < 10 m),
    each at least 42 px high in the image, untruncated, unoccluded; LiDAR points on the ground and in the
    boxes. Labels come from boxes_to_labels (2D box = projected 3D box), as the simulator's do."""
    root = tmp_path_factory.mktemp("cars") / "kitti"
    calib = make_calib()
    rng = np.random.default_rng(0)
    for sub in ("velodyne", "label_2", "calib"):
        (root / "training" / sub).mkdir(parents=True)
    ids = [f"{i:06d}" for i in range(N_FRAMES)]
    for fid in ids:
        xs = np.repeat([7.0, 11.0, 15.0, 19.0], 2) + rng.uniform(-0.5, 0.5, CARS)
        ys = np.tile([-4.0, 4.0], 4) + rng.uniform(-1.0, 1.0, CARS)
        h = rng.uniform(1.45, 1.6, CARS)
        boxes = np.stack([xs, ys, -1.73 + h / 2, rng.uniform(3.6, 4.2, CARS), rng.uniform(1.55, 1.7, CARS), h,
                          rng.uniform(-np.pi, np.pi, CARS)], axis=1)
        labels = boxes_to_labels(Boxes3D(boxes), np.array(["Car"] * CARS), calib)
        write_label(root / "training" / "label_2" / f"{fid}.txt", labels)
        ground = np.stack([rng.uniform(2, 25, 3000), rng.uniform(-12, 12, 3000), np.full(3000, -1.73)], axis=1)
        inside = boxes[rng.integers(0, CARS, 2000), :3] + rng.uniform(-0.6, 0.6, (2000, 3))
        pts = np.concatenate([ground, inside])
        write_points(root / "training" / "velodyne" / f"{fid}.bin",
                     np.concatenate([pts, rng.uniform(0, 1, (len(pts), 1))], axis=1))
        calib.to_file(root / "training" / "calib" / f"{fid}.txt")
    (root / "ImageSets").mkdir()
    write_imageset(root / "ImageSets" / "train.txt", ids)
    write_imageset(root / "ImageSets" / "val.txt", ids)
    return root


@pytest.fixture
def oracle(monkeypatch):
    """Every BevDetector outputs the ground truth: its forward keeps the batch, its decode returns the
    batch's GT boxes scored 0.95, 0.90, ... (in frame order) and honours score_threshold and
    max_detections as the real decoder does."""
    forward = BevDetector.forward

    def fwd(self, batch, *a, **k):
        out = forward(self, batch, *a, **k)
        out.oracle_batch = batch
        return out

    def decode(self, out, score_threshold: float = 0.1, max_detections: int = 100, **_):
        dets = []
        for boxes, names in zip(out.oracle_batch.gt_boxes, out.oracle_batch.gt_names, strict=True):
            n = len(boxes)
            scores = 0.95 - 0.05 * torch.arange(n, dtype=torch.float32)
            keep = torch.nonzero(scores >= score_threshold).flatten()[:max_detections]
            labels = torch.tensor([self.coder.classes.index(c) for c in names], dtype=torch.long)
            dets.append(Detections(Boxes3D(boxes.tensor[keep]), scores[keep], labels[keep]))
        return dets

    monkeypatch.setattr(BevDetector, "forward", fwd)
    monkeypatch.setattr(BevDetector, "decode", decode)


def _train(out: Path, root: Path, *overrides: str) -> dict:
    """One optimizer step, then validation (the checkpoint is picked by its validation AP)."""
    return train(_cfg(out, root, "trainer.limit_train_batches=1", "trainer.check_val_every_n_epoch=1",
                      "evaluate_after=false", "logger=none", "mask=predicted", *overrides))


def _best_score(ckpt: str) -> float:
    from detector.callbacks import load_checkpoint

    states = load_checkpoint(ckpt)["callbacks"]
    return float(next(v["best_model_score"] for k, v in states.items() if k.startswith("BestCheckpoint")))


def _metrics_from_files(out: Path, classes: str = "Car") -> dict:
    js = out / "from_files.json"
    assert kitti_eval.main([f"gt={out / 'label_2'}", f"results={out / 'data'}", f"classes={classes}", f"out={js}"]) == 0
    return json.loads(js.read_text())


def test_ground_truth_model_scores_100_in_validation_and_evaluation(car_root, oracle, tmp_path, capsys):
    run = _train(tmp_path / "run", car_root)
    assert _best_score(run["best_ckpt"]) == 100.0  # val/AP_Car_bev_R40_moderate of the validation
    cfg = _cfg(tmp_path, car_root)
    metrics = evaluate_checkpoint(run["best_ckpt"], cfg.data, tmp_path / "eval", split="val")
    for m in ("2d", "bev", "3d"):
        assert metrics["Car"][m]["R40"] == {"easy": 100.0, "moderate": 100.0, "hard": 100.0}, m
        assert metrics["Car"][m]["R11"] == {"easy": 100.0, "moderate": 100.0, "hard": 100.0}, m
    # AOS: the labels' alpha and the detections' alpha are each rounded to 2 decimals in the files.
    assert all(v == pytest.approx(100.0, abs=0.01) for v in metrics["Car"]["aos"]["R40"].values())
    text = capsys.readouterr().out
    assert "scored: ground truth and detections whose box centre lies inside the BEV grid" in text
    # The files written by the evaluation give the same numbers (label_2 = the GT it scored against).
    js = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert _metrics_from_files(tmp_path / "eval") == {k: v for k, v in js.items() if k != "_run"}


def test_validation_and_evaluation_agree_with_decode_overrides(car_root, oracle, tmp_path):
    """Decode overrides given to training (score_threshold 0.8 keeps 4 GT of each frame, max_detections 3
    of them) are used by validation (which picks the checkpoint) and by evaluate_checkpoint: the same AP."""
    run = _train(tmp_path / "run", car_root, "model.score_threshold=0.8", "model.max_detections=3")
    val_ap = _best_score(run["best_ckpt"])
    metrics = evaluate_checkpoint(run["best_ckpt"], _cfg(tmp_path, car_root).data, tmp_path / "eval", split="val")
    assert metrics["Car"]["bev"]["R40"]["moderate"] == val_ap
    # 3 of 8 GT found per frame with precision 1: recall 3/8 -> 15 of the 41 points (0..14 of 40) are 1.
    assert val_ap == pytest.approx(15 / 40 * 100, abs=1e-9)
    assert _metrics_from_files(tmp_path / "eval") == {
        k: v for k, v in json.loads((tmp_path / "eval" / "metrics.json").read_text()).items() if k != "_run"
    }


@pytest.fixture(scope="module")
def predicted_ckpt(car_root, tmp_path_factory) -> str:
    """A checkpoint trained (one step) with mask=predicted, no validation."""
    out = tmp_path_factory.mktemp("predicted")
    run = train(_cfg(out, car_root, "trainer.limit_train_batches=1", "trainer.limit_val_batches=0",
                     "callbacks.model_checkpoint.monitor=null", "evaluate_after=false", "logger=none",
                     "mask=predicted"))
    return run["best_ckpt"]


def test_readme_evaluation_command_parses_and_runs(car_root, predicted_ckpt, tmp_path):
    """``python scripts/evaluate.py ckpt_path=... data=kitti data.root=... mask=predicted`` (README) through
    the CLI, and ``mask=none`` for the same weights dense."""
    for mask in ("predicted", "none"):
        out = tmp_path / f"eval_{mask}"
        r = subprocess.run([sys.executable, "scripts/evaluate.py", f"ckpt_path={predicted_ckpt}", "data=kitti",
                            f"data.root={car_root}", f"mask={mask}", f"paths.output_dir={out}"],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Car AP_R40@0.70, 0.70, 0.70:" in r.stdout
        assert f"mask {mask}, mean sparsity" in r.stdout
        js = json.loads((out / "metrics.json").read_text())
        assert _metrics_from_files(out) == {k: v for k, v in js.items() if k != "_run"}


def test_bad_block_size_at_evaluation_is_one_line_naming_the_key(car_root, predicted_ckpt, tmp_path):
    """``block_size=`` a value that is no tile, dense or auto: one line naming the key, no traceback (the values that
    run: tests/commands/test_execution_invariance.py)."""
    r = subprocess.run([sys.executable, "scripts/evaluate.py", f"ckpt_path={predicted_ckpt}", "data=kitti",
                        f"data.root={car_root}", "block_size=fast", f"paths.output_dir={tmp_path / 'bad'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and "block_size" in lines[-1] and "Traceback" not in r.stderr


def test_mask_net_the_checkpoint_did_not_train_is_refused(predicted_ckpt, tmp_path):
    """mask=predicted on a checkpoint without mask-net weights (as one trained with mask=road_map): an
    error naming the key, not a randomly initialised mask net."""
    from detector.build import load_detector
    from detector.callbacks import load_checkpoint
    from detector.errors import ConfigError

    ckpt = load_checkpoint(predicted_ckpt)
    ckpt["state_dict"] = {k: v for k, v in ckpt["state_dict"].items() if ".mask_net." not in k}
    ckpt["hyper_parameters"]["config"]["mask"] = {"provider": None, "net": None}
    torch.save(ckpt, tmp_path / "no_mask_net.ckpt")
    load_detector(tmp_path / "no_mask_net.ckpt")  # its own mask: fine
    with pytest.raises(ConfigError, match="mask: .* has no trained mask net"):
        load_detector(tmp_path / "no_mask_net.ckpt", "predicted")


def test_mask_override_builds_the_net_the_checkpoint_trained(car_root, tmp_path, caplog):
    """mask=predicted on a checkpoint whose mask net the config now describes differently (trained with 2
    convolutions of 8 channels at threshold 0.3): the network is built as trained and gets its weights, the
    override's threshold is used, and one warning says both - not a size mismatch from deep inside torch."""
    import logging

    from hydra import compose, initialize_config_dir

    from detector.build import load_detector
    from detector.callbacks import load_checkpoint
    from detector.resources import config_dir

    run = train(_cfg(tmp_path / "run", car_root, "trainer.limit_train_batches=1", "trainer.limit_val_batches=0",
                     "callbacks.model_checkpoint.monitor=null", "evaluate_after=false", "logger=none",
                     "mask=predicted", "mask.net.num_convs=2", "mask.net.channels=8", "mask.net.threshold=0.3"))
    with initialize_config_dir(str(config_dir()), version_base=None):
        configured = compose(config_name="train", overrides=["mask=predicted"]).mask.net
    assert (configured.num_convs, configured.channels, configured.threshold) != (2, 8, 0.3)  # the case can fail

    def load(*args):  # the detector, its config and what load_detector warned
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="detector.build"):
            model, cfg = load_detector(run["best_ckpt"], *args)
        return model, cfg, [r.getMessage() for r in caplog.records if r.name == "detector.build"]

    own, _, messages = load()
    assert messages == []  # its own mask: nothing to say
    model, cfg, messages = load("predicted")
    convs = [m for m in model.mask_net.net if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 8, 1]
    trained = {k.removeprefix("model.mask_net."): v for k, v in load_checkpoint(run["best_ckpt"])["state_dict"].items()
               if k.startswith("model.mask_net.")}
    assert trained and all(torch.equal(v, trained[k]) for k, v in model.mask_net.state_dict().items())
    assert model.mask_net.threshold == configured.threshold and own.mask_net.threshold == 0.3
    assert cfg.mask.net.threshold == configured.threshold and cfg.mask.net.num_convs == 2
    assert len(messages) == 1 and "num_convs=2" in messages[0] and "channels=8" in messages[0]
    assert f"threshold={configured.threshold} (trained at 0.3)" in messages[0]


def test_objects_outside_the_grid_are_named_not_silently_dropped(car_root, predicted_ckpt, oracle, tmp_path, capsys):
    """A labeled Car at x = 40 m (the TINY grid ends at 25.6 m) is not scored - AP stays 100 - and the evaluation
    says so: counted and named (frame, class, distance) on its output and in metrics.json."""
    import shutil

    from detector.data.kitti_labels import format_label_lines

    root = tmp_path / "root"
    shutil.copytree(car_root, root)
    far = boxes_to_labels(Boxes3D(torch.tensor([[40.0, 2.0, -0.9, 4.0, 1.7, 1.5, 0.3]])), np.array(["Car"]),
                          make_calib())
    label = root / "training" / "label_2" / "000003.txt"
    label.write_text(label.read_text() + "\n".join(format_label_lines(far)) + "\n")
    metrics = evaluate_checkpoint(predicted_ckpt, _cfg(tmp_path, root).data, tmp_path / "eval", split="val")
    assert metrics["Car"]["bev"]["R40"]["moderate"] == 100.0
    dist = float(np.hypot(far.location[0, 0], far.location[0, 2]))
    name = f"000003 Car {dist:.1f} m"
    assert f"not scored: 1 labeled object(s) outside the BEV grid: {name}" in capsys.readouterr().out
    run = json.loads((tmp_path / "eval" / "metrics.json").read_text())["_run"]
    assert run["outside_grid"] == {"count": 1, "objects": [name]}


def test_evaluation_of_a_root_without_labels_names_the_folder(car_root, predicted_ckpt, tmp_path):
    import shutil

    from detector.errors import KittiFormatError

    root = tmp_path / "root"
    shutil.copytree(car_root, root, ignore=shutil.ignore_patterns("label_2"))
    with pytest.raises(KittiFormatError, match=r"training/label_2: no labels for split 'val'"):
        evaluate_checkpoint(predicted_ckpt, _cfg(tmp_path, root).data, tmp_path / "eval", split="val")
