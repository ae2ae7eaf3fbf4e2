"""scripts/bench_memory.py out=X writes the files it says it wrote: X.json and X.md, whatever dots X has (it wrote
X's name with its last dot-part replaced, and said X.json and X.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from detector.bench import memory as bench_memory
from tests.paths import REPO


def _wrote(line: str) -> list[str]:
    """The paths of a ``wrote A and B`` / ``wrote A from B`` line."""
    words = line.split()
    assert words[0] == "wrote", line
    return [words[1], words[3]]


def test_bench_memory_writes_the_files_it_names(tmp_path, tiny_root):
    out = tmp_path / "mem_0.5"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_memory.py"), f"out={out}", f"root={tiny_root}",
                        "bevs=small", "batches=1", "sparsities=dense", "modes=infer"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    said = _wrote(r.stdout.strip().splitlines()[-1])
    assert said == [f"{out}.json", f"{out}.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem_0.5.json", "mem_0.5.md"]
    assert json.loads((tmp_path / "mem_0.5.json").read_text())["rows"][0]["mode"] == "infer"


def test_bench_memory_out_may_name_the_json_file(tmp_path, capsys):
    """out=X.json names the pair X.json and X.md (render_only rewrites X.md from X.json)."""
    meta = {"cpu": "Some CPU", "torch": "2.x", "threads": 2, "allocator": {}, "commands": [], "notes": []}
    (tmp_path / "mem.json").write_text(json.dumps({"meta": meta, "rows": []}))
    bench_memory.main([f"out={tmp_path / 'mem.json'}", "render_only=true"])
    said = _wrote(capsys.readouterr().out.strip())
    assert sorted(said) == sorted([str(tmp_path / "mem.md"), str(tmp_path / "mem.json")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.json", "mem.md"]
