"""The documentation keeps its promises: README.md and docs/*.md link only to files that exist, cite only benchmark
files that exist, and every command line they show is accepted as written.

Nothing here runs a job: ``scripts/train.py`` / ``scripts/evaluate.py`` lines are composed with Hydra against the
real configs (as the commands' own override check does before they start), the ``key=value`` scripts' lines go
through the command's own argument parser, stopped right after it accepts them, ``make`` lines name targets of the
Makefile and ``detector-*`` names commands of pyproject.toml. tests/test_docs_run.py runs the command lines.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from detector import cli
from detector.resources import config_dir
from tests.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
HYDRA_SCRIPTS = {"train.py": "train", "evaluate.py": "eval"}
# Placeholders the docs write where the reader puts their own value.
PLACEHOLDERS = {"<run>": "run", "...": "dummy"}

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_BENCH = re.compile(r"benchmarks/[\w./-]*[\w/]")
_COMMAND = re.compile(r"^(?:\.venv/bin/)?python3? (scripts/[\w/]+\.py)\b(.*)$")
_INLINE = re.compile(r"(?<!`)`(?:\.venv/bin/)?(?:python3? )?(scripts/[\w/]+\.py)(\s[^`]*=[^`]*)`(?!`)")
# an inline `python scripts/X.py` without arguments: the command run with its defaults
_INLINE_BARE = re.compile(r"(?<!`)`(?:\.venv/bin/)?python3? (scripts/[\w/]+\.py)`(?!`)")
_MAKE_CODE = re.compile(r"^(make [^#]*?)\s*(?:#\s.*)?$")
_MAKE_INLINE = re.compile(r"(?<!`)`(make [^`]*)`(?!`)")


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def _code_lines(text: str) -> list[str]:
    """The lines inside fenced code blocks, a line continued with a trailing backslash joined to the next."""
    out, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            line = pending + line.strip()
            pending = line[:-1] + " " if line.endswith("\\") else ""
            if not pending:
                out.append(line)
    return out


def _commands() -> list[tuple[str, str, list[str]]]:
    """(doc, script, arguments) of every ``python scripts/...`` line in a code block of the docs, and of every inline
    ``scripts/... key=value`` span with arguments (e.g. in a results table): the comment cut, optional
    ``[key=value]`` brackets dropped, placeholders filled in."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        lines = [(m.group(1), re.split(r"\s+#\s", m.group(2), maxsplit=1)[0])
                 for m in map(_COMMAND.match, _code_lines(text)) if m]
        lines += [(m.group(1), m.group(2).replace("\n", " ")) for m in _INLINE.finditer(text)]
        lines += [(m.group(1), "") for m in _INLINE_BARE.finditer(text)]
        for script, args in lines:
            for key, value in PLACEHOLDERS.items():
                args = args.replace(key, value)
            tokens = [t[1:-1] if t.startswith("[") and t.endswith("]") else t for t in shlex.split(args)]
            found.append((_rel(doc), script, tokens))
    return found


def _make_lines() -> list[str]:
    """Every ``make ...`` line of a code block (its comment cut) and every inline ``make ...`` span of the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        found += [m.group(1) for m in map(_MAKE_CODE.match, _code_lines(text)) if m]
        found += [m.group(1) for m in _MAKE_INLINE.finditer(text)]
    return sorted({" ".join(line.split()) for line in found})


def test_the_docs_exist_and_the_readme_is_short():
    names = {p.name for p in DOCS}
    for page in ("getting-started.md", "real-kitti.md", "speed.md", "gpu.md", "architecture.md",
                 "troubleshooting.md"):
        assert page in names, f"docs/{page} is missing"
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it <= 150 (details belong in docs/)"
    readme = "\n".join(lines)
    for page in ("docs/real-kitti.md", "docs/gpu.md", "docs/speed.md"):
        assert f"]({page}" in readme, f"README.md does not link {page}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc):
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the page itself
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{_rel(doc)} links to missing files: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_cited_benchmark_files_exist(doc):
    missing = []
    for cited in set(_BENCH.findall(doc.read_text())):
        path = REPO / cited
        if not path.exists() and not list(path.parent.glob(path.name + "*")):  # a prefix such as ..._c7t45*.md
            missing.append(cited)
    assert not missing, f"{_rel(doc)} cites benchmark files that do not exist: {sorted(missing)}"


def test_the_docs_show_commands():
    scripts = {s for _, s, _ in _commands()}
    assert {"scripts/train.py", "scripts/evaluate.py", "scripts/make_dataset.py", "scripts/kitti_eval.py"} <= scripts


def test_make_lines_name_targets_of_the_makefile():
    """A documented ``make TARGET [VAR=...]`` names a target the Makefile has, and sets only ``ARGS``."""
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for line in _make_lines():
        words = shlex.split(line)[1:]
        assert words and words[0] in targets, f"`{line}`: no such target in the Makefile ({sorted(targets)})"
        assert all(w.startswith("ARGS=") for w in words[1:]), f"`{line}`: only ARGS= is passed to the Makefile"


def test_documented_console_commands_exist():
    """Every ``detector-NAME`` the docs name is a console command of pyproject.toml."""
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)^\[", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    declared = set(re.findall(r"^(detector-[\w-]+) =", scripts.group(1), re.M))
    named = {n for doc in DOCS for n in re.findall(r"`(detector-[a-z-]*[a-z])`", doc.read_text())}
    assert named and not named - declared, f"the docs name commands pyproject.toml does not declare: {named - declared}"


def _sweeps(overrides: list[str]) -> list[list[str]]:
    """The single runs of a ``-m`` command line: one list of overrides per value of each swept key."""
    runs = [[]]
    for o in OverridesParser.create().parse_overrides(overrides):
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        runs = [r + [f"{o.get_key_element()}={v}"] for r in runs for v in values]
    return runs


HYDRA_LINES = [c for c in _commands() if Path(c[1]).name in HYDRA_SCRIPTS]
KV_LINES = [c for c in _commands() if Path(c[1]).name not in HYDRA_SCRIPTS]


@pytest.mark.parametrize(("doc", "script", "args"), HYDRA_LINES, ids=[" ".join([c[1], *c[2]]) for c in HYDRA_LINES])
def test_hydra_command_lines_compose(doc, script, args):
    multirun = "-m" in args or "--multirun" in args
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    assert not [a for a in overrides if a.startswith("-")], f"{doc}: flags other than -m in {script} {args}"
    config_name = HYDRA_SCRIPTS[Path(script).name]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        for run in _sweeps(overrides) if multirun else [overrides]:
            cfg = compose(config_name, overrides=run)
            container = OmegaConf.to_container(cfg, resolve=False)
            assert "???" not in str(container), f"{doc}: {script} {run} leaves a mandatory value unset"


class _Accepted(Exception):
    """Raised in place of running a command once its arguments are parsed."""


def _load(script: str):
    """The module whose ``main`` the script runs (a thin script's, e.g. ``detector.bench.train``)."""
    name = "_docs_" + Path(script).stem
    spec = importlib.util.spec_from_file_location(name, REPO / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return importlib.import_module(mod.main.__module__) if hasattr(mod, "main") else mod


@pytest.mark.parametrize(("doc", "script", "args"), KV_LINES, ids=[" ".join([c[1], *c[2]]) for c in KV_LINES])
def test_key_value_command_lines_parse(doc, script, args, monkeypatch):
    """The command's own parser (detector.cli.parse_args with its defaults) accepts every key=value of the line;
    the command stops there. A script that mixes its own keys (``OWN``) with Hydra overrides has each part
    checked against its own side."""
    assert (REPO / script).is_file(), f"{doc}: {script} does not exist"
    mod = _load(script)
    if hasattr(mod, "OWN"):
        own = [a for a in args if a.partition("=")[0] in mod.OWN]
        hydra_args = [a for a in args if a not in own]
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            compose("train", overrides=hydra_args)
        return
    main = mod.main
    accepted = []

    def parse_and_stop(argv, defaults, usage):
        accepted.append(cli.parse_args(argv, defaults, usage))
        raise _Accepted

    monkeypatch.setitem(main.__globals__, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [script, *args])
    try:
        main(args) if inspect.signature(main).parameters else main()
    except _Accepted:
        pass
    except SystemExit as e:
        pytest.fail(f"{doc}: `{script} {' '.join(args)}` is refused: {e}")
    assert accepted, f"{script}'s main did not parse its arguments with detector.cli.parse_args"


def test_no_dates_in_the_readme_configs_or_code():
    """Configs, code and the README say why, not when: the record with its dates lives in docs/ and benchmarks/."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    files = [REPO / "README.md"] + [p for d in ("configs", "detector", "kernels") for p in sorted((REPO / d).rglob("*"))
                                    if p.suffix in (".py", ".yaml", ".h", ".cpp", ".cu", ".md")]
    dated = [f"{_rel(p)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if date.search(line)]
    assert not dated, f"dates in {dated}: move the record to docs/speed.md or benchmarks/, say why instead"


def test_benchmarks_readme_indexes_every_result():
    """benchmarks/README.md names every file and folder of benchmarks/, and every result (.json/.md) of a study folder
    that has no README of its own."""
    bench = REPO / "benchmarks"
    index = (bench / "README.md").read_text()
    missing = [p.name for p in bench.iterdir() if p.name != "README.md" and f"]({p.name}" not in index]
    for folder in (p for p in bench.iterdir() if p.is_dir() and not (p / "README.md").is_file()):
        missing += [f"{folder.name}/{f.name}" for f in folder.iterdir()
                    if f.suffix in (".json", ".md") and f"]({folder.name}/{f.name})" not in index]
    assert not missing, f"benchmarks/README.md does not index: {sorted(missing)}"
