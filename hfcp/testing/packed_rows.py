"""Packed rows for tests and benchmarks: the position ids of documents packed into one row, and document lengths
drawn as real packed data has them (a long tail; one long document among short ones)."""
from __future__ import annotations

import math
import random

import torch


def documents(lengths) -> torch.Tensor:
    """(L,) position ids of documents of these lengths packed into one row."""
    return torch.cat([torch.arange(n) for n in lengths])


def long_tail(length: int, seed: int, median: int = 1100, sigma: float = 1.0) -> list[int]:
    """Document lengths (lognormal, a long tail) filling a row of `length` tokens (the last cut to fit)."""
    rng, out = random.Random(seed), []
    while sum(out) < length:
        out.append(min(max(1, int(rng.lognormvariate(math.log(median), sigma))), length - sum(out)))
    return out


def one_long(length: int, seed: int) -> list[int]:
    """A document of half the row, then short ones."""
    return [length // 2] + long_tail(length - length // 2, seed, sigma=0.6)
