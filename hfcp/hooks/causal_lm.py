"""The hooks of causal LMs and base models: the sequence hook shards the full batch and reduces the loss; the loss
hook alone is a VLM outer model's (its language model's hook, hooks/vlm.py, shards the merged sequence)."""
from __future__ import annotations


import torch
from accelerate.hooks import ModelHook

from ..attention.step_token import step_token
from ..distributed.input_checks import BATCH_NAMES, check_same_batch
from ..compiler import eager
from ..distributed.collectives import all_reduce_no_grad
from ..state import ForwardData
from ..inference.generate import LAST_LOGITS, generation_cache, prepare_decode, return_cache
from ..layout.balance import why_row_layout
from ..layout import Layout
from ..layout.work import layer_masks
from ..loss.cross_entropy import IGNORE_INDEX, ce_sum, chunked_ce_sum, global_mean
from ..loss.linear_ce import add_token_stats
from ..loss.router import global_aux
from ..state import check_loss_chunk
from .batch import as_kwargs, check_call, check_length_limit, check_lm_batch, shard_inputs
from ..families.introspect import forward_parameters
from .output_stamps import (check_attention_ran, first_field, keep_last_positions, output_values,
                      stamp_sequence_outputs, swap_forward)
from .side_inputs import (SPLIT_BY_HFCP, check_side_inputs, outer_model_call, refuse_outer_call,
                          refuse_unsplit_sequence_inputs, shard_side_inputs, side_input_names)


DEFAULT_LOSS_CHUNK = 1024
LABELS_OF_HEAD = {"causal_lm": "shifted", "token_classification": "token", "sequence_classification": "sequence"}


def loss_chunk_for(setting, training: bool) -> int | None:
    """The loss chunk of one forward with labels: "auto" chunks (1024 tokens) in training forwards (module in
    train mode, grad enabled) and returns logits otherwise; an int always chunks; None never does."""
    if setting == "auto":
        return DEFAULT_LOSS_CHUNK if training else None
    return setting


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


class LossHook(ModelHook):
    """A VLM outer model's hook. pre_forward: the full batch checked, the step's layout computed and left for its
    language model's hook (hooks/vlm.py), the shifted labels' local slice kept aside; post_forward: loss = global
    token-weighted mean, equal on every rank. ShardSequenceHook adds the sharding of the model's own inputs."""

    shards = False  # whether this hook shards its model's inputs (else its language model's hook does)

    def __init__(self, state):
        self.state = state
        self._restore_head = None
        self._head = None  # the output head whose forward this forward swaps
        self._chunk = None  # tokens per loss chunk in this forward, or None: loss from the logits
        self._keep = 0  # logits_to_keep of this forward: the head computes the global sequence's last positions
        # the head's stand-ins: one object each for the hook's life (a compiled caller guards on the head's forward)
        self._loss_stand_in = eager(self._loss_instead_of_logits)
        self._keep_stand_in = eager(self._last_positions)

    @eager
    def pre_forward(self, module, *args, **kwargs):
        st = self.state
        self.restore_pending_head()  # a forward that raised may have left the head swapped
        st.fwd = ForwardData()
        kw = as_kwargs(module, args, kwargs)
        # how the model is called, not the data: these raise on the calling rank before any collective
        chunk_setting = check_loss_chunk(kw.pop("hfcp_loss_chunk", st.loss_chunk), "hfcp_loss_chunk")
        token_stats = kw.pop("hfcp_token_stats", False)  # [targets, top-1 hits, entropy sum] (HfcpSFTTrainer's metrics)
        cache = st.fwd.cache = generation_cache(st, module, kw, self.shards)
        last_only = kw.pop(LAST_LOGITS, False)  # generate() on a model without logits_to_keep: keep the last position
        outer_masks = check_call(kw)
        self._keep, self._chunk = 0, None
        if cache is not None and cache.seen:  # a decode step: its new tokens stay whole
            prepare_decode(st, module, kw, cache, step_token)
            st.fwd.decoding = True
            return (), kw
        pairs = st.patcher.token_side_inputs if self.shards else ()
        x, labels, targets_full = self._check_batch(module, kw, pairs)
        st.fwd.router_logits_wanted = router_logits_wanted(st, module, kw)
        if "use_cache" in forward_parameters(module):
            kw["use_cache"] = cache is not None
        layout = Layout(x.shape[1], st.mesh.cp_size, zigzag=st.patcher.causal)
        check_length_limit(st.patcher, module.config.get_text_config(), layout)
        self._place(kw, layout, outer_masks, pairs, cache)
        layout = st.step.layout if st.step is not None else layout  # (packed documents: hfcp.layout.balance)
        num_items = kw.pop("num_items_in_batch", None) if st.head == "causal_lm" else None
        self._keep = kw.pop("logits_to_keep", 0) or (1 if last_only else 0)  # (generate() reads [:, -1] only)
        if self._keep:  # the model computes every local position's hidden state; the head keeps the global last ones
            own = "logits_to_keep" in forward_parameters(module)
            if st.head != "causal_lm" or module.get_output_embeddings() is None or not (own or last_only):
                raise ValueError(f"logits_to_keep={self._keep} on a {type(module).__name__}, whose forward has no "
                                 "logits_to_keep of its own: hfcp keeps the last positions of a causal LM's logits "
                                 "only; leave it out")
            if own:
                kw["logits_to_keep"] = 0
            self._keep_head(module)
        if labels is not None:
            st.fwd.denominator = num_items if num_items is not None else (targets_full != IGNORE_INDEX).sum()
            st.fwd.targets = layout.local(targets_full, st.mesh.cp_rank, fill=IGNORE_INDEX)
            if token_stats:
                st.fwd.token_stats = torch.zeros(3, dtype=torch.float64, device=x.device)
            if st.head == "causal_lm":  # (a token classifier's logits are tokens x classes: nothing to chunk)
                self._chunk = loss_chunk_for(chunk_setting, module.training and torch.is_grad_enabled())
            if self._chunk:
                self._chunk_head(module)
        return (), kw

    def _place(self, kw: dict, layout: Layout, outer_masks, pairs, cache) -> None:
        """The step's tokens: the language model's hook shards the merged sequence (hooks/vlm.py)."""
        self.state.step, self.state.fwd.pending_layout = None, layout

    def _check_batch(self, module, kw: dict, pairs):
        """check_lm_batch's (x, labels, targets) after the checks of the whole batch, in an order that never hangs:
        first the same-batch digest (a collective that cannot raise), then what raises on every rank alike: what an
        outer model that called a base model patched alone computes from the whole sequence (its labels, its router
        aux loss), the batch, the record's token side inputs, tensors of the whole sequence hfcp cannot split."""
        st = self.state
        alone = self.shards and st.head == "base"  # a base model: maybe a language model patched alone
        outer = outer_model_call(module) if alone else {}
        if st.check_inputs:
            names = BATCH_NAMES + tuple(mask for mask, _ in pairs) + (("outer model",) if alone else ())
            called_by = (bool(outer), bool(outer.get("router_logits")))  # (the outer model's labels: as "labels")
            seen = {**kw, "labels": outer.get("labels", kw.get("labels")), "outer model": called_by} if alone else kw
            check_same_batch(seen, st.mesh.cp_group, names)
        if outer:
            refuse_outer_call(module, outer)
        x, labels, targets = check_lm_batch(module, kw, LABELS_OF_HEAD.get(st.head))
        if self.shards:  # (a VLM's outer model: its language model's hook checks what reaches it)
            check_side_inputs(module, kw, pairs, x.shape[:2])
            refuse_unsplit_sequence_inputs(module, kw, SPLIT_BY_HFCP | side_input_names(pairs), *x.shape[:2])
        return x, labels, targets

    def _chunk_head(self, module):
        """For this forward, the output head computes the loss sum chunk by chunk instead of the logits."""
        self._swap_head(module.get_output_embeddings(), self._loss_stand_in)

    def _loss_instead_of_logits(self, hidden, *args, **kwargs):
        st, fwd, head = self.state, self.state.fwd, self._head
        self.restore_pending_head()  # one call only, and chunks call the real head
        fwd.loss_sum = chunked_ce_sum(hidden, fwd.targets, head, self._chunk, fwd.token_stats, st.logit_transform)
        return hidden.new_zeros(*hidden.shape[:-1], 0)  # (B, L/cp, 0): no logits materialised

    def _keep_head(self, module):
        """For this forward, the output head computes the logits of the global sequence's last positions only
        (logits_to_keep), the same on every rank."""
        self._swap_head(module.get_output_embeddings(), self._keep_stand_in)

    def _last_positions(self, hidden, *args, **kwargs):
        st, head = self.state, self._head
        self.restore_pending_head()
        return head(keep_last_positions(hidden, self._keep, st.step, st.mesh.cp_group), *args, **kwargs)

    def _swap_head(self, head, forward):
        self._head = head
        self._restore_head = swap_forward(head, forward)

    def restore_pending_head(self):
        if self._restore_head is not None:
            self._restore_head()
            self._restore_head = None

    @eager
    def post_forward(self, module, output):
        st = self.state
        check_attention_ran(st, module)
        if st.fwd.cache is not None:
            st.fwd.cache.end_forward()
            output = return_cache(output, st.fwd.cache)
            if st.fwd.decoding:  # its outputs are whole, the same on every rank
                for v in output_values(output):
                    if isinstance(v, torch.Tensor):
                        v.hfcp_whole = True  # hfcp.gather_sequence returns them as they are
                return output
        if self._keep:
            if self._restore_head is not None:  # the stand-in clears it when called: the head never ran
                self.restore_pending_head()
                raise RuntimeError(f"{type(module).__name__} did not call its output head module with logits_to_keep, "
                                   "so hfcp cannot keep the global sequence's last positions; pass logits_to_keep=0 "
                                   "and take them from hfcp.gather_sequence(out.logits, model)")
            logits = first_field(output, "logits")
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
            logits = first_field(output, "logits")
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
            raise ValueError(f"{type(module).__name__} recorded no router logits with output_router_logits=True (no "
                             "MoE layer ran?), so hfcp cannot compute the router aux loss; "
                             "leave output_router_logits off")
        sb = st.step
        B = logits[0].numel() // (sb.layout.local_len * st.router_aux.num_experts)
        valid = torch.ones(B, sb.layout.local_len, device=logits[0].device)
        if sb.key_valid is not None:  # padding (the user's and the layout's) counts for nothing, as in transformers
            valid = sb.local(sb.key_valid).to(valid)
        output["router_logits"] = logits
        return global_aux(logits, valid.reshape(-1), st.router_aux, st.mesh.cp_group)


class ShardSequenceHook(LossHook):
    """A causal LM's or base model's hook: as LossHook, and pre_forward replaces the per-token inputs
    (input_ids / inputs_embeds / position_ids, the record's side inputs) by this rank's slice of the layout."""

    shards = True

    def _place(self, kw: dict, layout: Layout, outer_masks, pairs, cache) -> None:
        st = self.state
        balance = st.settings.balance == "auto" and cache is None and not outer_masks and not pairs \
            and not why_row_layout(st.patcher)  # (generation keeps the row layout its cache is built on)
        shard_inputs(st, kw, layout, outer_masks, layer_masks(st.modules, True) if balance else None)
        shard_side_inputs(kw, pairs, st.step)
        if cache is not None:  # the prompt's prefill: each rank keeps its tokens' keys and values
            cache.begin_prefill(st.step)
