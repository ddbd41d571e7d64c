"""How a patched model's results are compared with the unpatched model's (hfcp verify, the tests, the sweeps)."""
from __future__ import annotations


def grad_error(got: dict, want: dict) -> float:
    """Worst relative error over named gradients, each relative to its own max, with a floor at 1e-3 of the largest
    (a gradient that is 0 in exact arithmetic holds float noise in both computations)."""
    floor = max(1e-3 * max(float(g.abs().max()) for g in want.values()), 1e-12)
    return max(float((got[n] - want[n]).abs().max()) / max(float(want[n].abs().max()), floor) for n in want)
