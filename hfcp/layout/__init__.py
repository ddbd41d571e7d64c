"""Where each token lives: padding to a multiple, zigzag (head-tail) or contiguous split, global indices.

A `Layout` is pure arithmetic on lengths; `StepBatch` adds the per-step token metadata (document ids from
position_ids resets, key padding) that attention masks read. Every rank holds the full batch, so each
rank can compute the metadata of every global token without communication.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) document index of each token: a position that is not previous + 1 starts a new document
    (exactly transformers' `find_packed_sequence_indices`)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@dataclass
class StepBatch:
    """Per-step metadata over the padded global sequence, shared by every attention call of the step.

    doc_ids:   (B, padded_len) long, non-decreasing per row, or None when no row is packed.
    key_valid: (B, padded_len) bool, or None when every key is valid.
    positions: (B, padded_len) long position ids when a row is packed (transformers then evaluates the masks of
               packed rows on positions: chunked attention restarts in each document), else None.
    """

    layout: Layout
    rank: int
    doc_ids: torch.Tensor | None
    key_valid: torch.Tensor | None
    positions: torch.Tensor | None = None
    max_position: torch.Tensor | None = None  # 0-dim: the whole batch's largest position id (dynamic RoPE reads it)
    outer_masks: dict | None = None  # forms of masks an outer model built ({layer type: OuterMask}), checked per layer
    blocks: torch.Tensor | None = None  # (B, padded_len) long bidirectional block ids of those masks (-1: none)
    plans: dict = field(default_factory=dict)  # attention block plans, cached for all layers of the step
    # (padded_len,) attention work of each position (hfcp.work.step_work), once counted
    work: torch.Tensor | None = None

    @property
    def local_index(self) -> torch.Tensor:
        return self.layout.local_index(self.rank)

    def local(self, x: torch.Tensor, dim: int = 1, fill=0) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (Layout.local)."""
        return self.layout.local(x, self.rank, dim, fill)


def build_step_batch(
    layout: Layout,
    rank: int,
    batch_size: int,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    device,
) -> StepBatch:
    """Document ids and key padding of the padded global sequence (see `StepBatch`).

    Packing is detected only when there is no attention_mask, as transformers does.
    """
    L, P = layout.seq_len, layout.padded_len
    doc_ids = positions = None
    if attention_mask is None and position_ids is not None:
        docs = document_ids(position_ids.expand(batch_size, -1))
        if bool((docs[:, -1] > 0).any()):
            # padding forms one more document after the last, so ids stay non-decreasing
            doc_ids = pad_to(docs, P, 1, 0)
            doc_ids[:, L:] = docs[:, -1:] + 1
            positions = pad_to(position_ids.expand(batch_size, -1), P, 1, 0)
    key_valid = None
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool).expand(batch_size, -1)
        key_valid = pad_to(valid, P, 1, False)
    elif P > L:
        key_valid = torch.zeros(batch_size, P, dtype=torch.bool, device=device)
        key_valid[:, :L] = True
    if key_valid is not None and bool(key_valid.all()):
        key_valid = None
    return StepBatch(layout, rank, doc_ids, key_valid, positions)
