"""KITTI-format folders: reading labels and results for evaluation, the CLI, and bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from detector.commands import kitti_eval
from detector.data.kitti import write_imageset
from detector.data.kitti_camera import boxes_to_labels
from detector.data.kitti_labels import read_label, write_label
from detector.errors import KittiFormatError
from detector.eval.kitti_files import load_eval_inputs, write_results
from detector.eval.kitti_metric import evaluate
from detector.eval.synthetic import synthetic_set
from detector.geometry.boxes import Boxes3D


@pytest.fixture
def folders(tmp_path):
    """12 frames of labels, results for all of them; returns (gt_dir, res_dir, gt, dt, ids)."""
    gt, dt = synthetic_set(12, dets_per_frame=20, seed=7)
    ids = [f"{i:06d}" for i in range(12)]
    gt_dir, res_dir = tmp_path / "label_2", tmp_path / "results"
    gt_dir.mkdir()
    for i, g in zip(ids, gt, strict=True):
        write_label(gt_dir / f"{i}.txt", g)
    write_results(res_dir, ids, dt)
    return gt_dir, res_dir, gt, dt, ids


def test_folders_evaluate_like_memory(folders):
    gt_dir, res_dir, gt, dt, ids = folders
    inp = load_eval_inputs(gt_dir, res_dir)
    assert inp.frame_ids == ids and inp.missing_results == [] and inp.unused_results == []
    a, b = evaluate(inp.gt, inp.dt), evaluate(gt, dt)
    np.testing.assert_array_equal(a.curves, b.curves)
    np.testing.assert_array_equal(a.distance_curves, b.distance_curves)


def test_cli_prints_the_table_and_writes_json(folders, tmp_path, capsys):
    gt_dir, res_dir, gt, dt, _ = folders
    out = tmp_path / "out" / "ap.json"
    assert kitti_eval.main([f"gt={gt_dir}", f"results={res_dir}", f"out={out}"]) == 0
    text = capsys.readouterr().out
    assert "Evaluated 12 frames." in text and "Car AP_R40@0.70, 0.70, 0.70:" in text and "bbox AP:" in text
    js = json.loads(out.read_text())
    expected = evaluate(gt, dt).to_json()
    assert js.keys() == expected.keys()
    for c in ("Car", "Pedestrian", "Cyclist"):
        assert set(js[c]) == {"2d", "bev", "3d", "aos"}
        for m in js[c]:
            for p in ("R40", "R11"):
                for lv in ("easy", "moderate", "hard"):
                    assert js[c][m][p][lv] == pytest.approx(expected[c][m][p][lv], abs=1e-12)
    assert kitti_eval.main([f"gt={gt_dir}", f"results={res_dir}", "classes=Car", "distance=false"]) == 0
    text = capsys.readouterr().out
    assert "Pedestrian" not in text and "distance" not in text


def test_split_and_missing_result_files(folders, tmp_path, capsys):
    gt_dir, res_dir, gt, dt, ids = folders
    (res_dir / f"{ids[3]}.txt").unlink()
    split = tmp_path / "val.txt"
    write_imageset(split, ids[:6])
    inp = load_eval_inputs(gt_dir, res_dir, split)
    assert inp.frame_ids == ids[:6]
    assert inp.missing_results == [ids[3]] and len(inp.dt[3]) == 0 and inp.dt[3].score is not None
    assert inp.unused_results == ids[6:]
    assert kitti_eval.main([f"gt={gt_dir}", f"results={res_dir}", f"split={split}"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 of 6 frames have no result file" in err and ids[3] in err
    assert "note: 6 result files are not in the split" in err


def _cli_error(args, capsys) -> str:
    assert kitti_eval.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_bad_result_files_are_clear_errors(folders, capsys):
    gt_dir, res_dir, *_ = folders
    args = [f"gt={gt_dir}", f"results={res_dir}"]
    target = res_dir / "000002.txt"
    good = target.read_text().splitlines()

    def put(line_fn):
        lines = list(good)
        lines[1] = line_fn(lines[1])
        target.write_text("\n".join(lines) + "\n")

    put(lambda s: " ".join(s.split()[:15]))  # score missing on one line
    err = _cli_error(args, capsys)
    assert "000002.txt:2" in err and "15 fields where earlier lines have 16" in err
    target.write_text("".join(" ".join(s.split()[:15]) + "\n" for s in good))  # a label file, not results
    err = _cli_error(args, capsys)
    assert "000002.txt" in err and "need a 16th field (score)" in err
    put(lambda s: s + " 0.5")  # 17 fields
    err = _cli_error(args, capsys)
    assert "000002.txt:2" in err and "got 17" in err
    put(lambda s: " ".join(s.split()[:15] + ["nan"]))  # NaN score
    err = _cli_error(args, capsys)
    assert "000002.txt:2" in err and "NaN" in err
    put(lambda s: " ".join(s.split()[:8] + ["-1.5"] + s.split()[9:]))  # negative height
    err = _cli_error(args, capsys)
    assert "000002.txt:2" in err and "negative box size" in err
    target.write_text("\n".join(good) + "\n")
    assert kitti_eval.main(args) == 0
    capsys.readouterr()


def test_result_without_label_and_label_missing_for_split(folders, tmp_path, capsys):
    gt_dir, res_dir, *_ = folders
    shutil.copy(res_dir / "000001.txt", res_dir / "000099.txt")
    err = _cli_error([f"gt={gt_dir}", f"results={res_dir}"], capsys)
    assert "000099.txt" in err and "1 result file(s) have no label file" in err
    (res_dir / "000099.txt").unlink()
    split = tmp_path / "val.txt"
    write_imageset(split, ["000001", "000050"])
    with pytest.raises(KittiFormatError, match=r"000050.txt: label file not found"):
        load_eval_inputs(gt_dir, res_dir, split)
    assert "not found" in _cli_error([f"gt={gt_dir / 'nope'}", f"results={res_dir}"], capsys)


def test_cli_usage_errors(capsys):
    assert kitti_eval.main(["results=x"]) == 2
    assert "gt= is required" in capsys.readouterr().err
    assert kitti_eval.main(["gt=a", "results=b", "classes=Car,Truck"]) == 2
    assert "choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kitti_eval.main(["gt=a", "bogus=1"])


def test_result_writer_from_lidar_boxes(calib, tmp_path):
    boxes = Boxes3D(
        np.array([[10.0, 1.0, -0.9, 4.0, 1.7, 1.5, 0.3], [20.0, -3.0, -0.8, 0.8, 0.6, 1.7, -1.0]])
    )
    det = boxes_to_labels(boxes, np.array(["Car", "Pedestrian"]), calib, scores=np.array([0.9, 0.4]))
    write_results(tmp_path, ["000007"], [det])
    back = read_label(tmp_path / "000007.txt", with_score=True)
    assert back.name.tolist() == ["Car", "Pedestrian"]
    np.testing.assert_allclose(back.score, [0.9, 0.4])
    # The written boxes evaluate as perfect detections of themselves (IoU 1 in every metric).
    gt = read_label(tmp_path / "000007.txt", with_score=None)
    gt.score = None
    r = evaluate([gt], [back], distance_ranges=None)
    assert r.curves[0, :, 2, 0].tolist() == [1.0, 1.0, 1.0, 1.0]  # Car, hard, first point
    with pytest.raises(ValueError, match="result files need scores"):
        write_results(tmp_path, ["000008"], [gt])


def test_real_kitti_labels_as_their_own_detections(kitti_real, tmp_path):
    """Real label files (DontCare lines with -1/-10/-1000 placeholders, Misc, Truck): the labels scored
    as detections give precision 1 at each of the n counted GT's thresholds (the 41-point rule)."""
    gt_dir = kitti_real / "training" / "label_2"
    res_dir = tmp_path / "res"
    res_dir.mkdir()
    for p in sorted(gt_dir.glob("*.txt")):
        lab = read_label(p, with_score=False)
        lab.score = np.ones(len(lab), np.float32)
        write_label(res_dir / p.name, lab)
    inp = load_eval_inputs(gt_dir, res_dir)
    r = evaluate(inp.gt, inp.dt)
    assert r.num_gt.sum() > 0
    for c, cls in enumerate(r.classes):
        for li, lv in enumerate(r.levels):
            n = int(r.num_gt[c, li])
            for m in ("2d", "bev", "3d", "aos"):
                assert r.ap(cls, m, lv) == pytest.approx(max(min(n, 41) - 1, 0) / 40 * 100, abs=1e-9)


def test_batched_reader_equals_the_file_by_file_reader(folders, tmp_path):
    """read_labels (one parse for all files) gives read_label's values, and on a bad file its error."""
    from detector.data.kitti_batch import read_labels

    gt_dir, res_dir, *_ = folders
    for folder, with_score in ((gt_dir, False), (res_dir, True)):
        paths = sorted(folder.glob("*.txt"))
        for a, b in zip(read_labels(paths, with_score), [read_label(p, with_score) for p in paths], strict=True):
            for f in ("name", "truncated", "occluded", "alpha", "bbox", "dimensions", "location", "rotation_y"):
                np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
            assert (a.score is None) == (not with_score)
            if with_score:
                np.testing.assert_array_equal(a.score, b.score)
    paths = sorted(res_dir.glob("*.txt"))
    good = paths[2].read_text().splitlines()
    # The same tokens as two valid lines, but line 1 has 17 fields (a class name at its end) and line 2 has
    # 15 (no name): the batch must not accept it.
    f = good[0].split()
    paths[2].write_text(" ".join(f + ["Car"]) + "\n" + " ".join(good[1].split()[1:]) + "\n")
    with pytest.raises(KittiFormatError, match=r"000002.txt:1: expected 15 fields \(16 with a score\), got 17"):
        read_labels(paths, with_score=True)
    paths[2].write_text("\n".join(good[:3]) + "\n\n   \n" + "\n".join(good[3:]) + "\n")  # blank lines are fine
    assert len(read_labels(paths, with_score=True)[2]) == len(good)


def test_batched_numbers_are_read_exactly_as_float(tmp_path):
    """Random decimal spellings (0–9 places, repr of doubles, signs, leading zeros, exponents, 15 and more
    digits, -0.00): the batched reader gives float()'s double, bit for bit, without falling back."""
    import random

    import detector.data.kitti_batch as kb

    rng = random.Random(0)
    odd = ["1e-7", "-1e7", "+5", ".5", "5.", "-0.00", "00012.3400", "123456789012345", "1234567890123456",
           "0.000000000000001", "0.0000000000000001", "-10000000"]

    def num():
        r = rng.random()
        if r < 0.5:
            return f"{rng.uniform(-2000, 2000):.{rng.randint(0, 9)}f}"
        if r < 0.7:
            return repr(rng.uniform(-1, 1))
        return rng.choice(odd) if r < 0.8 else str(rng.randint(-99999, 99999))

    paths = []
    for f in range(300):
        lines = []
        for _ in range(rng.randint(0, 8)):
            v = [num() for _ in range(15)]
            v[7:10] = [str(abs(float(x))) for x in v[7:10]]
            lines.append(" ".join([rng.choice(["Car", "Van", "DontCare", "Person_sitting"]), *v]))
        p = tmp_path / f"{f:06d}.txt"
        p.write_text("\n".join(lines) + ("\n" if rng.random() < 0.5 else ""))
        paths.append(p)
    assert kb._parse([p.read_bytes() for p in paths], 16) is not None  # the batch path, no fallback
    for a, p in zip(kb.read_labels(paths, True), paths, strict=True):
        b = read_label(p, True)
        assert a.name.tolist() == b.name.tolist()
        for f in ("truncated", "occluded", "alpha", "bbox", "dimensions", "location", "rotation_y", "score"):
            x, y = getattr(a, f), getattr(b, f)
            assert np.array_equal(x, y) and np.array_equal(np.signbit(x), np.signbit(y)), (p.name, f)
    # Bytes the batch does not take (a lone carriage return, non-ASCII) go through the file-by-file reader.
    paths[0].write_bytes(b"Car 0 0 0 0 0 10 50 1.5 1.6 4 0 1.6 20 0 0.5\rCar 0 0 0 0 0 10 50 1.5 1.6 4 0 1.6 20 0 0.5")
    assert kb._parse([paths[0].read_bytes()], 16) is None
    assert len(kb.read_labels(paths[:1], True)[0]) == 2
