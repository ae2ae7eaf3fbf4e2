"""The command-line programs other than training: inspect_dataset, visualize, make_dataset, and the one line
each prints on a user error (once per program through the real script in a subprocess, for the exit path;
the other cases in-process, where a start-up of torch and open3d does not cost seconds)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from detector.commands import inspect_dataset, visualize
from detector.resources import config_dir
from tests.paths import REPO


def _script(name: str, *args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    _check_line(r.stderr, words)


def _check_line(stderr: str, words: tuple[str, ...]) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


def _fails_in_one_line(main, args: list[str], capsys, *words: str) -> None:
    """``main(args)`` exits non-zero (returned status or SystemExit) with one ``error:`` line on stderr."""
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
        if isinstance(code, str):  # SystemExit("message"): Python prints it to stderr and exits with 1
            print(code, file=sys.stderr)
            code = 1
    assert code == 1
    _check_line(capsys.readouterr().err, words)


# --- inspect_dataset ------------------------------------------------------------------------------------
def test_inspect_dataset_summarizes_a_valid_root(tiny_root, capsys):
    assert inspect_dataset.main([f"root={tiny_root}"]) == 0
    out = capsys.readouterr().out
    assert "frames on disk: 6" in out and "road maps: yes" in out
    assert "split train           5 frames" in out and "split val             1 frames" in out
    car = next(line for line in out.splitlines() if line.startswith("Car "))
    total, easy, moderate, hard = (int(v) for v in car.split()[1:5])
    assert total > 0 and easy <= moderate <= hard <= total  # cumulative difficulty levels


def _with_sim_version(src: Path, dst: Path, version) -> Path:
    """A copy of the simulated root ``src`` whose sim.json records ``version`` (None: no version, as the
    simulator wrote before it recorded one)."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / "sim.json").read_text())
    meta.pop("version")
    if version is not None:
        meta["version"] = version
    (dst / "sim.json").write_text(json.dumps(meta))
    return dst


def test_inspect_dataset_warns_about_a_sample_from_an_older_simulator(tiny_root, tmp_path, capsys):
    from detector.sim.writer import SIM_VERSION

    assert inspect_dataset.main([f"root={tiny_root}"]) == 0
    assert "warning" not in capsys.readouterr().err  # written by this simulator
    root = _with_sim_version(tiny_root, tmp_path / "old", None)  # what the simulator before the version wrote
    assert inspect_dataset.main([f"root={root}"]) == 0  # still a valid dataset: a warning, not an error
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("warning:")
    assert "an older simulator (version 1;" in err and f"this one is version {SIM_VERSION})" in err
    assert f"rm -rf {root} && make data DATA={root}" in err
    # A newer (or unknown) version is not "older": it is a different simulator.
    for version in (SIM_VERSION + 1, "x"):
        root = _with_sim_version(tiny_root, tmp_path / f"new{version}", version)
        assert inspect_dataset.main([f"root={root}"]) == 0
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"a different simulator (version {version};" in err and "older" not in err


def test_training_on_a_stale_sample_warns_in_one_line(tiny_root, tmp_path, caplog):
    """ensure_dataset (train's first look at data.root) logs one warning for a sample written by another simulator
    version and none for this simulator's own or for a root the simulator did not write (no sim.json)."""
    import logging

    from omegaconf import OmegaConf

    from detector.tasks import ensure_dataset

    def warnings(root: Path, split: str = "train") -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="detector.tasks"):
            ensure_dataset(OmegaConf.create({"root": str(root), "train_split": split}))
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert warnings(tiny_root) == []
    old = _with_sim_version(tiny_root, tmp_path / "old", 1)
    (msg,) = warnings(old)
    assert "\n" not in msg and f"{old} was written by an older simulator (version 1;" in msg
    real = tmp_path / "real"  # e.g. real KITTI frames
    (real / "ImageSets").mkdir(parents=True)
    (real / "training").mkdir()
    (real / "ImageSets" / "train.txt").write_text("000000\n")
    assert warnings(real) == []


def test_inspect_dataset_names_every_bad_file(tiny_root, tmp_path, capsys):
    root = tmp_path / "broken"
    shutil.copytree(tiny_root, root)
    velo = root / "training" / "velodyne" / "000001.bin"
    velo.write_bytes(velo.read_bytes()[:-6])  # not a whole number of float32 x 4 points
    label = root / "training" / "label_2" / "000003.txt"
    label.write_text("Car 0.0 0 -1.5 not numbers\n")
    (root / "ImageSets" / "val.txt").write_text("000004\n000009\n")  # 000009 has no point cloud
    assert inspect_dataset.main([f"root={root}"]) == 1
    err = capsys.readouterr().err
    assert "3 invalid file(s)" in err
    for name in ("000001.bin", "000003.txt", "000009"):
        assert name in err, err


def test_inspect_dataset_errors_are_one_line(tmp_path, capsys):
    _one_line_error(_script("inspect_dataset.py", f"root={tmp_path / 'missing'}"), "dataset root not found")
    _fails_in_one_line(inspect_dataset.main, [], capsys, "root=DIR is required")
    _fails_in_one_line(inspect_dataset.main, ["root=x", "max_frames=many"], capsys, "max_frames='many'", "int")
    _fails_in_one_line(inspect_dataset.main, ["rot=x"], capsys, "unexpected argument 'rot=x'")


# --- visualize ------------------------------------------------------------------------------------------
def _read_png(path: Path) -> np.ndarray:
    import open3d as o3d

    return np.asarray(o3d.io.read_image(str(path)))


def test_visualize_draws_the_bird_eye_view_with_ground_truth(tiny_root, tmp_path, capsys):
    out = tmp_path / "frame.png"
    assert visualize.main([f"root={tiny_root}", "frame=000000", "mode=bev", f"out={out}"]) == 0
    img = _read_png(out)
    # the default grid, x 0-70.4 m by y -40-40 m, as a 880 x 1000 px map (1000 on the long side), the legend under it
    assert img.shape[1] == 1000 and 880 < img.shape[0] < 1000
    green = (img[..., 1] > 200) & (img[..., 0] < 100)
    assert green.sum() > 50  # the ground-truth boxes
    assert "bird's-eye view" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_root, tmp_path_factory) -> Path:
    from detector.tasks import train

    out = tmp_path_factory.mktemp("viz_run")
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[
            f"paths.output_dir={out}", f"data.root={tiny_root}", "bev.x_range=[0,25.6]", "bev.y_range=[-12.8,12.8]",
            "model.backbone.stem_channels=8", "model.backbone.stage_units=[1,1,1,1]",
            "model.backbone.stage_channels=[8,8,16,16]", "model.neck_channels=8", "model.head_channels=8",
            "data.batch_size=2", "data.augment=null", "trainer.max_steps=1", "logger=none", "mask=road_map",
            "callbacks.model_checkpoint.monitor=null", "callbacks.progress_bar=null", "evaluate_after=false"])
    return Path(train(cfg)["best_ckpt"])


def test_visualize_with_a_checkpoint_draws_its_mask_and_grid(tiny_root, tiny_checkpoint, tmp_path):
    out = tmp_path / "pred.png"
    assert visualize.main([f"root={tiny_root}", "frame=000004", "mode=bev", f"out={out}",
                           f"ckpt_path={tiny_checkpoint}", "score_threshold=0.0"]) == 0
    img = _read_png(out)
    assert img.shape[1] == 1000 and img.shape[0] > 1000  # the checkpoint's square grid (25.6 m): 1000 px + legend
    from detector.viz import MASK_COLOR

    assert (img == np.asarray(MASK_COLOR, np.uint8)).all(-1).any()  # the road-map computation mask


def test_visualize_errors_are_one_line(tiny_root, tmp_path, capsys):
    _one_line_error(_script("visualize.py", f"root={tiny_root}", "frame=000099", "mode=bev",
                            f"out={tmp_path / 'x.png'}"), "000099")
    _fails_in_one_line(visualize.main, [f"root={tiny_root}", "mode=side"], capsys, "mode must be auto, 3d or bev")
    _fails_in_one_line(visualize.main, [f"root={tiny_root}", f"ckpt_path={tmp_path / 'none.ckpt'}", "mode=bev"],
                       capsys, "checkpoint not found")


def test_visualize_mask_override_draws_a_road_map_checkpoint_on_a_frame_without_road_map(
        tiny_root, tiny_checkpoint, tmp_path, capsys):
    """A root without road maps (as real KITTI): the road-map checkpoint is refused with its own mask, drawn
    with mask=ground (its mask drawn) or mask=none (dense: no mask drawn), and mask=predicted is refused
    because it trained no mask net (the same rule as scripts/evaluate.py mask=...)."""
    from detector.viz import MASK_COLOR

    root = tmp_path / "no_road"
    shutil.copytree(tiny_root, root, ignore=shutil.ignore_patterns("road_map"))
    common = [f"root={root}", "frame=000004", "mode=bev", f"ckpt_path={tiny_checkpoint}", "score_threshold=0.0"]
    _fails_in_one_line(visualize.main, [*common, f"out={tmp_path / 'a.png'}"], capsys, "000004", "has no road map")
    masked = {}
    for mask in ("ground", "none"):
        out = tmp_path / f"{mask}.png"
        assert visualize.main([*common, f"mask={mask}", f"out={out}"]) == 0
        img = _read_png(out)
        assert img.shape[1] == 1000 and img.shape[0] > 1000
        masked[mask] = int((img == np.asarray(MASK_COLOR, np.uint8)).all(-1).sum())
    assert masked["ground"] > 0 and masked["none"] == 0
    _fails_in_one_line(visualize.main, [*common, "mask=predicted", f"out={tmp_path / 'p.png'}"], capsys,
                       "has no trained mask net")
    _fails_in_one_line(visualize.main, [*common, "mask=roadmap", f"out={tmp_path / 'q.png'}"], capsys,
                       "mask/roadmap")
    _fails_in_one_line(visualize.main, [f"root={root}", "mask=none"], capsys, "give ckpt_path=PATH too")


# --- make_dataset, bench_model ---------------------------------------------------------------------------
def test_make_dataset_errors_are_one_line(tmp_path, capsys):
    from detector.commands import make_dataset

    (tmp_path / "mine.txt").write_text("not a dataset\n")
    _one_line_error(_script("make_dataset.py", f"out={tmp_path}", "frames=1"), "not written by the simulator")
    _fails_in_one_line(make_dataset.main, [f"out={tmp_path / 'd'}", "frames=0"], capsys, "frames=0", ">= 1")
    _fails_in_one_line(make_dataset.main, [], capsys, "out=DIR is required")


def test_bench_model_in_a_fresh_clone_says_run_make_data(tmp_path):
    _one_line_error(_script("bench_model.py", "quick=true", cwd=tmp_path), "run `make data` first")


# --- train / evaluate: Hydra's own errors ------------------------------------------------------------------
@pytest.mark.parametrize("config, args, words", [
    ("eval", ["data.root=x"], ("ckpt_path must be given",)),
    ("train", ["foo=1"], ("Could not override 'foo'", "Key 'foo' is not in struct")),
    ("train", ["model=nonexistent"], ("Could not find 'model/nonexistent'", "dense sparse")),
    ("train", ["data.batch_size=1,2"], ("Ambiguous value for argument 'data.batch_size=1,2'",)),
    ("train", ["trainer.max_epochs"], ("Error parsing override 'trainer.max_epochs'",)),
])
def test_hydra_errors_are_one_line(config, args, words, capsys):
    from detector.commands.overrides import check_overrides

    with pytest.raises(SystemExit) as e:
        check_overrides(config, args)
    assert e.value.code == 1
    _check_line(capsys.readouterr().err, words)
    check_overrides(config, ["ckpt_path=x.ckpt"] if config == "eval" else [])  # a good command line passes
    check_overrides(config, ["--multirun", "foo=1"])  # Hydra's flags: left to Hydra
