"""Predicted peak memory of a training step and of inference per batch size, from shapes (the model is not run).

    python scripts/estimate_memory.py [Hydra overrides of the train config] [batches=1,2,4,8,16]
                                      [sparsity=dense|0.7|0.9,0.8,...] [available_mb=auto] [margin=0.1]

``batches``: integers >= 1. ``sparsity``: ``dense`` (mask=none), one number in [0, 1] (the share of inactive
tiles at EVERY stage: stem, each backbone stage, each neck level and the head all run with that share of their
tiles inactive) or one number per stage (stem, backbone stages, neck levels, head). This is not the
``sparsity`` of scripts/bench_memory.py (benchmarks/memory_cpu.md), which is the share of inactive 16-px tiles
at stride 1 only, the deeper stages' shares following from that mask's real blocks (a coarser tile covers
more, so deeper stages are less sparse). ``margin`` in [0, 1). Each row: parameters, gradients, optimizer
state, activations (saved for backward / live maps) and workspace, in MB (detector/memory.py says what is
counted). A requested batch whose training step does not fit ``(1 - margin)`` of the available memory
(``auto``: the free CUDA memory, else the system's MemAvailable; or a number of MB > 0) is answered in one line
with the largest batch that fits. A bad value is answered in one line naming the key.
Measured against the allocator: benchmarks/memory_cpu.md (scripts/bench_memory.py).
"""

from __future__ import annotations

import sys

import torch
from hydra import compose, initialize_config_dir

OWN = {"batches": "1,2,4,8,16", "sparsity": "0.7", "available_mb": "auto", "margin": "0.1"}


def parse_own(own: dict[str, str]) -> tuple[list[int], list[float] | float | None, float | None, float]:
    """``(batches, active shares or None for dense, available MB or None for auto, margin)`` from this
    command's own arguments; a bad value raises :class:`ConfigError` naming the key."""
    from detector.errors import ConfigError

    def number(key: str, text: str, kind=float):
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{key}={own[key]!r}: {text!r} is not {'an integer' if kind is int else 'a number'}"
                              ) from None

    batches = [number("batches", b.strip(), int) for b in own["batches"].split(",")]
    if any(b < 1 for b in batches):
        raise ConfigError(f"batches={own['batches']!r}: each batch size must be an integer >= 1")
    shares = None
    if own["sparsity"] != "dense":
        sparsity = [number("sparsity", x.strip()) for x in own["sparsity"].split(",")]
        if not all(0.0 <= x <= 1.0 for x in sparsity):
            raise ConfigError(f"sparsity={own['sparsity']!r}: each value (the share of inactive tiles) must be in "
                              "[0, 1], or sparsity=dense")
        shares = [1.0 - x for x in sparsity]
        shares = shares[0] if len(shares) == 1 else shares
    margin = number("margin", own["margin"])
    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"margin={own['margin']!r}: must be in [0, 1) (the share of the memory kept free)")
    available = None
    if own["available_mb"] != "auto":
        available = number("available_mb", own["available_mb"])
        if not available > 0:
            raise ConfigError(f"available_mb={own['available_mb']!r}: must be a number of MB > 0, or auto")
    return batches, shares, available, margin


def main(argv: list[str] | None = None) -> int:
    from detector.build import build_grid, build_model
    from detector.errors import USER_ERRORS, one_line
    from detector.memory import MB, estimate, largest_fitting
    from detector.resources import config_dir

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    own = dict(OWN)
    overrides = []
    for a in argv:
        key = a.split("=", 1)[0]
        (own.__setitem__(key, a.split("=", 1)[1]) if key in OWN and "=" in a else overrides.append(a))
    try:
        batches, shares, available_mb, margin = parse_own(own)
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            cfg = compose("train", overrides=overrides + ["paths.output_dir=/tmp/estimate_memory"])
        sp = own["sparsity"]
        model = build_model(cfg.model, cfg.mask, build_grid(cfg.bev))
        if available_mb is None:
            from detector.batch_size import _mem_available

            avail = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else _mem_available()
        else:
            avail = available_mb * MB
        budget = (1.0 - margin) * avail
        print(f"BEV grid {model.grid.H}x{model.grid.W}x{model.grid.C}, "
              f"sparsity {sp}; budget {budget / MB:.0f} MB ({1 - margin:.0%} of {avail / MB:.0f} MB)")
        print(f"{'batch':>5} {'mode':>5} {'peak MB':>9} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>8} "
              f"{'work':>8}")
        for b in batches:
            for train in (True, False):
                e = estimate(model, b, shares, train)
                print(f"{b:>5} {e.mode:>5} {e.peak_mb:>9.1f} {e.params / MB:>7.1f} {e.grads / MB:>7.1f} "
                      f"{e.optimizer / MB:>7.1f} {e.activations / MB:>8.1f} {e.workspace / MB:>8.1f}")
        too_big = [b for b in batches if estimate(model, b, shares, True).peak > budget]
        if too_big:
            best = largest_fitting(model, shares, budget, max(batches))
            need = estimate(model, too_big[0], shares, True).peak_mb
            print(f"batch {too_big[0]} does not fit: a training step needs ~{need:.0f} MB of {budget / MB:.0f} MB; "
                  + (f"the largest batch that fits is {best}" if best else "not even batch 1 fits"))
            return 1
    except USER_ERRORS as e:
        print(one_line(e), file=sys.stderr)
        return 1
    return 0
