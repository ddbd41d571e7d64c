"""A KV cache spread over the CP group, for generation on a patched causal LM (docs/how-to/generation.md).

The prompt is prefilled over the group like a training forward: each rank computes the keys and values of its own
tokens (its two zigzag chunks), and keeps them, with their global columns and which are padding. The full cache
never exists on one rank. Each decode step runs the new tokens on every rank (they are few: every rank computes
them alike), and their attention merges every rank's partial result over its own keys
(hfcp/attention/decode.py). The new tokens' keys and values are kept by one rank, in turn, so the ranks' caches
stay within one step of each other.

transformers' generation loop passes the cache back in each step; the cache knows which phase a forward is in
from the patched model's hook (`begin_prefill`, `begin_decode`, `end_forward`).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..attention.decode import DecodeStep


class ShardedKVCache(Cache):
    """Each rank's part of the KV cache of the whole sequence: the keys and values of the tokens it holds.

    `get_seq_length()` is the global number of columns (prompt and generated tokens, the same on every rank).
    Beam search, assisted decoding and other operations that rewrite the cache are refused (ValueError, on every
    rank alike: they run between forwards, outside any collective).
    """

    is_compileable = False

    def __init__(self, rank: int, cp_size: int, windows: dict[int, int] | None = None):
        super().__init__(layers=[])
        self.rank, self.cp_size = rank, cp_size
        self.windows = dict(windows or {})  # layer -> the window transformers' own cache keeps for it (see kept_window)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, L_r, D) this rank's cached keys
        self.values: dict[int, torch.Tensor] = {}
        self.columns: dict[int, torch.Tensor] = {}  # layer -> (L_r,) the global column of each of them
        self.valid: dict[int, torch.Tensor] = {}  # layer -> (B or 1, L_r) bool, False for padding
        self._new_columns: torch.Tensor | None = None  # the current forward's tokens this rank keeps, (n,)
        self._new_valid: torch.Tensor | None = None  # and their padding, (B or 1, n)
        self.seen = 0  # global columns before the current forward
        self.decodes = 0  # decode forwards so far (the next one's tokens go to rank decodes % cp_size)
        self._new = 0  # columns the current forward adds
        self._keeps_new = False  # whether this rank keeps the current forward's keys and values
        self._phase: str | None = None
        self.plain_masks = True

    def __repr__(self):
        here = max((len(c) for c in self.columns.values()), default=0)
        return f"ShardedKVCache(rank {self.rank} of {self.cp_size}, {self.seen} columns, up to {here} here)"

    def __len__(self):
        return len(self.keys)

    def begin_prefill(self, step) -> None:
        """The prompt forward: keep this rank's tokens of the step (hfcp's end padding among them, as padding)."""
        if self.seen:
            raise ValueError(f"hfcp: a prompt forward with a cache that already holds {self.seen} columns: hfcp's "
                             "cache takes one prompt, then decode steps")
        if step.doc_ids is not None:  # (every rank holds the same batch: every rank raises)
            raise ValueError("hfcp: a prompt of packed documents (position_ids that restart inside a row) with a KV "
                             "cache: transformers attends across them when it has a cache, hfcp's prefill would keep "
                             "them apart and its decode steps would not; "
                             "pass one document per row (or use_cache=False)")
        columns, valid = step.local_index.clone(), step.key_valid
        self._new_columns = columns
        self._new_valid = (valid.index_select(1, columns.to(valid.device)) if valid is not None
                           else torch.ones(1, len(columns), dtype=torch.bool, device=columns.device))
        self._new, self._keeps_new, self._phase = step.layout.seq_len, True, "prefill"
        self.plain_masks = step.outer_masks is None and step.blocks is None  # (decode steps need plain masks)

    def begin_decode(self, new_valid: torch.Tensor) -> DecodeStep:
        """A decode forward of n new tokens (new_valid: (B, n) bool): its step, and which rank keeps them."""
        n = new_valid.shape[1]
        columns = torch.arange(self.seen, self.seen + n, device=new_valid.device)
        self._new, self._phase = n, "decode"
        self._keeps_new = self.decodes % self.cp_size == self.rank
        self._new_columns, self._new_valid = columns, new_valid
        return DecodeStep(self, columns)

    def end_forward(self) -> None:
        """After the forward: its columns count."""
        if self._phase == "decode":
            self.decodes += 1
        self.seen += self._new
        self._new, self._phase = 0, None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Keep this rank's keys and values of the current forward; returns every key and value this rank holds."""
        if self._phase is None:
            raise RuntimeError("hfcp: a ShardedKVCache used outside a forward of the patched model")
        if self._keeps_new:
            if layer_idx in self.keys and self._phase == "decode":
                valid = self.valid[layer_idx]
                batch = max(valid.shape[0], self._new_valid.shape[0])
                self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key_states], -2)
                self.values[layer_idx] = torch.cat([self.values[layer_idx], value_states], -2)
                device = key_states.device
                self.columns[layer_idx] = torch.cat([self.columns[layer_idx], self._new_columns.to(device)])
                self.valid[layer_idx] = torch.cat([valid.expand(batch, -1),
                                                   self._new_valid.to(device).expand(batch, -1)], 1)
            else:  # (columns and padding on the keys' device, where the decode steps read them)
                self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
                self.columns[layer_idx] = self._new_columns.to(key_states.device)
                self.valid[layer_idx] = self._new_valid.to(key_states.device)
        return self.keys[layer_idx], self.values[layer_idx]

    def kept_window(self, layer_idx, sliding_window: int | None) -> int | None:
        """The window of keys to keep for a layer after its attention: the layer's sliding window, or the window
        transformers' cache keeps for the layer where that is smaller or the only one (its DynamicSlidingWindowLayer
        keeps the last window - 1 keys whether or not the model's mask applies the window, as Moshi's does not);
        None: keep every key."""
        windows = [w for w in (sliding_window, self.windows.get(layer_idx)) if w]
        return min(windows) if windows else None

    def keep_window(self, layer_idx: int, window: int) -> None:
        """After a sliding-window layer's attention: drop this rank's keys that no later query sees (column <= the
        newest column + 1 - window), as transformers' sliding-window cache keeps the window only."""
        if layer_idx not in self.keys:
            return
        columns = self.columns[layer_idx]
        newest = self.seen + self._new - 1
        keep = (columns > newest + 1 - window).nonzero().flatten()
        if len(keep) == len(columns):
            return
        self.keys[layer_idx] = self.keys[layer_idx].index_select(-2, keep.to(self.keys[layer_idx].device))
        self.values[layer_idx] = self.values[layer_idx].index_select(-2, keep.to(self.values[layer_idx].device))
        self.columns[layer_idx] = columns.index_select(0, keep)
        self.valid[layer_idx] = self.valid[layer_idx].index_select(1, keep.to(self.valid[layer_idx].device))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        raise ValueError("hfcp: the model builds a mask of its own over hfcp's ShardedKVCache (such as a "
                         "vision-language model's bidirectional image blocks); hfcp generates only where its "
                         "attention builds the masks itself: call hfcp.unpatch(model) to generate")

    # transformers' generate reads these per layer (all([]) would be True: "every layer linear", and it would then
    # feed the whole sequence again when a generation continues from this cache)
    @property
    def is_linear(self) -> list[bool]:
        return [False] * max(1, len(self.keys))

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * max(1, len(self.keys))

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * max(1, len(self.keys))

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return max((v.shape[0] for v in self.valid.values()), default=-1)

    @property
    def is_initialized(self) -> bool:
        return bool(self.keys)

    def _refuse(self, what: str):
        raise ValueError(f"hfcp: {what} rewrites the KV cache, which hfcp spreads over the CP group; it is not "
                         "supported: use greedy decoding or sampling (num_beams=1, no assistant model)")

    def reorder_cache(self, beam_idx):
        self._refuse("beam search")

    def crop(self, tokens_to_remove: int):
        self._refuse("assisted decoding (crop)")

    def batch_repeat_interleave(self, repeats: int):
        self._refuse("expanding the batch of a filled cache")

    def batch_select_indices(self, indices):
        self._refuse("selecting rows of a filled cache")

    def reset(self):
        self.__init__(self.rank, self.cp_size, self.windows)

    def bytes_held(self) -> int:
        """Bytes of keys and values this rank holds (the per-rank KV-cache memory)."""
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())
