"""Workers for sequence mixers other than attention under CP (issue 19): tiny hybrid models against the unpatched
model, loss and every gradient."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.compare import grad_error
from workers_model import averaged_grads

_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             layer_types=["conv", "full_attention", "conv", "conv"])


_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
               linear_conv_kernel_dim=4, head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)
GATED_DELTA = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini")
KDA = ("kimi_linear", "bailing_hybrid")  # Kimi delta attention: MLA attention layers, the family sweep's tiny model
MAMBA2 = ("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "zamba2", "nemotron_h")  # Mamba-2 (mamba2 alone)
MAMBA1 = ("mamba", "falcon_mamba", "jamba", "zamba")  # Mamba 1 (mamba and falcon_mamba alone); no chunked kernel
OTHER = ("minimax", "recurrent_gemma")  # lightning attention (blocks of 8 tokens), RG-LRU; no chunked kernel


def _perturbed(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.float().train()


def tiny_gated_delta(kind: str, attention: str = "full_attention"):
    """A gated delta net hybrid: linear, attention, linear, linear layers (GQA in the delta rule: 2 key heads for 4
    value heads, dk 8, dv 6, conv kernel 4); weights perturbed."""
    import transformers as T

    layers = ["linear_attention", attention, "linear_attention", "linear_attention"]
    cfg = T.AutoConfig.for_model(kind, **{**_TEXT, **_LINEAR, "layer_types": layers})
    cfg._attn_implementation = "sdpa"
    return _perturbed(T.AutoModelForCausalLM.from_config(cfg))


def tiny_hybrid(kind: str):
    """LFM2 (kernel 3), LFM3 (kernel 7) or LFM2-MoE: conv, attention, conv, conv layers; or a gated delta net
    hybrid (GATED_DELTA); weights perturbed."""
    import transformers as T

    if kind in GATED_DELTA:
        return tiny_gated_delta(kind, "sliding_attention" if kind == "lara_mini" else "full_attention")
    if kind == "minimax":  # blocks of 8 tokens, so that the runs cut them
        from hfcp.testing.tiny import tiny_config

        cfg = tiny_config(kind)
        cfg.block_size, cfg.output_router_logits = 8, False
        return _perturbed(T.AutoModelForCausalLM.from_config(cfg))
    if kind == "recurrent_gemma":  # the sweep's tiny config has no attention layer: recurrent, attention, recurrent
        cfg = T.RecurrentGemmaConfig(**{k: _TEXT[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                             "num_attention_heads", "num_key_value_heads",
                                                             "pad_token_id")},
                                     num_hidden_layers=3, head_dim=8, lru_width=32, attention_window_size=16,
                                     conv1d_width=4, block_types=("recurrent", "attention", "recurrent"),
                                     attn_implementation="sdpa")
        return _perturbed(T.RecurrentGemmaForCausalLM(cfg))
    if kind in KDA + MAMBA2 + MAMBA1:
        from hfcp.testing.tiny import tiny_model

        model = tiny_model(kind)
        model.config.output_router_logits = False
        return _perturbed(model)
    if kind == "lfm2":
        model = T.Lfm2ForCausalLM(T.Lfm2Config(**_TEXT, conv_L_cache=3, attn_implementation="sdpa"))
    elif kind == "lfm3":
        model = T.Lfm3ForCausalLM(T.Lfm3Config(**_TEXT, conv_L_cache=7, attn_implementation="sdpa"))
    else:
        model = T.Lfm2MoeForCausalLM(T.Lfm2MoeConfig(**_TEXT, conv_L_cache=3, num_experts=2, num_experts_per_tok=1,
                                                    moe_intermediate_size=32, num_dense_layers=2,
                                                    attn_implementation="sdpa"))
    return _perturbed(model)


def batch(case: str, length: int = 40) -> dict:
    """Two rows; "padding": row 0 left-padded (6 tokens); "one_row_padding": that row alone; "packed": two
    documents per row."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 90, (2, length), generator=g)
    if case == "one_row_padding":
        ids, case = ids[:1], "padding"
    out = {"input_ids": ids, "labels": ids.clone()}
    if case == "padding":
        mask = torch.ones_like(ids)
        mask[0, :6] = 0
        out["labels"][0, :7] = -100
        out["attention_mask"] = mask
    if case == "packed":
        half = length // 2
        out["position_ids"] = torch.cat([torch.arange(half), torch.arange(length - half)])[None].repeat(2, 1)
    return out


def compare(kind: str, case: str, strategy: str = "ring", checkpointing: str = "") -> dict:
    """checkpointing: "checkpointing" (gradient checkpointing on), or "two_forwards" (on, and a second forward of
    another batch of the same length, other padding, before the first one's backward)."""
    torch.manual_seed(0)
    ref = tiny_hybrid(kind)
    torch.manual_seed(0)
    model = tiny_hybrid(kind)
    data = batch(case)
    want = ref(**data).loss
    want.backward()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hfcp.patch(model, strategy=strategy, timeout=30)
    try:
        got = model(**data).loss
        if checkpointing == "two_forwards":
            model(**batch("plain")).loss  # the first graph is still alive: its recompute keeps its own step
        got.backward()
    except ValueError as e:
        return {"refused": str(e)}
    finally:
        hfcp.unpatch(model)
    grads = averaged_grads(model)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    # the parameters whose gradient comes back through the halos and states: convolutions, decays, lightning q k v
    carried = (".conv.conv.", "conv1d", "conv_1d", "A_log", "dt_bias", "recurrent_param", "qkv_proj")
    conv = {n: g for n, g in grads.items() if any(k in n for k in carried)}
    return {"loss_err": abs(got.item() - want.item()) / want.item(), "grad_err": grad_error(grads, ref_grads),
            "conv_grad_err": grad_error(conv, {n: ref_grads[n] for n in conv}), "conv_params": len(conv),
            "same_keys": grads.keys() == ref_grads.keys(), "noise": kernel_noise(kind, data, ref_grads),
            "restored": all("forward" not in m.__dict__ and not m._forward_pre_hooks for m in model.modules())}


def kernel_noise(kind: str, data: dict, ref_grads: dict) -> float:
    """The fp32 noise of the family's own recurrent kernel on one device (sweep_families.delta_rule_noise); 0 for
    families without the rule."""
    from hfcp.testing.sweeps.families import delta_rule_noise

    if kind not in GATED_DELTA + KDA + MAMBA2:
        return 0.0
    torch.manual_seed(0)
    return delta_rule_noise(tiny_hybrid(kind), data, ref_grads)


def loop_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False):
    """The gated delta rule token by token, in the inputs' dtype (its definition, as transformers'
    torch_recurrent_gated_delta_rule computes it in fp32): q, k (B, L, H, dk), v (B, L, H, dv), g, beta (B, L, H)."""
    b, length, h, dk = k.shape
    state = initial_state if initial_state is not None else v.new_zeros(b, h, dk, v.shape[-1])
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * dk ** -0.5
    out = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]  # (B, H, dv)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, 1), state if output_final_state else None


def fold_exact(zigzag: bool, length: int = 37) -> dict:
    """chunked_rule_over_ranks in fp64 against the rule over the whole sequence: outputs at this rank's tokens and
    the gradients of every input (summed over the ranks), relative to their largest value."""
    from hfcp.layout import Layout, build_step_batch
    from hfcp.mixers.state_fold import chunked_rule_over_ranks

    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    shapes = {"q": (2, length, 3, 4), "k": (2, length, 3, 4), "v": (2, length, 3, 5), "g": (2, length, 3),
              "beta": (2, length, 3)}
    x = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    x["g"], x["beta"] = -x["g"].abs() * 0.3, x["beta"].sigmoid()
    x = {n: t.requires_grad_() for n, t in x.items()}
    want, _ = loop_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)
    probe = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad((want * probe).sum(), list(x.values()))
    layout = Layout(length, cp, zigzag)
    step = build_step_batch(layout, rank, 2, None, None, torch.device("cpu"))
    index = layout.local_index(rank)
    local = {n: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, layout.padded_len - length))
                .index_select(1, index)
             for n, t in x.items()}  # hfcp's end padding: zeros (no decay, no update)
    got = chunked_rule_over_ranks(loop_delta_rule, local["q"], local["k"], local["v"],
                                  {"g": local["g"], "beta": local["beta"]}, step, dist.group.WORLD,
                                  use_qk_l2norm_in_kernel=True)
    real = index < length
    probe_local = torch.nn.functional.pad(probe, (0, 0, 0, 0, 0, layout.padded_len - length)).index_select(1, index)
    grads = torch.autograd.grad((got * probe_local).sum(), list(x.values()))
    err = {}
    for (n, _), mine, ref in zip(x.items(), grads, want_grads):
        total = mine.clone()
        dist.all_reduce(total)
        err[n] = float((total - ref).abs().max() / ref.abs().max())
    out_err = float((got[:, real] - want.index_select(1, index[real])).abs().max().detach() / want.abs().max().detach())
    return {"out_err": out_err, "grad_err": max(err.values()), "runs": len(layout.ranges(rank))}


def cached_forward(kind: str) -> str:
    """The message of a patched hybrid's forward with use_cache=True (generation)."""
    model = tiny_hybrid(kind)
    hfcp.patch(model, timeout=30)
    try:
        model(**batch("plain"), use_cache=True)
        return "ran"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)


def gathered_bytes(kind: str) -> dict:
    """Bytes this rank contributed to the all-gathers of the conv halos and the state folds in one forward (ring,
    zigzag), by the module that called them, beside hfcp.attention.volume's forward half for the same shapes."""
    import hfcp.distributed.collectives as C
    from hfcp.attention.volume import channel_fold_bytes, conv_halo_bytes, scalar_fold_bytes, state_fold_bytes

    model = tiny_hybrid(kind)
    seen = {"conv_halo": 0, "state_fold": 0}
    gather = C.all_gather_no_grad

    def counting(x, group, dim):
        import inspect

        callers = {f.frame.f_globals.get("__name__", "") for f in inspect.stack()[1:6]}
        for name in seen:
            if f"hfcp.mixers.{name}" in callers:
                seen[name] += x.numel() * x.element_size()
        return gather(x, group, dim)

    hfcp.patch(model, timeout=30)
    C.all_gather_no_grad = counting
    try:
        model(**batch("plain"))
    finally:
        C.all_gather_no_grad = gather
        hfcp.unpatch(model)
    cfg, cp = model.config, dist.get_world_size()
    if kind == "mamba2":  # every layer: conv over x, B and C; the scalar-decay fold
        layers, inner = cfg.num_hidden_layers, cfg.expand * cfg.hidden_size
        conv = layers * conv_halo_bytes(2, inner + 2 * cfg.n_groups * cfg.state_size, cfg.conv_kernel, cp,
                                        dtype_bytes=4) / 2
        fold = layers * scalar_fold_bytes(2, cfg.num_heads, cfg.head_dim, cfg.state_size, cp) / 2
        return {"conv_sent": seen["conv_halo"] * (cp - 1), "conv_formula": conv,
                "fold_sent": seen["state_fold"] * (cp - 1), "fold_formula": fold}
    if kind == "mamba":  # every layer: conv over x alone; the fold per channel
        layers, inner = cfg.num_hidden_layers, cfg.intermediate_size
        conv = layers * conv_halo_bytes(2, inner, cfg.conv_kernel, cp, dtype_bytes=4) / 2
        fold = layers * channel_fold_bytes(2, inner, cfg.state_size, cp) / 2
        return {"conv_sent": seen["conv_halo"] * (cp - 1), "conv_formula": conv,
                "fold_sent": seen["state_fold"] * (cp - 1), "fold_formula": fold}
    layers = cfg.layer_types.count("linear_attention")
    channels = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    conv = layers * conv_halo_bytes(2, channels, cfg.linear_conv_kernel_dim, cp, dtype_bytes=4) / 2
    fold = layers * state_fold_bytes(2, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                     cp) / 2
    return {"conv_sent": seen["conv_halo"] * (cp - 1), "conv_formula": conv,
            "fold_sent": seen["state_fold"] * (cp - 1), "fold_formula": fold}


def changed_form(kind: str = "qwen3_next") -> str:
    """hfcp.patch's message for a model whose delta-rule layers have a forward of another form (here: one that
    reverses the tokens first, a mixing hfcp would not see), under the class name the record names."""
    model = tiny_hybrid(kind)
    layers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    base = type(layers[0])

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        return base.forward(self, hidden_states.flip(1), cache, attention_mask, **kwargs)

    changed = type(base.__name__, (base,), {"forward": forward})
    for layer in layers:
        layer.__class__ = changed
    try:
        hfcp.patch(model, timeout=30)
        hfcp.unpatch(model)
        return "patched"
    except ValueError as e:
        return str(e)


def loop_ssd(hidden_states, log_decay, B, C, initial_states=None, return_final_states=False):
    """A scalar-decay scan token by token (Mamba-2's SSD, discretised): h_t = exp(l_t) h_{t-1} + x_t B_t^T,
    y_t = h_t C_t; x (B, L, H, P), l (B, L, H), B and C (B, L, H, N)."""
    b, length, h, p = hidden_states.shape
    state = initial_states if initial_states is not None else hidden_states.new_zeros(b, h, p, B.shape[-1])
    out = []
    for t in range(length):
        state = log_decay[:, t, :, None, None].exp() * state + hidden_states[:, t, :, :, None] * B[:, t, :, None, :]
        out.append((state * C[:, t, :, None, :]).sum(-1))
    out = torch.stack(out, 1)
    return (out, state) if return_final_states else out


def _against_whole(loop, x: dict, fold, token_dim: int, zigzag: bool, seed: int) -> dict:
    """fold(local inputs, step) (a fold over the ranks of this rank's tokens) in fp64 against loop(**x) over the whole
    sequence: outputs at this rank's tokens and the gradients of every input (summed over the ranks), relative to
    their largest value."""
    from hfcp.layout import Layout, build_step_batch

    rank, cp = dist.get_rank(), dist.get_world_size()
    length = next(iter(x.values())).shape[token_dim]
    want = loop(**x)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    want_grads = torch.autograd.grad((want * probe).sum(), list(x.values()))
    layout = Layout(length, cp, zigzag)
    step = build_step_batch(layout, rank, 2, None, None, torch.device("cpu"))
    index = layout.local_index(rank)
    pad = layout.padded_len - length

    def local(t, dim):  # hfcp's end padding (zeros: no decay, no update), then this rank's tokens
        dim = dim % t.dim()
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, pad)).index_select(dim, index)

    got = fold({n: local(t, token_dim) if t.dim() > 2 else t for n, t in x.items()}, step)
    grads = torch.autograd.grad((got * local(probe, token_dim)).sum(), list(x.values()))
    err = []
    for mine, ref in zip(grads, want_grads):
        total = mine.clone()
        dist.all_reduce(total)
        err.append(float((total - ref).abs().max() / ref.abs().max()))
    real = torch.nonzero(index < length).flatten()
    out_err = (got.index_select(token_dim, real) - want.index_select(token_dim, index[real])).abs().max()
    return {"out_err": float(out_err.detach() / want.abs().max().detach()), "grad_err": max(err)}


def scalar_fold_exact(zigzag: bool, length: int = 37) -> dict:
    """scalar_decay_over_ranks in fp64 against loop_ssd over the whole sequence (zigzag, or contiguous runs)."""
    from hfcp.mixers.state_fold import scalar_decay_over_ranks

    g = torch.Generator().manual_seed(4)
    shapes = {"hidden_states": (2, length, 3, 5), "log_decay": (2, length, 3), "B": (2, length, 3, 4),
              "C": (2, length, 3, 4)}
    x = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    x["log_decay"] = -x["log_decay"].abs() * 0.3
    x = {n: t.requires_grad_() for n, t in x.items()}
    return _against_whole(loop_ssd, x, lambda local, step: scalar_decay_over_ranks(
        loop_ssd, local["log_decay"], local["C"], local, step, dist.group.WORLD, torch.float64), 1, zigzag, 5)


def loop_selective(hidden_states, dt, A, B, C, return_last_state=True):
    """Mamba 1's selective scan token by token, in its kernel's layout: h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t,
    y_t = h_t C_t; x and dt (B, D, L), A (D, N), B and C (B, N, L)."""
    state = hidden_states.new_zeros(hidden_states.shape[:2] + A.shape[-1:])
    out = []
    for t in range(hidden_states.shape[-1]):
        state = ((A * dt[:, :, t, None]).exp() * state
                 + (dt[:, :, t] * hidden_states[:, :, t])[..., None] * B[:, None, :, t])
        out.append((state * C[:, None, :, t]).sum(-1))
    out = torch.stack(out, -1)
    return (out, state) if return_last_state else out


def channel_fold_exact(zigzag: bool, length: int = 37) -> dict:
    """channel_decay_over_ranks in fp64 against loop_selective over the whole sequence."""
    from hfcp.mixers.state_fold import channel_decay_over_ranks

    g = torch.Generator().manual_seed(6)
    shapes = {"hidden_states": (2, 5, length), "dt": (2, 5, length), "A": (5, 4), "B": (2, 4, length),
              "C": (2, 4, length)}
    x = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    x["dt"], x["A"] = x["dt"].abs() * 0.3, -x["A"].abs()
    x = {n: t.requires_grad_() for n, t in x.items()}

    def fold(local, step):
        def run(**per_token):
            return loop_selective(A=local["A"], **per_token)
        per_token = {n: t for n, t in local.items() if n != "A"}
        return channel_decay_over_ranks(run, local["dt"], local["A"], local["C"], per_token, step, dist.group.WORLD)

    return _against_whole(lambda **kw: loop_selective(**kw, return_last_state=False), x, fold, -1, zigzag, 7)


def loop_gated(hidden_states, gate):
    """RG-LRU's recurrence token by token: h_t = gate_t h_{t-1} + x_t, its output; x and gate (B, L, W)."""
    state, out = torch.zeros_like(hidden_states[:, 0]), []
    for t in range(hidden_states.shape[1]):
        state = gate[:, t] * state + hidden_states[:, t]
        out.append(state)
    return torch.stack(out, 1)


def gated_fold_exact(zigzag: bool, length: int = 37) -> dict:
    """gated_sum_over_ranks in fp64 against loop_gated over the whole sequence, with a reset (a gate of 0) inside."""
    from hfcp.mixers.state_fold import gated_sum_over_ranks

    g = torch.Generator().manual_seed(8)
    x = {"hidden_states": torch.randn(2, length, 6, generator=g, dtype=torch.float64),
         "gate": torch.rand(2, length, 6, generator=g, dtype=torch.float64)}
    x["gate"][:, length // 3] = 0  # a document start
    x = {n: t.requires_grad_() for n, t in x.items()}

    def fold(local, step):
        def run(hidden_states, gate):
            out = loop_gated(hidden_states, gate)
            return out, out[:, -1]
        return gated_sum_over_ranks(run, local["gate"], local, step, dist.group.WORLD)

    return _against_whole(loop_gated, x, fold, 1, zigzag, 9)


def user_built(kind: str):
    """A tiny model built from its family's config as a user (or a checkpoint's config.json) would: Mamba-2 alone, a
    Jamba hybrid (a Mamba layer; an attention layer with MoE), LFM2 (conv, attention, conv, conv), Zamba (Mamba
    layers, the shared attention block beside the third and fifth: transformers ties it from layer 2) or Llama
    (attention only, the control); weights perturbed."""
    import transformers as T

    small = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    attention = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    if kind == "mamba2":
        cfg = T.Mamba2Config(**small, num_heads=4, head_dim=16, expand=2, state_size=8, n_groups=1, conv_kernel=4,
                             chunk_size=8)
    elif kind == "jamba":
        cfg = T.JambaConfig(**small, **attention, num_experts=2, num_experts_per_tok=1, attn_layer_period=2,
                            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                            mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
    elif kind == "lfm2":
        cfg = T.Lfm2Config(**{**small, **attention, "num_hidden_layers": 4}, conv_L_cache=3,
                           layer_types=["conv", "full_attention", "conv", "conv"])
    elif kind == "zamba":
        cfg = T.ZambaConfig(**{**small, **attention, "num_hidden_layers": 5}, attention_head_dim=8, n_mamba_heads=2,
                            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, attn_layer_period=2,
                            attn_layer_offset=1)
    else:
        cfg = T.LlamaConfig(**small, **attention)
    if kind != "mamba2":  # (no attention)
        cfg._attn_implementation = "sdpa"
    return _perturbed(T.AutoModelForCausalLM.from_config(cfg))


def padded_batch(length: int, padded_row: int | None, pad: int, seed: int) -> dict:
    """(2, length) ids; row `padded_row` left-padded by `pad` tokens (None: no padding)."""
    ids = torch.randint(3, 90, (2, length), generator=torch.Generator().manual_seed(seed))
    out = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    if padded_row is not None:
        out["attention_mask"][padded_row, :pad] = 0
        out["labels"][padded_row, :pad] = -100
    return out


def interleaved(kind: str, reentrant: bool, a_padded: bool, b_length: int, checkpointing: str = "transformers") -> dict:
    """A's forward, B's forward under torch.no_grad() (an evaluation or DPO's reference pass), then A's backward,
    under activation checkpointing, reentrant or not: the CP-mean gradients against the unpatched model's gradients of
    A alone. A: (2, 24), row 0 left-padded by 3 (or not); B: (2, b_length), row 1 left-padded by 9.
    checkpointing: "transformers" (gradient_checkpointing_enable before hfcp.patch; "transformers_after": after
    it), "wrapper" (torch's
    apply_activation_checkpointing on the decoder layers, after it) or "composable" (torch's composable checkpoint on
    the decoder layers, a checkpoint hfcp does not carry steps through)."""
    from hfcp.mixers.binding import StepCarrying

    a = padded_batch(24, 0 if a_padded else None, 3, seed=5)
    b = padded_batch(b_length, 1, 9, seed=6)
    torch.manual_seed(0)
    ref = user_built(kind)
    ref(**a).loss.backward()
    torch.manual_seed(0)
    model = user_built(kind)
    if checkpointing == "transformers":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    hfcp.patch(model, timeout=30)
    if checkpointing == "transformers_after":  # as the Trainer does, after the model was built (and patched)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    _checkpoint_layers(model, checkpointing, reentrant)
    try:
        loss = model(**a).loss
        with torch.no_grad():
            model(**b)
        loss.backward()
    except (ValueError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    finally:
        hfcp.unpatch(model)
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in averaged_grads(model).items()}
    restored = all(not isinstance(m.__dict__.get(k), StepCarrying) for m in model.modules()
                   for k in ("_gradient_checkpointing_func", "checkpoint_fn"))
    return {"grad_err": grad_error(got, want), "restored": restored}


def _checkpoint_layers(model, checkpointing: str, reentrant: bool) -> None:
    """Activation checkpointing of each decoder layer by torch's checkpoint_wrapper or composable checkpoint."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    layers = list(model.base_model.layers)
    if checkpointing == "wrapper":
        impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(model, partial(checkpoint_wrapper, checkpoint_impl=impl),
                                       check_fn=lambda m: any(m is layer for layer in layers))
    elif checkpointing == "composable":
        from torch.distributed._composable import checkpoint

        for layer in layers:
            checkpoint(layer)


def _float64_kernel(kernel):
    """transformers' torch chunked gated delta rule casts its inputs to fp32 whatever their dtype (so a float64 model
    runs it in fp32): the same source with its casts made float64, for a reference that is float64 throughout."""
    import inspect
    import sys

    raw = inspect.unwrap(kernel)
    source = "\n".join(line for line in inspect.getsource(raw).splitlines() if not line.startswith("@"))
    assert source.count("torch.float32") == 1, source  # the one cast of q, k, v, beta and g
    scope = dict(vars(sys.modules[raw.__module__]))
    exec(source.replace("torch.float32", "torch.float64"), scope)  # noqa: S102 - transformers' own code
    return scope[raw.__name__]


def kernel_precision(model_type: str, seq_len: int) -> dict:
    """The gradients of hfcp (fp32, this pool's CP, zigzag) and of the unpatched fp32 model, each against the model in
    float64 with its gated delta kernel in float64 too (grad_error); also the unpatched fp32 model with the kernel's
    chunks as long as hfcp's runs ("one_device_run_chunks"), and the float64 model with the kernel as transformers
    runs it (fp32 inside: hfcp verify's float64 reference)."""
    import copy
    import functools
    import inspect
    import sys

    from hfcp.commands.verify import _grads
    from hfcp.commands.verify_inputs import make_batch
    from hfcp.testing.tiny import tiny_model

    built = tiny_model(model_type).eval()
    family, name = sys.modules[type(built).__module__], "torch_chunk_gated_delta_rule"
    batch = make_batch(built, seq_len, None)

    def reference(dtype, kernel=None):
        model = copy.deepcopy(built).to(dtype)
        if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
            model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
        original = getattr(family, name)
        setattr(family, name, kernel or original)
        try:
            model(**batch, use_cache=False).loss.backward()
        finally:
            setattr(family, name, original)
        return _grads(model)

    truth = reference(torch.float64, _float64_kernel(getattr(family, name)))
    run = seq_len // (2 * dist.get_world_size())  # tokens per run: the kernel's chunk for hfcp (at most 64)
    chunks = functools.partial(inspect.unwrap(getattr(family, name)), chunk_size=run)
    errors = {"one_device": grad_error(reference(torch.float32), truth),
              "one_device_run_chunks": grad_error(reference(torch.float32, chunks), truth),
              "verify_reference": grad_error(reference(torch.float64), truth)}
    model = built
    hfcp.patch(model, strategy="ring", timeout=60)
    model(**batch).loss.backward()
    errors["hfcp"] = grad_error(averaged_grads(model), truth)
    hfcp.unpatch(model)
    return errors
