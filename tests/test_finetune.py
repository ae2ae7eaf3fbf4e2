"""Fine-tuning: ``init_from=CKPT`` (weights only, a mismatched head kept fresh, the bad cases as one line), the
``experiment=finetune`` recipe, and the cross-validation's folds (scripts/finetune_cv.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from detector.bench.finetune_cv import build_fold_root, labeled_frames, make_folds
from detector.build import build_grid, build_model
from detector.callbacks import init_from_checkpoint, load_checkpoint
from detector.data.kitti import KittiRoot
from detector.errors import ConfigError
from detector.tasks import train
from tests.paths import REPO
from tests.test_train import TINY

CONFIGS = REPO / "configs"
# a few steps, no evaluation, no validation: what these tests look at is the weights and the counters
SHORT = ["callbacks.model_checkpoint=null", "evaluate_after=false", "logger=none", "trainer.limit_val_batches=0",
         "trainer.max_epochs=-1"]


def _cfg(out: Path, root: Path, *overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={out}", f"data.root={root}", *TINY, *overrides])


@pytest.fixture(scope="module")
def car_ckpt(tmp_path_factory, tiny_root) -> Path:
    """A tiny Car-only checkpoint, trained 3 steps."""
    out = tmp_path_factory.mktemp("car")
    result = train(_cfg(out / "run", tiny_root, *SHORT, "trainer.max_steps=3"))
    return Path(result["best_ckpt"])


def test_init_from_loads_what_fits_and_lists_the_rest_in_one_line(tmp_path, tiny_root, car_ckpt):
    cfg = _cfg(tmp_path, tiny_root, "experiment=multiclass")
    model = build_model(cfg.model, cfg.mask, build_grid(cfg.bev))
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    report = init_from_checkpoint(model, car_ckpt)
    saved = {k.removeprefix("model."): v for k, v in load_checkpoint(car_ckpt)["state_dict"].items()}
    now = model.state_dict()
    assert report.reshaped and not report.missing and not report.unused
    assert set(report.loaded) | set(report.fresh) == set(now)
    for k in report.loaded:
        torch.testing.assert_close(now[k], saved[k], rtol=0, atol=0, msg=k)
    for name, then, shape in report.reshaped:  # the head for three classes: its fresh initialisation, untouched
        assert "head" in name and then != shape and tuple(now[name].shape) == shape
        torch.testing.assert_close(now[name], fresh[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(now[k], fresh[k]) for k in report.loaded)
    line = report.line()
    assert "\n" not in line and f"loaded {len(report.loaded)} of the model's {len(now)} tensors" in line
    assert f"{len(report.reshaped)} of another shape kept fresh ({report.reshaped[0][0]}" in line


def test_init_from_starts_a_new_run_at_step_zero(tmp_path, tiny_root, car_ckpt, capsys):
    """The source ran 3 steps; a run from its weights with max_steps=2 makes 2 steps from step 0 with a fresh optimizer
    and schedule (resuming would start at step 3 and stop at once)."""
    src = load_checkpoint(car_ckpt)
    assert src["global_step"] == 3
    result = train(_cfg(tmp_path / "run", tiny_root, *SHORT, "trainer.max_steps=2", f"init_from={car_ckpt}"))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("init_from=")]
    assert len(lines) == 1 and "loaded" in lines[0]
    ckpt = load_checkpoint(result["best_ckpt"])
    assert ckpt["global_step"] == 2 and ckpt["epoch"] == 0
    assert {int(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()} == {2}
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 2
    assert ckpt["hyper_parameters"]["config"]["init_from"] == str(car_ckpt)


def test_init_from_without_a_fitting_tensor_is_an_error(tmp_path, tiny_root):
    bad = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"model.elsewhere.weight": torch.zeros(3)}}, bad)
    cfg = _cfg(tmp_path, tiny_root)
    with pytest.raises(ConfigError, match="no tensor of the checkpoint fits this model"):
        init_from_checkpoint(build_model(cfg.model, cfg.mask, build_grid(cfg.bev)), bad)


def _bad_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    other = tmp / "other.ckpt"
    torch.save({"state_dict": {"model.elsewhere.weight": torch.zeros(3)}}, other)
    return {
        "missing": ([f"init_from={tmp / 'missing.ckpt'}"], f"error: init_from={tmp / 'missing.ckpt'}: checkpoint "
                                                           "not found"),
        "no fitting tensor": ([f"init_from={other}"], "no tensor of the checkpoint fits this model"),
        "both keys": ([f"init_from={other}", f"ckpt_path={other}"], "give one"),
    }


@pytest.mark.parametrize("case", ["missing", "no fitting tensor", "both keys"])
def test_bad_init_from_is_one_line(tmp_path, tiny_root, case):
    args, message = _bad_cases(tmp_path)[case]
    r = subprocess.run([sys.executable, "scripts/train.py", f"paths.output_dir={tmp_path / 'run'}",
                        f"data.root={tiny_root}", *TINY, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr[-2000:]


def test_finetune_experiment_is_a_short_schedule_without_a_chosen_checkpoint(tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):  # without TINY: the schedule as shipped
        base = compose("train", overrides=[f"paths.output_dir={tmp_path}"])
        ft = compose("train", overrides=[f"paths.output_dir={tmp_path}", "experiment=finetune"])
    assert ft.optimizer.lr < base.optimizer.lr and ft.scheduler.max_lr == ft.optimizer.lr
    assert ft.callbacks.model_checkpoint is None  # nothing chosen by the held-out frames' AP
    assert ft.data.root.endswith("kitti") and not ft.data.generate_if_missing
    assert ft.bev == base.bev and ft.model == base.model and ft.mask.net == base.mask.net  # make train's weights
    assert ft.mask.schedule.warmup_steps < base.mask.schedule.warmup_steps


def test_folds_hold_out_every_frame_once(tmp_path):
    ids = [f"{i:06d}" for i in (0, 1, 2, 3, 6, 7, 8, 9, 10, 21)]
    folds = make_folds(ids, 4)
    assert [len(f.held_out) for f in folds] == [3, 3, 2, 2] and [len(f.train) for f in folds] == [7, 7, 8, 8]
    assert sorted(i for f in folds for i in f.held_out) == ids
    for f in folds:
        assert not set(f.train) & set(f.held_out) and set(f.train) | set(f.held_out) == set(ids)
    assert make_folds(list(reversed(ids)), 4) == folds  # the order given does not matter
    for bad in (1, 11):
        with pytest.raises(SystemExit, match=f"folds={bad}"):
            make_folds(ids, bad)


def test_fold_root_links_the_frames_and_lists_the_split(tmp_path, tiny_root):
    ids = labeled_frames(tiny_root)
    fold = make_folds(ids, 3)[1]
    root = build_fold_root(tiny_root, fold, tmp_path / "fold1")
    assert (root / "training").is_symlink()
    kr = KittiRoot(root)
    assert kr.imageset("train") == list(fold.train) and kr.imageset("val") == list(fold.held_out)


def test_folds_of_the_real_frames(kitti_real):
    ids = labeled_frames(kitti_real)
    assert len(ids) == 10
    folds = make_folds(ids, 4)
    assert sorted(i for f in folds for i in f.held_out) == ids


def test_finetune_cv_end_to_end_on_a_tiny_root(tmp_path, tiny_root, car_ckpt):
    """Two folds of the six simulated frames (standing in for the real ones), one fine-tuning epoch each."""
    from detector.bench.finetune_cv import main

    out = tmp_path / "cv.json"
    recipe = " ".join([*TINY, "logger=none"])
    assert main([f"ckpt_path={car_ckpt}", f"real={tiny_root}", "folds=2", f"recipe={recipe}", f"out={out}",
                 f"work={tmp_path / 'work'}"]) == 0
    result = json.loads(out.read_text())
    assert [len(f["held_out"]) for f in result["folds"]] == [3, 3]
    for f in result["folds"]:
        assert set(f["before"]) == set(f["after"]) == set(f["fitted"]) == {"bev", "3d"} and f["wall_s"] > 0
        assert (tmp_path / "work" / f"fold{f['fold']}" / "fitted" / "label_2").is_dir()  # scored on its own frames
        fitted_ids = sorted(p.stem for p in (tmp_path / "work" / f"fold{f['fold']}" / "fitted" / "label_2").glob("*"))
        assert fitted_ids == sorted(f["train"])
        ft = load_checkpoint(f["checkpoint"])
        assert ft["hyper_parameters"]["config"]["init_from"] == str(car_ckpt)
    assert set(result["pooled"]["after"]) == set(result["pooled"]["fitted"]) == {"bev", "3d"}
    assert result["pooled"]["after"]["bev"] <= result["pooled"]["ceiling"]["bev"] <= 100  # nothing beats the truth
    assert result["meta"]["cpu_model"] and "MALLOC_MMAP_MAX_" in result["meta"]["env"]
    md = out.with_suffix(".md").read_text()
    assert "| mean |" in md and "pooled" in md


@pytest.mark.parametrize("cars", [1, 4, 20, 40, 41])
def test_the_ceiling_of_a_few_frames_follows_kittis_r40_rule(tmp_path, cars):
    """A perfect detector on N moderate Cars: KITTI's R40 samples precision at recall 1/40 ... 40/40 and takes at most
    one score threshold per true positive, so the N thresholds cover precision[0 .. N-1] and the AP, the mean of
    precision[1 .. 40], is min(N - 1, 40) / 40 (N = 4: 3 / 40 = 7.5; N = 41 and beyond: 100)."""
    from detector.bench.finetune_cv import pooled

    d = tmp_path / "eval"
    (d / "label_2").mkdir(parents=True)
    # moderate Cars: 40 px tall, unoccluded, untruncated, spread along the road so that no two overlap
    lines = [f"Car 0.00 0 0.00 {100 + 20 * i % 1000:.2f} 150.00 {140 + 20 * i % 1000:.2f} 190.00 1.50 1.60 3.90 "
             f"{-8 + 4 * (i % 5):.2f} 1.70 {8 + 6 * (i // 5):.2f} 0.00" for i in range(cars)]
    (d / "label_2" / "000000.txt").write_text("\n".join(lines) + "\n")
    assert pooled([d], perfect=True)["bev"] == pytest.approx(100 * min(cars - 1, 40) / 40)
