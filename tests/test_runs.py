"""Nothing lost: a dataset is never written by training, runs never share a folder, ``last.ckpt`` is the latest
state, and every failure a user can cause is one line naming the path or key. Each case is run the way a user meets
it: through the command, in a subprocess, unless only the files it leaves matter."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from detector.callbacks import load_checkpoint
from tests.paths import REPO
from tests.test_train import TINY, _cfg

QUIET = ["logger=none", "evaluate_after=false"]


def _run(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _train(out: Path, root: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``scripts/train.py`` on the tiny grid, its run folder ``out`` (``hydra.run.dir``)."""
    return _run("scripts/train.py", f"hydra.run.dir={out}", f"data.root={root}", *TINY, *QUIET, *overrides,
                timeout=timeout)


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The run failed with status 1 and one ``error:`` line holding every needle, no traceback."""
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def _tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) with the hash of its bytes: equal digests, an unchanged tree."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def own_root(tiny_root, tmp_path) -> Path:
    """A private copy of the tiny simulated root, for a test that damages or watches it."""
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    return root


# --- 1. the dataset is read-only to training ----------------------------------------------------------------------
def test_a_typod_split_leaves_the_dataset_as_it_was(own_root, tmp_path):
    """``data.train_split=trian`` on a simulated root: one line naming the missing file and the splits there are;
    no frame regenerated, nothing written into the root."""
    before = _tree_digest(own_root)
    r = _train(tmp_path / "run", own_root, "data.train_split=trian", "data.generate_frames=2")
    _one_line_error(r, str(own_root / "ImageSets" / "trian.txt"), "split 'trian' not found", "train, val")
    assert _tree_digest(own_root) == before


def test_a_root_without_image_sets_is_not_regenerated(own_root, tmp_path):
    """A root that holds files but no ImageSets/: an error, never a simulated sample written over it."""
    shutil.rmtree(own_root / "ImageSets")
    before = _tree_digest(own_root)
    r = _train(tmp_path / "run", own_root, "data.generate_frames=2")
    _one_line_error(r, "ImageSets", "no ImageSets/*.txt")
    assert _tree_digest(own_root) == before


def test_training_writes_nothing_into_the_dataset(own_root, tmp_path):
    """The default augmentation's GT database is cached outside the root (``paths.cache_dir``)."""
    before = _tree_digest(own_root)
    aug = [o for o in TINY if o != "data.augment=null"]
    r = _run("scripts/train.py", f"hydra.run.dir={tmp_path / 'run'}", f"data.root={own_root}", *aug, *QUIET,
             "trainer.max_steps=1", f"paths.cache_dir={tmp_path / 'cache'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _tree_digest(own_root) == before
    assert list((tmp_path / "cache" / "gt_database").glob("data-*/gt_train_*.npz"))


def test_an_empty_or_absent_root_gets_the_sample(tmp_path):
    """Where nothing is there (no folder, or an empty one), training generates the simulated sample."""
    from omegaconf import OmegaConf

    from detector.tasks import ensure_dataset

    for root in (tmp_path / "absent", tmp_path / "empty"):
        if root.name == "empty":
            root.mkdir()
        ensure_dataset(OmegaConf.create({"root": str(root), "train_split": "train", "generate_if_missing": True,
                                         "generate_frames": 2, "seed": 0}))
        assert (root / "ImageSets" / "train.txt").is_file() and (root / "sim.json").is_file()


# --- 2. last.ckpt is the last ------------------------------------------------------------------------------------
@pytest.mark.parametrize("val_every", [1, 2])
def test_a_plateaued_runs_last_checkpoint_holds_its_final_step(tiny_root, tmp_path, val_every):
    """No detection ever passes the score threshold, so the monitored AP stays at its first value: the best
    checkpoint stays at the first validation, ``last.ckpt`` follows every epoch to the final step (Lightning's
    ``save_last`` alone leaves it at the best epoch), and holds the best-by-AP callback's state as that callback
    last updated it (a resume keeps tracking the same best), whether validation runs every epoch or every other."""
    from detector.tasks import train

    cfg = _cfg(tmp_path / "run", tiny_root, "trainer.max_epochs=4", "model.score_threshold=1.0", *QUIET,
               f"trainer.check_val_every_n_epoch={val_every}")
    result = train(cfg)
    last = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    steps_per_epoch = 5 // 2  # 5 training frames, batch 2, the partial batch dropped
    assert last["global_step"] == 4 * steps_per_epoch
    best = load_checkpoint(result["best_ckpt"])
    assert best["global_step"] == val_every * steps_per_epoch < last["global_step"]  # the first validation's
    (state,) = [v for k, v in last["callbacks"].items() if k.startswith("BestCheckpoint")]
    assert state["best_model_path"] == result["best_ckpt"] and float(state["best_model_score"]) == 0.0


class RaiseAtStep:
    """A callback that raises at a given step (a crash the Python process survives: a bug, an I/O error)."""

    def __new__(cls, step: int):
        import lightning as L

        class _Raise(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step == step:
                    raise RuntimeError(f"boom at step {step}")

        return _Raise()


def test_an_exception_leaves_last_checkpoint_at_the_step_it_stopped(tiny_root, tmp_path):
    from detector.tasks import train

    cfg = _cfg(tmp_path / "run", tiny_root, "trainer.max_steps=8", "trainer.max_epochs=-1", *QUIET,
               "+callbacks.crash._target_=tests.test_runs.RaiseAtStep", "+callbacks.crash.step=3")
    with pytest.raises(RuntimeError, match="boom at step 3"):
        train(cfg)
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 3


def test_training_that_ends_between_two_events_saves_its_final_state(tiny_root, tmp_path):
    """``max_steps`` reached mid-epoch with validation off: the end of training is a checkpoint event too."""
    from detector.tasks import train

    cfg = _cfg(tmp_path / "run", tiny_root, "trainer.max_steps=3", "trainer.max_epochs=-1",
               "trainer.limit_val_batches=0", "callbacks.model_checkpoint.monitor=null", *QUIET)
    train(cfg)
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 3


# --- 3. one folder per run ---------------------------------------------------------------------------------------
def test_runs_started_together_get_their_own_folders(tiny_root, tmp_path):
    """Two runs whose timed folder name is the same (``${now:%Y}``: certainly the same for both, as the default's
    seconds are for runs started in one second) end in two folders, each with its own checkpoint and config."""
    procs = [subprocess.Popen([sys.executable, "scripts/train.py", f"data.root={tiny_root}", *TINY, *QUIET,
                               f"hydra.run.dir={tmp_path}/runs/${{now:%Y}}", "trainer.max_steps=1", f"seed={k}"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    folders = sorted((tmp_path / "runs").iterdir())
    assert [f.name for f in folders] == [time.strftime("%Y"), time.strftime("%Y") + "_1"]
    seeds = sorted(load_checkpoint(f / "checkpoints" / "last.ckpt")["hyper_parameters"]["config"]["seed"]
                   for f in folders)
    assert seeds == [0, 1]
    for f in folders:
        assert "seed: " in (f / ".hydra" / "config.yaml").read_text() and (f / "train.log").is_file()


def test_a_named_run_folder_that_holds_a_run_is_refused(tiny_root, tmp_path):
    out = tmp_path / "run"
    assert _train(out, tiny_root, "trainer.max_steps=1").returncode == 0
    before = _tree_digest(out)
    r = _train(out, tiny_root, "trainer.max_steps=1", "seed=5")
    _one_line_error(r, f"hydra.run.dir={out}", "already holds a run")
    assert _tree_digest(out) == before


def test_an_output_folder_that_holds_a_run_is_refused(tiny_root, tmp_path):
    """The same for ``paths.output_dir`` (the checkpoints' folder) pointed at another run's."""
    from detector.errors import ConfigError
    from detector.tasks import train

    train(_cfg(tmp_path / "run", tiny_root, "trainer.max_steps=1", *QUIET))
    with pytest.raises(ConfigError, match="already holds a run"):
        train(_cfg(tmp_path / "run", tiny_root, "trainer.max_steps=1", *QUIET))


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_a_run_folder_a_file_occupies_is_one_line(tiny_root, tmp_path, where):
    blocker = tmp_path / "taken"
    blocker.write_text("a file")
    out = blocker if where == "file" else blocker / "run"
    _one_line_error(_train(out, tiny_root, "trainer.max_steps=1"), f"hydra.run.dir={out}", "a file is in the way")
    assert blocker.read_text() == "a file"


# --- 4. skip_bad_frames everywhere -------------------------------------------------------------------------------
def test_skip_bad_frames_with_the_default_augmentation(own_root, tmp_path):
    """A truncated point cloud: with the default augmentation (its GT database reads every training frame) the
    run trains without it and reports it; without skip_bad_frames the error names the file."""
    bad = own_root / "training" / "velodyne" / "000000.bin"
    bad.write_bytes(bad.read_bytes()[:-5])
    aug = [o for o in TINY if o != "data.augment=null"]
    common = [f"data.root={own_root}", *aug, *QUIET, "trainer.max_steps=2", f"paths.cache_dir={tmp_path / 'c'}"]
    r = _run("scripts/train.py", f"hydra.run.dir={tmp_path / 'a'}", *common, "data.skip_bad_frames=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped 1 bad training frame(s)" in r.stdout
    log = r.stdout + r.stderr
    assert "GT database" in log and "left out 1 bad frame(s): 000000" in log
    assert '"skipped_frames": [\n  "000000"\n ]' in (tmp_path / "a" / "run.json").read_text()
    r = _run("scripts/train.py", f"hydra.run.dir={tmp_path / 'b'}", *common)
    _one_line_error(r, str(bad), "truncated")


# --- 5. zero batches ---------------------------------------------------------------------------------------------
def test_zero_training_batches_is_an_error(tiny_root, tmp_path):
    r = _train(tmp_path / "run", tiny_root, "data.batch_size=8")
    _one_line_error(r, "no training batch", "5 usable frame(s) in split 'train'", "data.batch_size=8")
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- 6. one line where a traceback was ---------------------------------------------------------------------------
def test_resuming_a_checkpoint_of_another_grid_names_the_setting(tiny_root, tmp_path):
    assert _train(tmp_path / "a", tiny_root, "trainer.max_steps=1").returncode == 0
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    r = _train(tmp_path / "b", tiny_root, "trainer.max_steps=2", "bev.z_resolution=0.25", f"ckpt_path={last}")
    _one_line_error(r, f"ckpt_path={last}", "bev.z_resolution=0.5 (this run: 0.25)")
    # the grid's group is named when the run was composed by Hydra (kitti's 0.1 m slices: 36 input channels)
    r = _train(tmp_path / "c", tiny_root, "trainer.max_steps=2", "bev=kitti", "bev.z_resolution=0.1",
               f"ckpt_path={last}")
    _one_line_error(r, "bev=small (this run: bev=kitti)")


def test_an_unwritable_export_path_is_one_line_before_any_work(tiny_root, tmp_path):
    assert _train(tmp_path / "a", tiny_root, "trainer.max_steps=1").returncode == 0
    blocker = tmp_path / "taken"
    blocker.write_text("x")
    r = _run("scripts/export.py", f"ckpt_path={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}",
             f"out={blocker / 'det.pt2'}")
    _one_line_error(r, f"out={blocker}", "a file is in the way")
    assert "exported" not in r.stdout


def test_export_onnx_without_its_packages_fails_first_and_leaves_no_folder(tiny_root, tmp_path):
    """onnxscript hidden from the process: the one line comes before the model is built, no output folder."""
    fake = tmp_path / "hide"
    fake.mkdir()
    (fake / "onnxscript.py").write_text("raise ImportError('hidden by the test')\n")
    out = tmp_path / "exports" / "det.onnx"
    r = _run("scripts/export.py", f"ckpt_path={tmp_path / 'nothing.ckpt'}", "format=onnx", f"out={out}",
             env={"PYTHONPATH": str(fake)})
    _one_line_error(r, "pip install .[export]")
    assert not (tmp_path / "exports").exists()


def test_kitti_eval_checks_its_output_before_evaluating(tmp_path):
    gt = tmp_path / "gt"
    gt.mkdir()
    (gt / "000000.txt").write_text("Car 0.00 0 -1.58 587.01 173.33 614.12 200.12 1.65 1.67 3.64 -0.65 1.71 46.70 "
                                   "-1.59\n")
    blocker = tmp_path / "taken"
    blocker.write_text("x")
    r = _run("scripts/kitti_eval.py", f"gt={gt}", f"results={gt}", f"out={blocker / 'metrics.json'}")
    _one_line_error(r, f"out={blocker}")
    assert "Evaluated" not in r.stdout


def test_training_on_a_foreign_non_kitti_folder_is_one_line(tmp_path):
    """A folder of the user's that is no KITTI root: one line, the folder untouched (before, the simulator was
    started on it and died with FileExistsError's traceback)."""
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    r = _train(tmp_path / "run", root)
    _one_line_error(r, str(root / "training"))
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
    r = _run("scripts/make_dataset.py", f"out={root}", "frames=1")
    _one_line_error(r, "not written by the simulator", "out=DIR")


# --- 7. the smaller ones -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not really a zip", os.urandom(4096)])
def test_a_corrupt_checkpoint_gets_no_unsafe_advice(tmp_path, tiny_root, content):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(content)
    r = _run("scripts/evaluate.py", f"ckpt_path={bad}", f"data.root={tiny_root}", f"hydra.run.dir={tmp_path / 'e'}")
    line = _one_line_error(r, str(bad))
    assert "weights_only=False" not in line and "trust" not in line


def test_a_truncated_checkpoint_is_called_damaged(tmp_path):
    from detector.errors import CheckpointError

    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(4096)}}, good)
    data = good.read_bytes()
    for cut in (len(data) // 2, len(data) - 10):
        bad = tmp_path / f"cut{cut}.ckpt"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(bad)
        assert str(bad) in str(e.value) and "weights_only=False" not in str(e.value)


def test_a_missing_image_is_a_bad_frame(own_root, tmp_path):
    """A root with an image_2 folder missing one frame's image: that frame is bad (its camera view is unknown),
    and inspect_dataset lists it; a root without any image_2 folder keeps the default image size."""
    from detector.data.kitti import KittiRoot
    from detector.errors import KittiFormatError

    images = own_root / "training" / "image_2"
    images.mkdir()
    png = _png(1242, 375)
    for fid in KittiRoot(own_root).imageset("train") + KittiRoot(own_root).imageset("val"):
        (images / f"{fid}.png").write_bytes(png)
    (images / "000001.png").unlink()
    with pytest.raises(KittiFormatError, match="000001.png"):
        KittiRoot(own_root).read_frame("000001")
    r = _run("scripts/inspect_dataset.py", f"root={own_root}")
    assert r.returncode == 1 and str(images / "000001.png") in r.stdout + r.stderr
    shutil.rmtree(images)
    assert KittiRoot(own_root).read_frame("000001").image_size is None


def _png(width: int, height: int) -> bytes:
    """The signature and IHDR chunk of a PNG (all the reader looks at)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr
            + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)))


def test_a_mask_for_a_dense_model_is_named(tiny_root, tmp_path):
    r = _train(tmp_path / "run", tiny_root, "trainer.max_steps=1", "model=dense", "mask=predicted")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mask=predicted is not used: model=dense computes every cell" in r.stdout + r.stderr
    r = _train(tmp_path / "run2", tiny_root, "trainer.max_steps=1", "model=dense")
    assert "is not used" not in r.stdout + r.stderr


def test_no_folder_is_left_by_a_refused_export(tmp_path):
    """A missing checkpoint: the one line comes before the output's folder is made."""
    out = tmp_path / "x" / "det.pt2"
    r = _run("scripts/export.py", f"ckpt_path={tmp_path / 'none.ckpt'}", f"out={out}")
    _one_line_error(r, "checkpoint not found")
    assert not (tmp_path / "x").exists()
