"""The installable package: ``pip install .`` builds a wheel that holds the kernel sources and the Hydra
configs, installs into a fresh venv, and its console entry points run with the source tree off the path.

No network: the wheel is built without build isolation (setuptools from this venv), installed with
``--no-deps``, and the fresh venv reaches the dependencies (torch, hydra, open3d ...) through a ``.pth``
line naming this venv's site-packages (a plain path line: this venv's own editable ``detector`` hook,
itself a ``.pth`` there, is not run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.paths import REPO

SHIPPED = ("pyproject.toml", "README.md", "detector", "kernels", "configs")
ENTRY_POINTS = ("detector-train", "detector-evaluate", "detector-kitti-eval", "detector-make-dataset",
                "detector-inspect-dataset", "detector-visualize", "detector-export", "detector-predict")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build")


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip install .`` builds, from a copy of the files a fresh clone has."""
    src = tmp_path_factory.mktemp("clone")
    for name in SHIPPED:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=_IGNORE)
        else:
            shutil.copy2(p, src / name)
    out = tmp_path_factory.mktemp("dist")
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
              "-w", out, src], cwd=src)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("sbnet_bev_detector-*.whl")  # the distribution's name; the import package is detector/
    return whl


def _files_under(root: Path, pattern: str) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts}


def test_wheel_holds_every_package_kernel_source_and_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "detector").rglob("__init__.py")}
    missing = sorted(f"{pkg}/__init__.py" for pkg in packages if f"{pkg}/__init__.py" not in names)
    assert not missing, f"packages missing from the wheel (add them to pyproject's packages): {missing}"
    kernels = _files_under(REPO / "kernels", "**/*")
    assert {"ops.cpp"} <= kernels and any(k.startswith("cpu/") for k in kernels)
    assert {f"detector/_kernels/{k}" for k in kernels} <= names
    configs = _files_under(REPO / "configs", "**/*.yaml")
    assert {f"detector/_configs/{c}" for c in configs} <= names
    (info,) = {n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA")}
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "\nName: sbnet-bev-detector\n" in metadata, metadata[:300]
    entry = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert all(f"{e} = " in entry for e in ENTRY_POINTS), entry


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (``--no-deps``; the dependencies come from this venv)."""
    env_dir = tmp_path_factory.mktemp("venv")
    r = _run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=env_dir)
    assert r.returncode == 0, r.stderr
    py = env_dir / "bin" / "python"
    r = _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel],
             cwd=env_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=env_dir).stdout.strip()
    (Path(site) / "_deps_from_dev_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


def _clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PROJECT_ROOT", "HYDRA_FULL_ERROR")}
    env["DETECTOR_KERNELS_BUILD_DIR"] = str(tmp / "kernel_build")
    return env


def test_installed_package_runs_without_the_source_tree(venv, tmp_path):
    env = _clean_env(tmp_path)
    py = venv / "bin" / "python"
    probe = ("import detector, detector.resources as r; from detector.ops import _library as L; "
             "print(detector.__file__); print(L.kernels_dir()); print(r.config_dir()); "
             "print(all(__import__('os').path.isfile(s) for s in L.sources(False)))")
    r = _run([py, "-c", probe], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    module, kernels, configs, sources_exist = r.stdout.split()
    for p in (module, kernels, configs):
        assert Path(p).resolve().is_relative_to(venv.resolve()), (p, venv)
    assert sources_exist == "True"

    data = tmp_path / "tiny"
    r = _run([venv / "bin" / "detector-make-dataset", f"out={data}", "frames=5", "columns=300", "workers=1",
              "progress=false"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run([venv / "bin" / "detector-inspect-dataset", f"root={data}"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "frames on disk: 5" in r.stdout and "split train" in r.stdout
    # Hydra composes the wheel's configs: a bad value is refused in one line before anything runs.
    r = _run([venv / "bin" / "detector-train", f"data.root={data}", f"paths.output_dir={tmp_path / 'run'}",
              "trainer.max_epochs=abc"], cwd=tmp_path, env=env)
    assert r.returncode == 1
    assert r.stderr.strip() == "error: trainer.max_epochs='abc': expected int or null", r.stderr[-3000:]


@pytest.mark.slow
def test_installed_entry_point_trains_and_evaluates(venv, tmp_path):
    """detector-train end to end from the wheel: JIT-builds the kernels from the wheel's sources, trains two
    steps on a tiny simulated set, evaluates the checkpoint (detector-evaluate)."""
    env = _clean_env(tmp_path)
    data, run = tmp_path / "tiny", tmp_path / "run"
    r = _run([venv / "bin" / "detector-make-dataset", f"out={data}", "frames=5", "columns=300", "workers=1",
              "progress=false"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    small = ["bev.x_range=[0,25.6]", "bev.y_range=[-12.8,12.8]", "model.backbone.stem_channels=8",
             "model.backbone.stage_units=[1,1,1,1]", "model.backbone.stage_channels=[8,8,16,16]",
             "model.neck_channels=8", "model.head_channels=8", "data.batch_size=2", "data.augment=null",
             "trainer.max_steps=2", "callbacks.model_checkpoint.monitor=null", "callbacks.progress_bar=null",
             "logger=none", "evaluate_after=false"]
    r = _run([venv / "bin" / "detector-train", f"data.root={data}", f"paths.output_dir={run}", *small],
             cwd=tmp_path, env=env, timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "sbnet kernels unavailable" not in r.stdout + r.stderr
    assert list((tmp_path / "kernel_build").rglob("*.so")), "the kernels were not built from the wheel's sources"
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    r = _run([venv / "bin" / "detector-evaluate", f"ckpt_path={ckpt}", f"data.root={data}",
              f"paths.output_dir={tmp_path / 'eval'}"], cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "eval" / "metrics.json").is_file()


def test_a_cuda_only_edit_leaves_the_cpu_library_up_to_date(tmp_path):
    """The CPU-only library depends on kernels/ outside cuda/ and emulate/: editing a CUDA file must not make
    `import detector` treat it as stale (ninja would not relink it, and saved programs would stop loading)."""
    from detector.ops import _library

    src = tmp_path / "kernels"
    for rel in ("common.h", "cpu/a.cpp", "cuda/b.cu", "emulate/c.cpp"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("//\n")
        os.utime(src / rel, (1000, 1000))
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")
    os.utime(lib, (2000, 2000))
    assert not _library._stale(lib, src, with_cuda=False) and not _library._stale(lib, src, with_cuda=True)
    for rel in ("cuda/b.cu", "emulate/c.cpp"):
        os.utime(src / rel, (3000, 3000))
        assert not _library._stale(lib, src, with_cuda=False) and _library._stale(lib, src, with_cuda=True)
    os.utime(src / "common.h", (3000, 3000))
    assert _library._stale(lib, src, with_cuda=False)
    assert _library._stale(tmp_path / "missing.so", src, with_cuda=False)


def test_every_package_declares_its_api():
    """Each package of ``detector`` declares ``__all__``, and every name in it is importable from the package (a
    name its ``__init__`` imports, or one of its modules)."""
    import importlib
    import pkgutil

    import detector

    packages = [m.name for m in pkgutil.walk_packages(detector.__path__, "detector.") if m.ispkg]
    assert {"detector.data", "detector.models", "detector.nn", "detector.ops", "detector.eval"} <= set(packages)
    for name in packages:
        pkg = importlib.import_module(name)
        assert isinstance(getattr(pkg, "__all__", None), list | tuple), f"{name}/__init__.py declares no __all__"
        for item in pkg.__all__:
            assert hasattr(pkg, item) or importlib.util.find_spec(f"{name}.{item}") is not None, f"{name}.{item}"
