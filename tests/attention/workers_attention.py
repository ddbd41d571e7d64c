"""Attention-level equivalence, run on every rank of a DistPool: CP strategy vs dense single-device math."""
from __future__ import annotations

import torch

from hfcp.attention import STRATEGIES, MaskSpec
from hfcp.distributed.collectives import all_gather_no_grad
from hfcp.layout import Layout, build_step_batch
from hfcp.distributed.mesh import build_mesh

def mesh_for(cp: int):
    return build_mesh(cp)  # the pool destroys the groups after each task


def group_for(case: dict, mesh):
    """What the strategy communicates over: the CP group, or usp's sub-groups."""
    if case["strategy"] != "usp":
        return mesh.cp_group
    from hfcp.attention import build_usp_groups

    return build_usp_groups(mesh.cp_groups, case.get("ulysses_size", 2))


def make_case(case: dict):
    """Full-sequence inputs, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, H, Hkv, L, D = case["B"], case["H"], case["Hkv"], case["L"], case.get("D", 8)
    q = torch.randn(B, H, L, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    dout = torch.randn(B, H, L, D, generator=g)
    position_ids = attention_mask = None
    if case.get("offset_packed"):  # a first document whose positions start at 1000, then one from 0
        first = L // 3
        position_ids = torch.tensor([list(range(1000, 1000 + first)) + list(range(L - first))] * B)
    elif case.get("packed"):  # documents of random lengths, positions restart at 0
        rows = []
        for _ in range(B):
            pos = []
            while len(pos) < L:
                n = int(torch.randint(1, max(2, L // 2), (1,), generator=g))
                pos += list(range(n))
            rows.append(pos[:L])
        position_ids = torch.tensor(rows)
    if case.get("padded"):  # left padding on row 0, right padding on the others
        attention_mask = torch.ones(B, L, dtype=torch.long)
        attention_mask[0, : L // 3] = 0
        attention_mask[1:, L - L // 4 :] = 0
    return q, k, v, dout, position_ids, attention_mask


def dense_allowed(case, position_ids, attention_mask):
    B, L = case["B"], case["L"]
    qi = torch.arange(L)[:, None]
    ki = torch.arange(L)[None, :]
    allowed = torch.ones(L, L, dtype=torch.bool)
    if case["causal"]:
        allowed &= ki <= qi
    if case.get("window"):
        allowed &= (qi - ki) < case["window"]
    allowed = allowed.expand(B, L, L).clone()
    if position_ids is not None:
        from hfcp.layout import document_ids

        d = document_ids(position_ids)
        allowed &= d[:, :, None] == d[:, None, :]
    if attention_mask is not None:
        allowed &= attention_mask.bool()[:, None, :]
    if case.get("chunk"):  # transformers' chunked mask: packed rows chunk by position id, others by the index
        C = case["chunk"]  # counted from the first valid token
        if position_ids is not None:
            c = position_ids // C
        else:
            left = (attention_mask.cumsum(-1) == 0).sum(-1, keepdim=True) if attention_mask is not None else 0
            c = torch.div(torch.arange(L)[None] - left, C, rounding_mode="floor").expand(B, L)
        allowed &= c[:, :, None] == c[:, None, :]
    return allowed[:, None]  # (B, 1, L, L)


def dense_attention(q, k, v, allowed, scale, sink=None, softcap=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:  # as Gemma 2's eager attention
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1, keepdim=True)
    if sink is not None:  # as GPT-OSS's eager attention: one more logit per head in the softmax, then dropped
        col = sink.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        return torch.softmax(torch.cat([s, col], -1), -1)[..., :-1] @ v  # a row without keys: all mass on the sink
    s = s.masked_fill(empty, 0.0)
    return torch.where(empty, 0.0, torch.softmax(s, -1) @ v)


def run_case(case: dict):
    from hfcp.attention import tiles as tiling

    tiling.MAX_TILE = case.get("max_tile", 1024)
    tiling.KERNEL_TILE = case.get("kernel_tile", 2048)
    mesh = mesh_for(case["cp"])
    q, k, v, dout, position_ids, attention_mask = make_case(case)
    dtype = case.get("dtype", torch.float32)
    scale = q.shape[-1] ** -0.5
    allowed = dense_allowed(case, position_ids, attention_mask)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sink = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(9)) * 2 if case.get("sink") else None
    sink_r = sink.clone().requires_grad_() if sink is not None else None
    ref = dense_attention(qr * case.get("q_gain", 1), kr, vr, allowed, scale, sink_r, case.get("softcap"))
    ref.backward(dout)

    B, L = case["B"], case["L"]
    layout = Layout(L, mesh.cp_size, zigzag=case.get("zigzag", case["causal"]))
    sb = build_step_batch(layout, mesh.cp_rank, B, position_ids, attention_mask, q.device)
    idx = sb.local_index
    P = layout.padded_len

    def shard(t):
        t = torch.cat([t, t.new_zeros(*t.shape[:2], P - L, t.shape[-1])], 2) if P > L else t
        return t[:, :, idx].to(dtype).clone().requires_grad_()

    ql, kl, vl = shard(q), shard(k), shard(v)
    sink_l = sink.clone().requires_grad_() if sink is not None else None
    spec = MaskSpec(case["causal"], case.get("window"), None if case.get("drop_cap") else case.get("softcap"),
                    case.get("chunk"))
    out = STRATEGIES[case["strategy"]](ql * case.get("q_gain", 1), kl, vl, sb, spec, scale, group_for(case, mesh),
                                       sink_l)
    out.backward(shard(dout).detach())

    order = layout.gathered_order()
    inv = torch.empty_like(order)
    inv[order] = torch.arange(P)

    def unshard(t):
        full = all_gather_no_grad(t.detach().float(), mesh.cp_group, dim=2)
        return full[:, :, inv][:, :, :L]

    valid_q = allowed.any(-1)[:, :, :, None]  # rows with at least one key: compare; empty rows must be 0
    got = unshard(out)
    errs = {}
    errs["out"] = _rel(got * valid_q, ref.detach() * valid_q)
    errs["empty_rows_zero"] = float((got * ~valid_q).abs().max())
    for name, loc, full in (("dq", ql, qr), ("dk", kl, kr), ("dv", vl, vr)):
        errs[name] = _rel(unshard(loc.grad), full.grad)
    errs["finite"] = bool(torch.isfinite(got).all())
    if sink is not None:  # each rank's gradient covers its own queries: the sum over the group is the whole
        dsink = sink_l.grad.clone()
        torch.distributed.all_reduce(dsink, group=mesh.cp_group)
        errs["dsink"] = _rel(dsink, sink_r.grad)
    return errs


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def long_sequence(L: int, strategy: str):
    """L tokens (e.g. 32k): the merge stays finite and equals single-process SDPA (flash on CPU)."""
    import torch.nn.functional as F

    mesh = mesh_for(2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, L, 16, generator=g) * 4  # large logits: exercises the fp32 LSE merge
    k = torch.randn(1, 1, L, 16, generator=g) * 4
    v = torch.randn(1, 1, L, 16, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    layout = Layout(L, mesh.cp_size, zigzag=True)
    sb = build_step_batch(layout, mesh.cp_rank, 1, None, None, q.device)
    idx = sb.local_index
    out = STRATEGIES[strategy](q[:, :, idx], k[:, :, idx], v[:, :, idx], sb, MaskSpec(True, None), 0.25, mesh.cp_group)
    full = all_gather_no_grad(out, mesh.cp_group, dim=2)
    inv = torch.empty_like(layout.gathered_order())
    inv[layout.gathered_order()] = torch.arange(L)
    full = full[:, :, inv]
    return {"finite": bool(torch.isfinite(full).all()), "err": _rel(full, ref)}
