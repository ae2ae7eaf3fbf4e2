"""The protocol's matching, vectorized over all frames and all score thresholds at once.

The protocol (see :mod:`detector.eval.protocol`) matches frame by frame, GT in file order, with a
greedy rule whose outcome depends on which detections earlier GT took. Only GT–detection pairs whose
overlap exceeds the minimum ("edges") can ever match, so the matching splits into independent connected
components of the edge graph; in practice almost all are one GT with one detection. We group the
components by size, pad each group to the same (GT, detection) counts, and run the protocol's loop over
the GT slots with NumPy over all components of a group (and, in the second pass, all thresholds) at once.
GT without edges are false negatives (if counted) and detections without edges false positives (if
counted, above the threshold and not in a DontCare region), in closed form.

The edge graph is the same at every level (levels only switch records between "counted" and "ignored";
a detection of another class enters as an ignored candidate where it is lower than the level's minimum
height), so :class:`MatchGraph` is built once per class and metric and :func:`match_level` runs per level.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from detector.eval.protocol import N_SAMPLE_PTS, score_thresholds


@dataclass
class _Bucket:
    """Components padded to Gp GT and Dp detection slots. Indices are positions in the class's GT /
    detection candidate lists, -1 for padding. ``edge`` [C, Gp, Dp]: overlap > minimum; ``overlap`` the
    overlap there (0 elsewhere)."""

    gt: np.ndarray  # [C, Gp]
    det: np.ndarray  # [C, Dp]
    edge: np.ndarray  # [C, Gp, Dp] bool
    overlap: np.ndarray  # [C, Gp, Dp]


@dataclass
class MatchGraph:
    """The edges of one class in one metric, split into padded component buckets.

    ``n_gt`` / ``n_det``: sizes of the class's GT / detection candidate lists (global order = frame
    order, then file order). ``gt_isolated`` / ``det_isolated``: candidates without any edge.
    """

    n_gt: int
    n_det: int
    buckets: list[_Bucket]
    gt_isolated: np.ndarray  # bool [n_gt]
    det_isolated: np.ndarray  # bool [n_det]


@dataclass
class LevelCounts:
    """Counts at each score threshold of one class / level / metric (summed over frames)."""

    thresholds: np.ndarray  # [T] (T <= 41)
    tp: np.ndarray  # [T]
    fp: np.ndarray  # [T]
    fn: np.ndarray  # [T]
    similarity: np.ndarray  # [T] sum over TPs of (1 + cos(alpha_gt - alpha_det)) / 2
    n_gt: int

    def curves(self) -> tuple[np.ndarray, np.ndarray]:
        """(precision, orientation similarity) at the thresholds, TP+FP = 0 giving 0."""
        denom = self.tp + self.fp
        safe = np.maximum(denom, 1)
        prec = np.where(denom > 0, self.tp / safe, 0.0)
        aos = np.where(denom > 0, self.similarity / safe, 0.0)
        return prec, aos


def _components(u: np.ndarray, v: np.ndarray, n_u: int, n_v: int) -> np.ndarray:
    """Connected-component label (the smallest node id) of every node of a bipartite graph with nodes
    0..n_u-1 (GT) and n_u..n_u+n_v-1 (detections) and edges (u[k], n_u + v[k])."""
    a, b = u, v + n_u
    label = np.arange(n_u + n_v)
    while True:
        m = np.minimum(label[a], label[b])
        new = label.copy()
        np.minimum.at(new, a, m)
        np.minimum.at(new, b, m)
        new = new[new]
        if np.array_equal(new, label):
            return label
        label = new


def _ceil_pow2(x: np.ndarray) -> np.ndarray:
    return (1 << np.ceil(np.log2(np.maximum(x, 1))).astype(np.int64)).astype(np.int64)


def build_graph(
    gt_idx: np.ndarray, det_idx: np.ndarray, overlap: np.ndarray, min_overlap: float, n_gt: int, n_det: int
) -> MatchGraph:
    """Graph of the pairs (gt_idx[k], det_idx[k]) (positions in the candidate lists, both within one
    frame) whose overlap > ``min_overlap``."""
    keep = overlap > min_overlap
    gu, dv, ov = gt_idx[keep], det_idx[keep], overlap[keep]
    gt_isolated = np.ones(n_gt, bool)
    det_isolated = np.ones(n_det, bool)
    gt_isolated[gu] = False
    det_isolated[dv] = False
    if gu.size == 0:
        return MatchGraph(n_gt, n_det, [], gt_isolated, det_isolated)
    g_nodes, gu_c = np.unique(gu, return_inverse=True)
    d_nodes, dv_c = np.unique(dv, return_inverse=True)
    nu, nv = g_nodes.size, d_nodes.size
    label = _components(gu_c, dv_c, nu, nv)
    comp_ids, comp = np.unique(label, return_inverse=True)
    n_comp = comp_ids.size
    comp_g, comp_d = comp[:nu], comp[nu:]
    cnt_g = np.bincount(comp_g, minlength=n_comp)
    cnt_d = np.bincount(comp_d, minlength=n_comp)

    # Slot of each node within its component, in global order (nodes are sorted by global index).
    def slots(c: np.ndarray, counts: np.ndarray) -> np.ndarray:
        order = np.argsort(c, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        s = np.empty_like(c)
        s[order] = np.arange(c.size) - starts[c[order]]
        return s

    slot_g, slot_d = slots(comp_g, cnt_g), slots(comp_d, cnt_d)
    key_g, key_d = _ceil_pow2(cnt_g), _ceil_pow2(cnt_d)
    buckets = []
    edge_comp = comp_g[gu_c]
    for kg, kd in sorted(set(zip(key_g.tolist(), key_d.tolist(), strict=True))):
        members = np.flatnonzero((key_g == kg) & (key_d == kd))
        C = members.size
        row = np.full(n_comp, -1)
        row[members] = np.arange(C)
        gt = np.full((C, kg), -1)
        det = np.full((C, kd), -1)
        sel = row[comp_g] >= 0
        gt[row[comp_g[sel]], slot_g[sel]] = g_nodes[sel]
        sel = row[comp_d] >= 0
        det[row[comp_d[sel]], slot_d[sel]] = d_nodes[sel]
        edge = np.zeros((C, kg, kd), bool)
        ovl = np.zeros((C, kg, kd))
        sel = row[edge_comp] >= 0
        r, sg, sd = row[edge_comp[sel]], slot_g[gu_c[sel]], slot_d[dv_c[sel]]
        edge[r, sg, sd] = True
        ovl[r, sg, sd] = ov[sel]
        buckets.append(_Bucket(gt, det, edge, ovl))
    return MatchGraph(n_gt, n_det, buckets, gt_isolated, det_isolated)


def _take(values: np.ndarray, idx: np.ndarray, pad) -> np.ndarray:
    """values[idx] with ``pad`` where idx == -1."""
    return np.where(idx >= 0, values[np.maximum(idx, 0)], pad)


def _sum_at_or_above(scores: np.ndarray, thr: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """For each threshold thr[k] (non-increasing), the number (or total weight) of ``scores`` >= thr[k]."""
    T = thr.size
    asc = thr[::-1]
    pos = np.searchsorted(asc, scores, side="right")  # how many thresholds each score reaches
    hist = np.bincount(pos, weights=weights, minlength=T + 1)
    tail = np.cumsum(hist[::-1])[::-1]  # tail[p] = sum of hist[p:]
    return tail[1:][::-1]


def match_level(
    graph: MatchGraph,
    gt_state: np.ndarray,
    det_state: np.ndarray,
    det_score: np.ndarray,
    det_in_dontcare: np.ndarray,
    gt_alpha: np.ndarray,
    det_alpha: np.ndarray,
) -> LevelCounts:
    """Run both passes of the protocol for one level.

    ``gt_state`` [n_gt]: 0 counted, 1 ignored. ``det_state`` [n_det]: 0 counted, 1 ignored, -1 not a
    candidate at this level. ``det_in_dontcare`` [n_det]: the detection's overlap with a DontCare region
    of its frame exceeds the minimum (only used for counted detections).
    """
    n_gt = int((gt_state == 0).sum())
    fn_isolated = int(((gt_state == 0) & graph.gt_isolated).sum())

    # Components of one GT and one detection (most of them) in closed form; the others padded.
    single, views = None, []
    for b in graph.buckets:
        if b.edge.shape[1:] == (1, 1):
            g, d = b.gt[:, 0], b.det[:, 0]
            single = (gt_state[g], det_state[d], det_score[d], gt_alpha[g] - det_alpha[d])
        else:
            ig = _take(gt_state, b.gt, -1)
            idt = _take(det_state, b.det, -1)
            views.append((b, ig, idt, _take(det_score, b.det, -np.inf)))

    # Pass 1: each GT takes the unassigned candidate with the highest score; TP scores give thresholds.
    tp_scores = []
    if single is not None:
        ig, idt, score, _ = single
        tp_scores.append(score[(ig == 0) & (idt == 0)])
    for b, ig, idt, score in views:
        C, Gp, Dp = b.edge.shape
        assigned = np.zeros((C, Dp), bool)
        rows = np.arange(C)
        for g in range(Gp):
            cand = b.edge[:, g, :] & (idt >= 0) & ~assigned & (ig[:, g] >= 0)[:, None]
            has = cand.any(axis=1)
            j = np.argmax(np.where(cand, score, -np.inf), axis=1)
            tp = has & (ig[:, g] == 0) & (idt[rows, j] == 0)
            tp_scores.append(score[rows[tp], j[tp]])
            assigned[rows[has], j[has]] = True
    thr = score_thresholds(np.concatenate(tp_scores) if tp_scores else np.zeros(0), n_gt)
    T = thr.size

    tp_t = np.zeros(T, np.int64)
    fp_t = np.zeros(T, np.int64)
    fn_t = np.full(T, fn_isolated, np.int64)
    sim_t = np.zeros(T)
    if T == 0:
        return LevelCounts(thr, tp_t, fp_t, fn_t, sim_t, n_gt)

    # Isolated counted detections above the threshold and outside DontCare regions are FP.
    lone = graph.det_isolated & (det_state == 0) & ~det_in_dontcare
    fp_t += _sum_at_or_above(det_score[lone], thr).astype(np.int64)

    # Pass 2 on single pairs: above the threshold the GT takes its detection (a TP if both are counted);
    # below it a counted GT is a FN. The detection is never a FP (it is taken whenever it is above).
    if single is not None:
        ig, idt, score, delta = single
        tp = (ig == 0) & (idt == 0)
        tp_t += _sum_at_or_above(score[tp], thr).astype(np.int64)
        sim_t += _sum_at_or_above(score[tp], thr, (1.0 + np.cos(delta[tp])) / 2.0)
        counted = ig == 0
        fn_t += int(counted.sum()) - _sum_at_or_above(score[counted & (idt >= 0)], thr).astype(np.int64)

    # Pass 2 on the other components, all thresholds at once: each GT takes the unassigned counted
    # candidate with the largest overlap, else the first ignored one.
    for chunk in _chunks(views, T):
        tp_c, fp_c, fn_c, sim_c = _pass2(*chunk, thr, gt_alpha, det_alpha, det_in_dontcare)
        tp_t += tp_c
        fp_t += fp_c
        fn_t += fn_c
        sim_t += sim_c
    assert T <= N_SAMPLE_PTS
    return LevelCounts(thr, tp_t, fp_t, fn_t, sim_t, n_gt)


def _chunks(views, T: int, budget: int = 1 << 22):
    """Split the buckets' components into chunks of at most ``budget`` [component, threshold, detection]
    cells, so memory stays bounded however crowded the frames are."""
    for b, ig, idt, score in views:
        C, Gp, Dp = b.edge.shape
        step = max(1, budget // (T * Dp))
        for s in range(0, C, step):
            sl = slice(s, s + step)
            yield _Bucket(b.gt[sl], b.det[sl], b.edge[sl], b.overlap[sl]), ig[sl], idt[sl], score[sl]


def _second_pass(b: _Bucket, ig, idt, below) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The protocol's second pass (R8) over padded components at T thresholds at once: each GT (in file order)
    takes the unassigned counted candidate with the largest overlap, else the first ignored one; detections
    ``below`` [C, T, Dp] the threshold take no part. Returns ``pick`` [C, T, Gp] (the detection slot each GT took,
    -1 none), ``took_counted`` [C, T, Gp] (it took a counted detection) and ``assigned`` [C, T, Dp]."""
    C, Gp, Dp = b.edge.shape
    T = below.shape[1]
    assigned = np.zeros((C, T, Dp), bool)
    pick = np.full((C, T, Gp), -1)
    took_counted = np.zeros((C, T, Gp), bool)
    counted_det = (idt == 0)[:, None, :]
    ignored_det = (idt == 1)[:, None, :]
    ci, ti = np.meshgrid(np.arange(C), np.arange(T), indexing="ij")
    for g in range(Gp):
        state = ig[:, g][:, None]  # [C, 1]
        free = b.edge[:, g, :][:, None, :] & ~assigned & ~below
        cand_v = free & counted_det
        cand_i = free & ignored_det
        has_v = cand_v.any(axis=2)
        has_i = cand_i.any(axis=2)
        jv = np.argmax(np.where(cand_v, b.overlap[:, g, :][:, None, :], -np.inf), axis=2)
        ji = np.argmax(cand_i, axis=2)
        j = np.where(has_v, jv, ji)
        has = (has_v | has_i) & (state >= 0)
        assigned[ci[has], ti[has], j[has]] = True
        pick[:, :, g] = np.where(has, j, -1)
        took_counted[:, :, g] = has_v & (state >= 0)
    return pick, took_counted, assigned


def _pass2(b: _Bucket, ig, idt, score, thr, gt_alpha, det_alpha, det_in_dontcare):
    """Second pass over padded components for all thresholds: (tp, fp, fn, similarity) per threshold."""
    T = thr.size
    tp_t = np.zeros(T, np.int64)
    fn_t = np.zeros(T, np.int64)
    sim_t = np.zeros(T)
    C, Gp, Dp = b.edge.shape
    below = score[:, None, :] < thr[None, :, None]  # [C, T, Dp]
    pick, took_counted, assigned = _second_pass(b, ig, idt, below)
    galpha = _take(gt_alpha, b.gt, 0.0)
    dalpha = _take(det_alpha, b.det, 0.0)
    ci = np.arange(C)[:, None]
    for g in range(Gp):
        state = ig[:, g][:, None]  # [C, 1]
        tp = took_counted[:, :, g] & (state == 0)
        fn = (pick[:, :, g] < 0) & (state == 0)
        tp_t += tp.sum(axis=0)
        fn_t += fn.sum(axis=0)
        if tp.any():
            delta = galpha[:, g][:, None] - dalpha[ci, np.maximum(pick[:, :, g], 0)]
            sim_t += np.where(tp, (1.0 + np.cos(delta)) / 2.0, 0.0).sum(axis=0)
    in_dc = _take(det_in_dontcare, b.det, False)
    fp = (idt == 0)[:, None, :] & ~assigned & ~below & ~in_dc[:, None, :]
    fp_t = fp.sum(axis=(0, 2))
    return tp_t, fp_t, fn_t, sim_t


def assign_at(graph: MatchGraph, gt_state: np.ndarray, det_state: np.ndarray, det_score: np.ndarray,
              threshold: float) -> np.ndarray:
    """The second pass (R8) at one score threshold, record by record: [n_gt] the candidate position of the
    detection each GT takes (-1: none), from :func:`match_level`'s states and scores. It is the pass the counts come
    from (:func:`_second_pass`), so what it assigns is what they count."""
    out = np.full(graph.n_gt, -1)
    thr = np.array([float(threshold)])
    views = [(b, _take(gt_state, b.gt, -1), _take(det_state, b.det, -1), _take(det_score, b.det, -np.inf))
             for b in graph.buckets]
    for b, ig, idt, score in _chunks(views, 1):
        pick, _, _ = _second_pass(b, ig, idt, score[:, None, :] < thr[None, :, None])
        pick = pick[:, 0, :]
        take = (b.gt >= 0) & (pick >= 0)
        rows = np.nonzero(take)[0]
        out[b.gt[take]] = b.det[rows, pick[take]]
    return out
