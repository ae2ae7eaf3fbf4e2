"""bench_sparse's correctness checks: every timed call's output against an independent reference, a wrong
call reported as WRONG (how many, by how much) and never as a speed; spconv's row skipped with a note where
spconv is absent. Hand-built cases and fake peers: no spconv needed (the one real-spconv test skips without it)."""

import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from detector.bench import sparse as bench


def _flaky_peer(good: torch.Tensor, wrong_call: int):
    """A peer returning ``good`` on every call but the ``wrong_call``-th (1-based), where one value is off by 0.5."""
    calls = {"n": 0}

    def peer():
        calls["n"] += 1
        out = good.float().clone()
        if calls["n"] == wrong_call:
            out[1, 2] += 0.5
        return out

    return peer, calls


def test_a_peer_wrong_on_its_second_call_is_wrong_and_keeps_no_time():
    ref = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    peer, calls = _flaky_peer(ref, wrong_call=2)
    chk = bench.Check(1e-3)
    entry = bench.peer_entry(bench.timed(peer, 3, check=lambda out: chk.add(bench.site_error(out, ref))), chk)
    assert calls["n"] == 4  # the warm-up and 3 timed calls, each checked
    assert (chk.calls, chk.wrong, chk.ok) == (4, 1, False)
    assert chk.max_abs_err == pytest.approx(0.5)
    assert entry["ms"] is None and entry["ms_median"] is None
    assert entry["verdict"] == "WRONG 1/4 calls, max abs err 0.5"
    assert entry["check"] == {"ok": False, "calls": 4, "wrong": 1, "max_abs_err": 0.5, "tol": 0.001}


def test_a_correct_peer_is_ok_with_its_time():
    ref = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    peer, _ = _flaky_peer(ref, wrong_call=0)
    chk = bench.Check(1e-3)
    entry = bench.peer_entry(bench.timed(peer, 3, check=lambda out: chk.add(bench.site_error(out, ref))), chk)
    assert chk.ok and chk.calls == 4 and chk.max_abs_err == 0.0
    assert entry["verdict"] == "ok" and entry["ms"] > 0 and entry["ms_median"] >= entry["ms"]


def test_not_finite_or_misshapen_output_is_wrong():
    ref = torch.zeros(2, 3, dtype=torch.float64)
    chk = bench.Check(1.0)
    chk.add(bench.site_error(torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]]), ref))
    chk.add(bench.site_error(torch.zeros(3, 2), ref))
    chk.add(bench.site_error(torch.full((2, 3), math.inf), ref))
    assert (chk.calls, chk.wrong) == (3, 3) and chk.max_abs_err == math.inf
    assert chk.as_dict()["max_abs_err"] == "inf"
    assert not bench.Check(1.0).ok  # nothing checked is not a pass


def test_subm_reference_sums_active_neighbours_only():
    # one channel; active pixels (2,2)=1, (2,3)=10, (3,2)=100; (1,2)=1000 is not active and must not count
    x = torch.zeros(1, 1, 6, 5)
    sites = torch.zeros(1, 1, 6, 5)
    for (y, xx), v in (((2, 2), 1.0), ((2, 3), 10.0), ((3, 2), 100.0)):
        x[0, 0, y, xx], sites[0, 0, y, xx] = v, 1.0
    x[0, 0, 1, 2] = 1000.0
    coords = torch.tensor([[0, 2, 2], [0, 2, 3], [0, 3, 2]])
    up = torch.zeros(1, 1, 3, 3)
    up[0, 0, 0, 1] = 1.0  # out[p] = in[p + (-1, 0)]
    right = torch.zeros(1, 1, 3, 3)
    right[0, 0, 1, 2] = 1.0  # out[p] = in[p + (0, +1)]
    assert bench.subm_reference(x, sites, up, coords).flatten().tolist() == [0.0, 0.0, 1.0]
    assert bench.subm_reference(x, sites, right, coords).flatten().tolist() == [10.0, 0.0, 0.0]


class _FakeSparseTensor:
    def __init__(self, features, indices, spatial_shape, batch_size):
        self.features, self.indices = features, indices
        self.spatial_shape, self.batch_size = spatial_shape, batch_size

    def replace_feature(self, features):
        return _FakeSparseTensor(features, self.indices, self.spatial_shape, self.batch_size)


def _fake_spconv(wrong_call: int, shuffle: bool = False) -> types.ModuleType:
    """A stand-in for ``spconv.pytorch``: a submanifold 3x3 convolution written out neighbour by neighbour
    (weight [out, kh, kw, in] as spconv's), off by 0.5 on its ``wrong_call``-th call; ``shuffle``: its
    output rows in reverse order (with their indices), which is still right."""
    calls = {"n": 0}

    class SubMConv2d(torch.nn.Module):
        def __init__(self, cin, cout, k, bias=False, indice_key=None):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(cout, k, k, cin))

        def forward(self, t):
            calls["n"] += 1
            where = {tuple(c): i for i, c in enumerate(t.indices.tolist())}
            out = torch.zeros(t.features.shape[0], self.weight.shape[0])
            for i, (n, y, x) in enumerate(t.indices.tolist()):
                for dy in (-1, 0, 1):
                    for dx in (-1, 0, 1):
                        j = where.get((n, y + dy, x + dx))
                        if j is not None:
                            out[i] += self.weight[:, dy + 1, dx + 1, :] @ t.features[j]
            if calls["n"] == wrong_call:
                out[0, 0] += 0.5
            idx = t.indices
            if shuffle:
                out, idx = out.flip(0), idx.flip(0)
            return _FakeSparseTensor(out, idx, t.spatial_shape, t.batch_size)

    mod = types.ModuleType("spconv.pytorch")
    mod.SubMConv2d, mod.SparseConvTensor = SubMConv2d, _FakeSparseTensor
    mod.calls = calls
    return mod


def _install(monkeypatch, mod):
    pkg = types.ModuleType("spconv")
    pkg.pytorch = mod
    monkeypatch.setitem(sys.modules, "spconv", pkg)
    monkeypatch.setitem(sys.modules, "spconv.pytorch", mod)


def _active_map(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(1, 3, 6, 7)
    sites = (torch.rand(1, 1, 6, 7) < 0.5).float()
    return x, sites, sites[:, 0].nonzero()  # nonzero(): not contiguous, as in the benchmark


def test_spconv_row_wrong_on_the_second_call_is_reported_wrong(monkeypatch):
    fake = _fake_spconv(wrong_call=2)  # call 1 builds the rulebook to reuse; call 2 is the first timed one's warm-up
    _install(monkeypatch, fake)
    x, sites, coords = _active_map()
    res = bench.spconv_peer(x, sites, coords, reps=2, tol=1e-3)
    built, reused = res["with_rulebook"], res["rulebook_reused"]
    assert built["ms"] is None and built["verdict"] == "WRONG 1/3 calls, max abs err 0.5"
    assert reused["verdict"] == "ok" and reused["ms"] > 0
    assert fake.calls["n"] == 1 + 3 + 3
    row = {"stage": 1, "sparsity": 0.5, "active_pixels": len(coords), "block_size": 16}
    peer = {"threads": 2, "dense": reused, "ours": reused, "spconv_subm": res}
    cells = bench.peer_cells(row, peer)
    assert cells[6] == "WRONG 1/3 calls, max abs err 0.5"  # never a time in the built cell
    assert cells[7] == f"{reused['ms']:.1f}" and cells[8] == "1.00x"


def test_spconv_row_right_in_any_order_is_ok(monkeypatch):
    _install(monkeypatch, _fake_spconv(wrong_call=0, shuffle=True))
    x, sites, coords = _active_map(1)
    res = bench.spconv_peer(x, sites, coords, reps=2, tol=1e-3)
    assert [res[k]["verdict"] for k in ("with_rulebook", "rulebook_reused")] == ["ok", "ok"]


def test_spconv_absent_is_skipped_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "spconv", None)  # import spconv.pytorch raises ImportError
    monkeypatch.setitem(sys.modules, "spconv.pytorch", None)
    x, sites, coords = _active_map()
    res = bench.spconv_peer(x, sites, coords, reps=2, tol=1e-3)
    assert set(res) == {"skipped"}
    assert "spconv does not import here" in res["skipped"] and "not a project dependency" in res["skipped"]
    row = {"stage": 4, "sparsity": 0.9, "active_pixels": len(coords), "block_size": 16, "threads": 1,
           "allocator": {}, "dtype": "float32"}
    ok = {"ms": 1.0, "ms_median": 1.0, "verdict": "ok"}
    row["peers"] = [{"threads": 1, "dense": ok, "ours": ok, "spconv_subm": res}]
    md = "\n".join(bench.peers_markdown([row]))
    assert "| skipped | skipped | - |" in md and f"spconv skipped: {res['skipped']}." in md


@pytest.mark.parametrize("layer", ["conv3x3", "bottleneck"])
def test_our_unit_matches_the_reference_and_a_corrupted_output_does_not(layer):
    m = bench.make_layer(layer, 8, 8).eval()
    torch.manual_seed(3)
    x = torch.randn(1, 8, 24, 20).contiguous(memory_format=torch.channels_last)
    geo = m.geometry(24, 20)
    mask, _ = bench.random_tile_mask(geo.block, 1, 0.5, seed=0)
    coords = (mask > m.tol)[:, 0].nonzero()
    ref = bench.dense_reference(m, x)
    with torch.no_grad():
        dense_chk = bench.new_check(ref, 1e-3)
        bench.timed(lambda: m(x), 1, check=bench.map_checker(dense_chk, ref))
        ok = bench.new_check(ref, 1e-3)
        bench.timed(lambda: m(x, mask=mask), 1, check=bench.map_checker(ok, ref, coords))
        bad = bench.new_check(ref, 1e-3)
        n, yy, xx = coords[0].tolist()

        def corrupted():
            out = m(x, mask=mask).clone()
            out[n, :, yy, xx] += 1.0
            return out

        bench.timed(corrupted, 1, check=bench.map_checker(bad, ref, coords))
    assert dense_chk.ok and ok.ok, (dense_chk, ok)
    assert (bad.calls, bad.wrong) == (2, 2) and bad.max_abs_err == pytest.approx(1.0, abs=1e-3)


def test_a_wrong_part_withholds_its_times():
    row = {"dense_ms": 10.0, "dense_ms_median": 11.0, "sparse_ms": 2.0, "sparse_ms_median": 2.5,
           "sparse_ms_by_block": {"16": 2.0}, "speedup": 5.0, "auto_speedup": 5.0, "sparse_inplace_ms": 1.0,
           "speedup_inplace": 10.0}
    wrong = bench.Check(1e-3)
    wrong.add(0.7)
    right = bench.Check(1e-3)
    right.add(0.0)
    bench.withhold_wrong(row, {"dense": right, "sparse": wrong, "sparse_inplace": right})
    assert row["dense_ms"] == 10.0 and row["sparse_inplace_ms"] == 1.0 and row["speedup_inplace"] == 10.0
    assert all(row[k] is None for k in ("sparse_ms", "sparse_ms_median", "sparse_ms_by_block", "speedup",
                                        "auto_speedup"))
    assert bench.row_verdict(row) == "WRONG: sparse 1/1 calls wrong, max abs err 0.7"
    assert bench._num(row["speedup"], ".2f", "x") == "WRONG"


def test_real_spconv_one_thread_is_checked_ok():
    pytest.importorskip("spconv.pytorch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # spconv's CPU convolution races with 2 threads: the check is what catches that
    try:
        x, sites, coords = _active_map(2)
        res = bench.spconv_peer(x, sites, coords, reps=2, tol=1e-3)
    finally:
        torch.set_num_threads(before)
    assert "skipped" not in res, res
    assert [res[k]["verdict"] for k in ("with_rulebook", "rulebook_reused")] == ["ok", "ok"]


def test_dense_reference_is_the_resnet_rule_by_hand():
    m = bench.make_layer("conv3x3", 4, 8).eval()
    x = torch.randn(1, 4, 9, 7)
    conv, bn = m.convs[0], m.bns[0]
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    want = F.relu(F.conv2d(x, conv.weight, padding=1) * scale[:, None, None]
                  + (bn.bias - bn.running_mean * scale)[:, None, None])
    assert torch.allclose(bench.dense_reference(m, x).float(), want, atol=1e-5)
