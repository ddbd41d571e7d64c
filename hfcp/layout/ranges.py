"""Where each token lives: padding to a multiple, zigzag (head-tail) or contiguous split, global indices. A `Layout`
is pure arithmetic on lengths."""
from __future__ import annotations

from dataclasses import dataclass

import torch

Range = tuple[int, int]  # (global start, length)


@dataclass(frozen=True)
class Layout:
    """How a sequence of `seq_len` tokens is padded and split over `cp_size` ranks.

    zigzag: 2*cp chunks, rank r holds chunks r and 2*cp-1-r (balances causal attention work).
    contiguous: cp chunks, rank r holds chunk r.
    plan: when given, rank r holds plan[r] instead: ascending (global start, length) ranges, padded_len/cp tokens
        per rank, every position of the padded sequence exactly once (a balanced layout, hfcp.balance); the padding
        is that of `zigzag`.
    """

    seq_len: int
    cp_size: int
    zigzag: bool
    plan: tuple[tuple[Range, ...], ...] | None = None

    def __post_init__(self):
        if self.plan is not None:
            check_plan(self.plan, self.cp_size, self.padded_len)

    @property
    def balanced(self) -> bool:
        return self.plan is not None

    @property
    def num_chunks(self) -> int:
        return 2 * self.cp_size if self.zigzag else self.cp_size

    @property
    def padded_len(self) -> int:
        n = self.num_chunks
        return -(-self.seq_len // n) * n

    @property
    def chunk_len(self) -> int:
        """Tokens per chunk of the zigzag or contiguous split (a balanced layout's ranges have no common length)."""
        if self.plan is not None:
            raise ValueError("a balanced layout (hfcp.balance) has ranges of different lengths, no chunk length; "
                             "what reads it (recurrent mixers) runs on the row layout: balance='row'")
        return self.padded_len // self.num_chunks

    @property
    def local_len(self) -> int:
        return self.padded_len // self.cp_size

    def ranges(self, rank: int) -> tuple[Range, ...]:
        """Global (start, length) ranges held by `rank`, in local order."""
        if self.plan is not None:
            return self.plan[rank]
        c = self.padded_len // self.num_chunks
        if not self.zigzag:
            return ((rank * c, c),)
        return ((rank * c, c), ((2 * self.cp_size - 1 - rank) * c, c))

    def all_ranges(self) -> list[Range]:
        """Every rank's ranges, in rank order: the order of a tensor gathered over the CP group."""
        return [r for owner in range(self.cp_size) for r in self.ranges(owner)]

    def local_index(self, rank: int, device=None) -> torch.Tensor:
        """(local_len,) global index of each local token of `rank`."""
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.ranges(rank)])

    def local(self, x: torch.Tensor, rank: int, dim: int = 1, fill=0) -> torch.Tensor:
        """`rank`'s tokens of a whole-sequence tensor: `x` padded with `fill` to padded_len along `dim` (when it is
        shorter), then that rank's columns in layout order. (B, L, ...) -> (B, padded_len/cp, ...) for dim 1."""
        return pad_to(x, self.padded_len, dim, fill).index_select(dim, self.local_index(rank, x.device))

    def gathered_order(self, device=None) -> torch.Tensor:
        """(padded_len,) global index of each token of the rank-order concatenation of all local slices."""
        return torch.cat([self.local_index(r, device) for r in range(self.cp_size)])

    def gathered_inverse(self, device=None, keep_padding: bool = False) -> torch.Tensor:
        """(seq_len,) position in the rank-order concatenation of each original token (padding dropped), or
        (padded_len,) of every token with keep_padding."""
        order = self.gathered_order(device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return inverse if keep_padding else inverse[: self.seq_len]


def check_plan(plan, cp_size: int, padded_len: int) -> None:
    """Raises ValueError unless `plan` gives each of cp_size ranks padded_len/cp_size tokens in ascending ranges and
    covers every position of [0, padded_len) exactly once."""
    if len(plan) != cp_size:
        raise ValueError(f"a layout plan has {len(plan)} ranks' ranges for cp_size={cp_size}")
    covered = []
    for rank, ranges in enumerate(plan):
        tokens = sum(n for _, n in ranges)
        if tokens != padded_len // cp_size or any(n <= 0 for _, n in ranges):
            raise ValueError(f"a layout plan gives rank {rank} ranges {ranges} ({tokens} tokens); each rank holds "
                             f"{padded_len // cp_size} tokens in non-empty ranges")
        if [s for s, _ in ranges] != sorted(s for s, _ in ranges):
            raise ValueError(f"a layout plan gives rank {rank} ranges {ranges} out of ascending order")
        covered += ranges
    covered.sort()
    end = 0
    for start, n in covered:
        if start != end:
            raise ValueError(f"a layout plan {'misses' if start > end else 'repeats'} position {min(start, end)} of "
                             f"{padded_len}")
        end = start + n
    if end != padded_len:
        raise ValueError(f"a layout plan covers {end} positions of {padded_len}")


def pad_to(x: torch.Tensor, length: int, dim: int, value) -> torch.Tensor:
    """Pad `x` along `dim` at the end to `length` with `value`."""
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)
