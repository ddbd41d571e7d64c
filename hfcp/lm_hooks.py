"""accelerate ModelHook for causal LMs and base models: shard the full batch along the sequence, reduce the loss."""
from __future__ import annotations

import inspect

import torch
from accelerate.hooks import ModelHook

from .checks import BATCH_NAMES, check_same_batch, check_shapes, check_token_range
from .distributed.collectives import all_reduce_no_grad, all_reduce_sum
from .forward_data import ForwardData
from .generation import generation_cache, prepare_decode, return_cache
from .layout import Layout, build_step_batch, document_ids, pad_to
from .outer_mask import resolve_attention_mask, step_blocks
from .step_token import step_token
from .linear_ce import add_token_stats
from .router_loss import global_aux
from .side_inputs import (SPLIT_BY_HFCP, check_side_inputs, outer_model_call, refuse_outer_call,
                          refuse_unsplit_sequence_inputs, shard_side_inputs, side_input_names)
from .state import check_loss_chunk
from .loss import IGNORE_INDEX, ce_sum, chunked_ce_sum, global_mean, shift_labels


def as_kwargs(module, args, kwargs) -> dict:
    """Positional arguments of the wrapped forward -> keyword arguments."""
    if not args:
        return dict(kwargs)
    params = [p for p in inspect.signature(module._old_forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name: a for p, a in zip(params, args)}
    if len(args) > len(params):
        raise TypeError(f"{type(module).__name__}.forward got {len(args)} positional arguments")
    return {**named, **kwargs}


def check_call(kw: dict) -> dict | None:
    """Refuse call styles hfcp cannot run (decided by the call, not the data, so before any collective); a mask
    built outside the patched forward becomes the key padding it stands for, or is refused. Returns the forms of
    such masks (outer_mask.resolve_attention_mask)."""
    if kw.get("fused_lm_head"):  # TRL's fused head: its forward calls the backbone around this hook
        raise ValueError("fused_lm_head=True runs the model's backbone around hfcp (each rank would attend within its "
                         "own shard only); train with hfcp.integrations.HfcpSFTTrainer, whose loss and metrics go "
                         "through hfcp's chunked loss")
    outer_masks = resolve_attention_mask(kw)
    keep = kw.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor) or isinstance(keep, bool) or not isinstance(keep, (int, type(None))) or \
            (keep or 0) < 0:
        raise ValueError(f"logits_to_keep={keep!r} is not supported by hfcp (an int: 0 for all logits, k for the last "
                         "k positions); take other positions from hfcp.gather_sequence(out.logits, model)")
    if keep and kw.get("labels") is not None:
        raise ValueError(f"logits_to_keep={keep} with labels: the loss needs every position's logits; pass one of them")
    return outer_masks


def keep_last_positions(hidden: torch.Tensor, keep: int, step, group) -> torch.Tensor:
    """The hidden states of the last `keep` positions of the global sequence, (B, keep, D) on every rank, from this
    rank's (B, L_local, D): each rank places the rows it holds, the others are zero, summed over the group (its
    backward sums the gradients, as hfcp.gather_sequence's)."""
    layout = step.layout
    keep = min(keep, layout.seq_len)
    first = layout.seq_len - keep
    index = layout.local_index(step.rank, hidden.device)
    mine = ((index >= first) & (index < layout.seq_len)).nonzero().flatten()
    rows = hidden.new_zeros(hidden.shape[0], keep, hidden.shape[-1])
    rows = rows.index_copy(1, index[mine] - first, hidden.index_select(1, mine))
    return all_reduce_sum(rows, group)


def _vocab(module, which: str) -> int:
    layer = module.get_input_embeddings() if which == "input" else module.get_output_embeddings()
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return int(module.config.get_text_config().vocab_size)
    shape = getattr(weight, "ds_shape", weight.shape)  # DeepSpeed ZeRO-3: a partitioned weight is empty locally
    return int(shape[0])


def check_lm_batch(module, kw: dict, causal_lm: bool):
    """Validate a causal LM / base model batch (every rank holds all of it, so every rank raises alike).

    Returns (x, labels, targets): x is input_ids or inputs_embeds; labels as given (None: no loss); targets (B, L)
    the target of each token (labels shifted over the whole sequence, or shift_labels), IGNORE_INDEX where none.
    Pops the loss keywords shift_labels and ignore_index from kw.
    """
    ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
    if ids is None and embeds is None:
        raise ValueError("hfcp needs input_ids or inputs_embeds to shard the sequence")
    if ids is not None and ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}; hfcp needs (batch, seq): add a batch dimension")
    if embeds is not None and embeds.dim() != 3:
        raise ValueError(f"inputs_embeds has shape {tuple(embeds.shape)}; hfcp needs (batch, seq, hidden)")
    x = ids if ids is not None else embeds
    if ids is not None:
        check_token_range("input_ids", ids, _vocab(module, "input"))
    check_shapes(kw, *x.shape[:2])
    take_packed_lengths(kw, *x.shape[:2])
    if not causal_lm:
        return x, None, None
    labels, shifted = kw.pop("labels", None), kw.pop("shift_labels", None)
    ignore = kw.pop("ignore_index", IGNORE_INDEX)
    if labels is None:
        return x, None, None
    if not isinstance(ignore, int) or isinstance(ignore, bool):
        raise ValueError(f"ignore_index={ignore!r} must be an int")
    vocab = _vocab(module, "output")
    if shifted is None:  # as transformers: labels[:, 0] is never a target
        check_token_range("labels[:, 1:]", labels[:, 1:], vocab, ignore)
        shifted = shift_labels(labels, ignore)
    else:  # transformers' loss uses shift_labels as they are and ignores labels
        check_token_range("shift_labels", shifted, vocab, ignore)
    targets = shifted.masked_fill(shifted == ignore, IGNORE_INDEX) if ignore != IGNORE_INDEX else shifted
    return x, labels, targets


def take_packed_lengths(kw: dict, batch: int, length: int) -> None:
    """Padding-free collators (DataCollatorWithFlattening, TRL's) pass `cu_seq_lens_q/k` and `max_length_q/k` for
    flash attention, or `seq_idx`, beside position_ids. hfcp finds documents from position_ids (as transformers' SDPA path does),
    so it checks that both describe the same documents, fills position_ids when only the lengths are given, and
    pops them (they describe the whole sequence, not a rank's shard)."""
    cu_q, cu_k = kw.pop("cu_seq_lens_q", None), kw.pop("cu_seq_lens_k", None)
    kw.pop("max_length_q", None), kw.pop("max_length_k", None)
    seq_idx = kw.pop("seq_idx", None)  # (B, L) document index of each token (TRL's padding-free collator)
    if seq_idx is not None:
        starts = torch.diff(seq_idx.cpu(), dim=-1) != 0
        pos = kw.get("position_ids")
        if pos is None or not torch.equal(starts, torch.diff(document_ids(pos.cpu().expand_as(seq_idx)), dim=-1) != 0):
            raise ValueError("seq_idx and the position_ids resets describe different documents (or position_ids are "
                             "missing); hfcp finds packed documents from position_ids")
    if cu_q is None and cu_k is None:
        return
    cu = cu_q if cu_q is not None else cu_k
    if cu_k is not None and not torch.equal(cu.cpu(), cu_k.cpu()):
        raise ValueError(f"cu_seq_lens_q {cu.tolist()} and cu_seq_lens_k {cu_k.tolist()} differ; hfcp supports "
                         "self-attention over packed documents only")
    lengths = torch.diff(cu.cpu().long())
    if batch != 1 or cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != length or bool((lengths <= 0).any()):
        raise ValueError(f"cu_seq_lens {cu.tolist()} do not describe documents packed into one row of {length} "
                         f"tokens (batch {batch})")
    if kw.get("attention_mask") is not None:
        raise ValueError("cu_seq_lens_q/k with an attention_mask: pass packed documents without a padding mask")
    from_lengths = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    pos = kw.get("position_ids")
    if pos is None:
        kw["position_ids"] = from_lengths.to(cu.device)
    elif not torch.equal(document_ids(pos.cpu()), document_ids(from_lengths)):
        raise ValueError(f"cu_seq_lens {cu.tolist()} and the position_ids resets describe different documents")


DEFAULT_LOSS_CHUNK = 1024


def loss_chunk_for(setting, training: bool) -> int | None:
    """The loss chunk of one forward with labels: "auto" chunks (1024 tokens) in training forwards (module in
    train mode, grad enabled) and returns logits otherwise; an int always chunks; None never does."""
    if setting == "auto":
        return DEFAULT_LOSS_CHUNK if training else None
    return setting


def shard_inputs(st, kw: dict, layout: Layout, outer_masks) -> None:
    """The step's metadata from the whole batch in kw (st.step), then kw's per-token inputs replaced by this rank's
    slice: input_ids / inputs_embeds, position_ids of any leading shape ((B, L), (3, B, L) mRoPE, (4, B, L) with a
    text row) along their last dim, token_type_ids; the mask becomes the step token."""
    ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
    x = ids if ids is not None else embeds
    B, L = x.shape[:2]
    mask = kw.get("attention_mask")
    pos = kw.get("position_ids")
    if pos is None:
        pos = default_positions(st.patcher, mask, B, L, x.device)
    pos = pos.expand(*pos.shape[:-2], B, L) if pos.dim() >= 2 else pos.expand(B, L)
    sb = build_step_batch(layout, st.mesh.cp_rank, B, text_positions(pos), mask, x.device)
    sb.outer_masks, sb.max_position = outer_masks, pos.amax()
    sb.blocks = step_blocks(outer_masks, B, L, layout.padded_len)
    st.step = sb
    idx = sb.local_index.to(x.device)
    P = layout.padded_len
    if ids is not None:
        kw["input_ids"] = pad_to(ids, P, 1, 0).index_select(1, idx)
    if embeds is not None:
        kw["inputs_embeds"] = pad_to(embeds, P, 1, 0.0).index_select(1, idx)
    kw["position_ids"] = pad_to(pos, P, pos.dim() - 1, 0).index_select(pos.dim() - 1, idx)
    if kw.get("token_type_ids") is not None:  # per-token segment ids (BERT, GPT-2, CTRL): split like the tokens
        kw["token_type_ids"] = pad_to(kw["token_type_ids"].expand(B, -1), P, 1, 0).index_select(1, idx)
    kw["attention_mask"] = step_token(sb, x.device)


def text_positions(pos: torch.Tensor) -> torch.Tensor | None:
    """(B, L) positions whose resets mark packed documents: the positions themselves, the text row of a (4, B, L)
    mRoPE tensor (Qwen-VL), or None for (3, B, L) mRoPE rows (an image's rows are not +1 steps: never read as
    document starts)."""
    if pos.dim() == 2:
        return pos
    return pos[0] if pos.dim() == 3 and pos.shape[0] == 4 else None


def default_positions(patcher, mask, batch: int, length: int, device) -> torch.Tensor:
    """(B, L) position ids of a batch given without them, over the whole sequence, as the family computes them:
    0, 1, 2, ..., or from the attention mask for a family that derives them from it (Patcher.positions_from_mask:
    OPT's cumsum(mask) * mask - 1, so left padding and mask holes shift the positions)."""
    if patcher.positions_from_mask and mask is not None:
        m = mask.to(device=device, dtype=torch.long).expand(batch, -1)
        return m.cumsum(1) * m - 1
    return torch.arange(length, device=device)[None].expand(batch, -1)


def check_length_limit(patcher, config, layout: Layout) -> None:
    """Raises ValueError when the family has a length limit (Patcher.max_seq_len) and this batch exceeds it."""
    limit = patcher.max_seq_len(config) if patcher.max_seq_len is not None else None
    if limit is not None and layout.padded_len > limit:
        raise ValueError(f"model_type={patcher.model_type!r}: {layout.seq_len} tokens ({layout.padded_len} padded for "
                         f"cp={layout.cp_size}) exceed the {limit} hfcp runs exactly for it: {patcher.max_seq_len_reason}")


def router_logits_wanted(state, module, kw: dict) -> bool:
    """Whether this forward outputs router logits (the argument, else the config), so that the MoE router aux loss
    must be computed; raises ValueError (on every rank alike) when hfcp cannot compute it exactly."""
    wanted = kw.get("output_router_logits")
    if wanted is None:  # (a VLM's checkpoint keeps it in its text config)
        wanted = getattr(module.config, "output_router_logits", None)
        wanted = getattr(module.config.get_text_config(), "output_router_logits", False) if wanted is None else wanted
    if not wanted or state.router_aux is None:
        return False  # a family without the aux loss returns its (local) router logits as they are
    if isinstance(state.router_aux, str):
        raise ValueError(f"output_router_logits=True: {state.router_aux}, so its auxiliary loss would be taken over a "
                         "rank's tokens only; leave output_router_logits off")
    tuples = kw.get("return_dict") is False or (kw.get("return_dict") is None
                                                and getattr(module.config, "return_dict", True) is False)
    if tuples:
        raise ValueError("return_dict=False (argument or config) with output_router_logits=True is not supported by "
                         "hfcp; return a ModelOutput")
    return True


class ShardSequenceHook(ModelHook):
    """pre_forward: full batch -> per-step layout + local input_ids/inputs_embeds/position_ids, shifted
    local labels kept aside; post_forward: loss = global token-weighted mean, equal on every rank."""

    def __init__(self, state, shards: bool = True):
        self.state = state
        self.shards = shards  # False: the outer model of a VLM (loss here, sharding at its language model's input)
        self._restore_head = None
        self._chunk = None  # tokens per loss chunk in this forward, or None: loss from the logits
        self._keep = 0  # logits_to_keep of this forward: the head computes the global sequence's last positions

    def pre_forward(self, module, *args, **kwargs):
        st = self.state
        self.restore_pending_head()  # a forward that raised may have left the head swapped
        st.fwd = ForwardData()
        kw = as_kwargs(module, args, kwargs)
        # how the model is called, not the data: these raise on the calling rank before any collective
        chunk_setting = check_loss_chunk(kw.pop("hfcp_loss_chunk", st.loss_chunk), "hfcp_loss_chunk")
        token_stats = kw.pop("hfcp_token_stats", False)  # [targets, top-1 hits, entropy sum] (HfcpSFTTrainer's metrics)
        cache = st.fwd.cache = generation_cache(st, module, kw, self.shards)
        outer_masks = check_call(kw)
        self._keep, self._chunk = 0, None
        if cache is not None and cache.seen:  # a decode step: its new tokens stay whole
            prepare_decode(st, module, kw, cache, step_token)
            st.fwd.decoding = True
            return (), kw
        pairs = st.patcher.token_side_inputs if self.shards else ()
        x, labels, targets_full = self._check_batch(module, kw, pairs)
        st.fwd.router_logits_wanted = router_logits_wanted(st, module, kw)
        if "use_cache" in inspect.signature(module._old_forward).parameters:
            kw["use_cache"] = cache is not None
        layout = Layout(x.shape[1], st.mesh.cp_size, zigzag=st.patcher.causal)
        check_length_limit(st.patcher, module.config.get_text_config(), layout)
        if self.shards:
            shard_inputs(st, kw, layout, outer_masks)
            shard_side_inputs(kw, pairs, st.step)
            if cache is not None:  # the prompt's prefill: each rank keeps its tokens' keys and values
                cache.begin_prefill(st.step)
        else:  # a vision-language model: its language model's hook shards the merged sequence (vlm_hooks)
            st.step, st.fwd.pending_layout = None, layout
        idx = layout.local_index(st.mesh.cp_rank, x.device)
        P = layout.padded_len
        num_items = kw.pop("num_items_in_batch", None) if st.head == "causal_lm" else None
        self._keep = kw.pop("logits_to_keep", 0) or 0
        if self._keep:  # the model computes every local position's hidden state; the head keeps the global last ones
            if (st.head != "causal_lm" or module.get_output_embeddings() is None
                    or "logits_to_keep" not in inspect.signature(module._old_forward).parameters):
                raise ValueError(f"logits_to_keep={self._keep} on a {type(module).__name__}, whose forward has no "
                                 "logits_to_keep of its own: hfcp keeps the last positions of a causal LM's logits "
                                 "only; leave it out")
            kw["logits_to_keep"] = 0
            self._keep_head(module)
        if labels is not None:
            st.fwd.denominator = num_items if num_items is not None else (targets_full != IGNORE_INDEX).sum()
            st.fwd.targets = pad_to(targets_full, P, 1, IGNORE_INDEX).index_select(1, idx.to(labels.device))
            if token_stats:
                st.fwd.token_stats = torch.zeros(3, dtype=torch.float64, device=x.device)
            self._chunk = loss_chunk_for(chunk_setting, module.training and torch.is_grad_enabled())
            if self._chunk:
                self._chunk_head(module)
        return (), kw

    def _check_batch(self, module, kw: dict, pairs):
        """check_lm_batch's (x, labels, targets) after the checks of the whole batch, in an order that never hangs:
        first the same-batch digest (a collective that cannot raise), then what raises on every rank alike: what an
        outer model that called a base model patched alone computes from the whole sequence (its labels, its router
        aux loss), the batch, the record's token side inputs, tensors of the whole sequence hfcp cannot split."""
        st = self.state
        alone = self.shards and st.head != "causal_lm"  # a base model: maybe a language model patched alone
        outer = outer_model_call(module) if alone else {}
        if st.check_inputs:
            names = BATCH_NAMES + tuple(mask for mask, _ in pairs) + (("outer model",) if alone else ())
            called_by = (bool(outer), bool(outer.get("router_logits")))  # (the outer model's labels: as "labels")
            seen = {**kw, "labels": outer.get("labels", kw.get("labels")), "outer model": called_by} if alone else kw
            check_same_batch(seen, st.mesh.cp_group, names)
        if outer:
            refuse_outer_call(module, outer)
        x, labels, targets = check_lm_batch(module, kw, st.head == "causal_lm")
        if self.shards:  # (a VLM's outer model: its language model's hook checks what reaches it)
            check_side_inputs(module, kw, pairs, x.shape[:2])
            refuse_unsplit_sequence_inputs(module, kw, SPLIT_BY_HFCP | side_input_names(pairs), *x.shape[:2])
        return x, labels, targets

    def _chunk_head(self, module):
        """For this forward, the output head computes the loss sum chunk by chunk instead of the logits."""
        st, fwd = self.state, self.state.fwd
        head = module.get_output_embeddings()
        chunk = self._chunk

        def loss_instead_of_logits(hidden, *args, **kwargs):
            self.restore_pending_head()  # one call only, and chunks call the real head
            fwd.loss_sum = chunked_ce_sum(hidden, fwd.targets, head, chunk, fwd.token_stats, st.logit_transform)
            return hidden.new_zeros(*hidden.shape[:-1], 0)  # (B, L/cp, 0): no logits materialised

        self._swap_head(head, loss_instead_of_logits)

    def _keep_head(self, module):
        """For this forward, the output head computes the logits of the global sequence's last positions only
        (logits_to_keep), the same on every rank."""
        st, keep = self.state, self._keep
        head = module.get_output_embeddings()

        def last_positions(hidden, *args, **kwargs):
            self.restore_pending_head()
            return head(keep_last_positions(hidden, keep, st.step, st.mesh.cp_group), *args, **kwargs)

        self._swap_head(head, last_positions)

    def _swap_head(self, head, forward):
        own = head.__dict__.get("forward")  # an instance forward of its own (another hook), kept; else the class's
        head.forward = forward
        self._restore_head = (lambda: setattr(head, "forward", own)) if own is not None else \
            (lambda: head.__dict__.pop("forward", None))

    def restore_pending_head(self):
        if self._restore_head is not None:
            self._restore_head()
            self._restore_head = None

    def post_forward(self, module, output):
        st = self.state
        check_attention_ran(st, module)
        if st.fwd.cache is not None:
            st.fwd.cache.end_forward()
            output = return_cache(output, st.fwd.cache)
            if st.fwd.decoding:  # its outputs are whole, the same on every rank
                for v in (output.values() if not isinstance(output, tuple) else output):
                    if isinstance(v, torch.Tensor):
                        v.hfcp_whole = True  # hfcp.gather_sequence returns them as they are
                return output
        if self._keep:
            if self._restore_head is not None:  # the stand-in clears it when called: the head never ran
                self.restore_pending_head()
                raise RuntimeError(f"{type(module).__name__} did not call its output head module with logits_to_keep, "
                                   "so hfcp cannot keep the global sequence's last positions; pass logits_to_keep=0 "
                                   "and take them from hfcp.gather_sequence(out.logits, model)")
            logits = output["logits"] if not isinstance(output, tuple) else output[0]
            logits.hfcp_whole = True  # the same on every rank: hfcp.gather_sequence returns it as it is
        st.fwd.local_output_names = stamp_sequence_outputs(output, st.step, skip=("logits",) if self._keep else ())
        aux = self._router_aux(module, output)
        if st.fwd.targets is None:
            return output if aux is None else type(output)(**{**output, "aux_loss": aux})
        chunked = self._chunk
        if chunked:
            self.restore_pending_head()
            if st.fwd.loss_sum is None:
                raise RuntimeError(f"{type(module).__name__} did not call its output head; use loss_chunk=None")
            local_sum, st.fwd.loss_sum = st.fwd.loss_sum, None
        else:
            logits = output["logits"] if not isinstance(output, tuple) else output[0]
            local_sum = ce_sum(logits, st.fwd.targets)
            if st.fwd.token_stats is not None:
                add_token_stats(logits.reshape(-1, logits.shape[-1]), st.fwd.targets.reshape(-1).to(logits.device),
                                st.fwd.token_stats)
        if st.fwd.token_stats is not None:  # [valid targets, top-1 hits, entropy sum] of the whole sequence
            st.fwd.token_stats = all_reduce_no_grad(st.fwd.token_stats, st.mesh.cp_group)
        loss = global_mean(local_sum, st.fwd.denominator, st.mesh.cp_group)
        st.fwd.targets = st.fwd.denominator = None
        if isinstance(output, tuple):  # with loss_chunk the (B, L/cp, 0) stand-in logits become None
            return (loss, None, *output[1:]) if chunked else (loss, *output)
        fields = {k: v for k, v in output.items() if k != "loss"}
        if chunked:
            fields["logits"] = None  # never materialised; pass loss_chunk=None to hfcp.patch to get them
        if aux is not None:  # as the model's forward: loss += coef * aux
            loss = loss + st.router_aux.coef * aux
            fields["aux_loss"] = aux
        return type(output)(loss=loss, **fields)

    def _router_aux(self, module, output):
        """The MoE router aux loss of the whole sequence when this forward recorded router logits, else None;
        the output keeps this rank's router logits (sequence outputs stay local)."""
        st = self.state
        if not st.fwd.router_logits_wanted:
            return None
        logits, st.fwd.router_logits = st.fwd.router_logits, None
        if not logits:
            raise ValueError(f"{type(module).__name__} recorded no router logits with output_router_logits=True (no MoE "
                             "layer ran?), so hfcp cannot compute the router aux loss; leave output_router_logits off")
        sb = st.step
        B = logits[0].numel() // (sb.layout.local_len * st.router_aux.num_experts)
        valid = torch.ones(B, sb.layout.local_len, device=logits[0].device)
        if sb.key_valid is not None:  # padding (the user's and the layout's) counts for nothing, as in transformers
            valid = sb.key_valid.index_select(1, sb.local_index.to(sb.key_valid.device)).to(valid)
        output["router_logits"] = logits
        return global_aux(logits, valid.reshape(-1), st.router_aux, st.mesh.cp_group)


def check_attention_ran(state, module) -> None:
    """Raises RuntimeError when a patched attention module ran this forward without calling hfcp's attention
    function (for example after model.set_attn_implementation(...) on a patched model): its output is wrong."""
    missed = [m for m in state.modules if id(m) not in state.fwd.attention_calls]
    if missed:
        raise RuntimeError(
            f"{len(missed)} of {len(state.modules)} attention modules of {type(module).__name__} ({type(missed[0]).__name__}) "
            f"ran this forward without hfcp's attention (attn_implementation is now "
            f"{module.config._attn_implementation!r}), so they attended within this rank's shard only and the outputs "
            "are wrong. Do not change the attention implementation of a patched model: hfcp.unpatch(model) first"
        )


# output fields that are local but not (batch, seq, ...) sequences, or not local at all (a VLM's image features)
NOT_SEQUENCE_OUTPUTS = frozenset({"router_logits", "image_hidden_states", "video_hidden_states", "image_outputs",
                                  "video_outputs"})


def stamp_sequence_outputs(output, step, skip: tuple = ()) -> frozenset:
    """Tag the local sequence tensors of an output with their step, so that gather_sequence can refuse a tensor
    of an earlier forward (its layout may differ even when its local length does not). Returns the names of the
    output fields that hold them (router logits are (tokens, experts) rows: local, but not (batch, seq, ...));
    `skip`: fields that are not local (the logits of logits_to_keep, the same on every rank)."""
    items = enumerate(output) if isinstance(output, tuple) else output.items()
    names = set()
    for name, v in items:
        if name in NOT_SEQUENCE_OUTPUTS or name in skip or (skip and name == 0):
            continue
        for t in (v if isinstance(v, tuple) else (v,)):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == step.layout.local_len:
                t.hfcp_step = step
                names.add(name)
    return frozenset(n for n in names if isinstance(n, str))
