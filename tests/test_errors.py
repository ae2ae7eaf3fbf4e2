"""Which errors print as one line: the project's own types, Hydra's, and Hydra instantiating a node the user's config
got wrong; anything else is a bug and keeps its traceback (errors.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from detector.errors import CheckpointError, ConfigError, KittiFormatError, is_user_error, one_line, run_cleanly
from tests.paths import REPO


def _instantiation_error(node: dict) -> Exception:
    with pytest.raises(Exception) as e:
        instantiate(OmegaConf.create({"outer": node}).outer)
    return e.value


class _Buggy:
    def __init__(self, x: int):
        raise ValueError("a bug deep inside")


class _Checked:
    def __init__(self, x: int):
        raise ConfigError(f"_Checked.x must be > 0, got {x}")


@pytest.mark.parametrize("error", [ConfigError("model.x: bad"), KittiFormatError("/d/a.txt", "broken", 3),
                                   CheckpointError("/c.ckpt: checkpoint not found")])
def test_project_errors_print_one_line(error, capsys):
    def fail():
        raise error

    with pytest.raises(SystemExit) as e:
        run_cleanly(fail)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(error) in err


@pytest.mark.parametrize("error", [ValueError("a bug"), FileNotFoundError(2, "No such file"), KeyError("k"),
                                   RuntimeError("size mismatch")])
def test_other_errors_keep_their_traceback(error):
    def fail():
        raise error

    with pytest.raises(type(error)):
        run_cleanly(fail)
    assert not is_user_error(error)


def test_instantiation_errors_split_by_cause():
    """A node whose keys do not fit the target's signature, or whose target raises a project error, is the user's;
    a target failing with anything else (a bug inside the constructor) is not."""
    unknown_key = _instantiation_error({"_target_": f"{__name__}._Checked", "x": 1, "y": 2})
    assert is_user_error(unknown_key) and "unexpected keyword argument 'y'" in one_line(unknown_key)
    missing = _instantiation_error({"_target_": f"{__name__}._Checked"})
    assert is_user_error(missing) and "missing 1 required positional argument" in one_line(missing)
    checked = _instantiation_error({"_target_": f"{__name__}._Checked", "x": -1})
    assert is_user_error(checked) and one_line(checked) == "error: outer: _Checked.x must be > 0, got -1"
    buggy = _instantiation_error({"_target_": f"{__name__}._Buggy", "x": 1})
    assert not is_user_error(buggy)


def test_a_bad_config_value_is_one_line_naming_the_node(tiny_root, tmp_path):
    """A value an augmentation op checks, through the training command."""
    r = subprocess.run([sys.executable, "scripts/train.py", f"data.root={tiny_root}", f"hydra.run.dir={tmp_path}",
                        "data.augment.ops.2.prob=2", "logger=none"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == ("error: data.augment.ops2: GlobalFlip.prob must be a probability "
                                                 "in [0, 1], got 2")
