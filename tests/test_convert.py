"""scripts/convert_dataset.py: a KITTI root whose image sets list a frame it cannot read stops the conversion in one
line with nothing written, or with skip_bad=true is converted without that frame (named, and left out of the new
image sets); a split left with no frame is an error either way."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from detector.data.convert import convert_kitti_to_lidar
from detector.data.lidar import LidarRoot
from detector.errors import KittiFormatError
from tests.paths import REPO


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "convert_dataset.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _copy(tiny_root: Path, dest: Path) -> Path:
    shutil.copytree(tiny_root, dest)
    return dest


def test_a_listed_frame_without_its_point_cloud_stops_the_conversion_or_is_skipped(tiny_root, tmp_path):
    src = _copy(tiny_root, tmp_path / "kitti")
    sets = {p.stem: p.read_text().split() for p in (src / "ImageSets").glob("*.txt")}
    assert "000002" in sets["train"] and "000003" in sets["train"]
    (src / "training" / "velodyne" / "000002.bin").unlink()  # listed in train.txt, no scan
    truncated = src / "training" / "velodyne" / "000003.bin"
    truncated.write_bytes(truncated.read_bytes()[:-5])  # listed, a bad file
    out = tmp_path / "new" / "lidar"

    r = _convert(f"root={src}", f"out={out}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    assert str(src / "training" / "velodyne" / "000002.bin") in lines[0] and "skip_bad=true" in lines[0]
    assert "listed in ImageSets/train.txt" in lines[0]
    assert "wrote" not in r.stdout
    assert not (tmp_path / "new").exists()  # nothing written: no folder, no temporary left beside it

    r = _convert(f"root={src}", f"out={out}", "skip_bad=true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "skipped 2 bad frame(s)" in r.stdout and "000002, 000003" in r.stdout
    root = LidarRoot(out)
    assert sorted(root.splits()) == sorted(sets)
    for split, ids in sets.items():
        kept = [i for i in ids if i not in ("000002", "000003")]
        assert root.imageset(split) == kept
        for fid in kept:  # the converted dataset loads: every listed frame reads
            root.read_frame(fid)
    assert root.frame_ids() == sorted({i for ids in sets.values() for i in ids} - {"000002", "000003"})
    assert [p.name for p in out.parent.iterdir()] == ["lidar"]  # no temporary folder left beside it


def test_a_split_left_without_frames_is_an_error_even_with_skip_bad(tiny_root, tmp_path):
    src = _copy(tiny_root, tmp_path / "kitti")
    (val,) = (src / "ImageSets" / "val.txt").read_text().split()
    (src / "training" / "velodyne" / f"{val}.bin").unlink()
    with pytest.raises(KittiFormatError, match=r"val\.txt: every frame of split 'val' is bad"):
        convert_kitti_to_lidar(src, tmp_path / "out", skip_bad=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kitti"]


def test_summary_names_the_splits_and_the_commands_that_run_on_them(tiny_root, tmp_path):
    """A root with train/val image sets: the default training command; without image sets: all.txt and the split
    overrides (no made-up train/val split)."""
    summary = convert_kitti_to_lidar(tiny_root, tmp_path / "a")
    assert summary.splits == {"train": 5, "val": 1} and not summary.made_all and not summary.skipped
    assert summary.commands()[-2] == f"train: python scripts/train.py data=lidar data.root={tmp_path / 'a'}"
    src = _copy(tiny_root, tmp_path / "kitti")
    shutil.rmtree(src / "ImageSets")
    summary = convert_kitti_to_lidar(src, tmp_path / "b")
    assert summary.splits == {"all": 6} and summary.made_all
    assert LidarRoot(tmp_path / "b").splits() == ["all"]
    assert summary.commands()[-2] == (f"train: python scripts/train.py data=lidar data.root={tmp_path / 'b'} "
                                      "data.train_split=all data.val_split=all")
    assert summary.commands()[-1].endswith(f"data=lidar data.root={tmp_path / 'b'} split=all")
