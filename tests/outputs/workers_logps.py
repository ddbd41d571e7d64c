"""hfcp.sequence_logps on every rank of a DistPool: patched (CP) and unpatched against the plain computation from
whole logits on one process (values, per-token values and every gradient of a nonlinear objective)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

import hfcp
from workers_loss import LargestLogits
from workers_model import _grads, _rel, make_batch

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
FAMILIES = {  # as a user's (or a checkpoint's) config would give them
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",  # (its attention softcap: eager, not sdpa)
               {"final_logit_softcapping": 1.5, "sliding_window": 8, "attn_implementation": "eager"}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
}
BETA = 0.7  # of the DPO-like objective


def build(case: dict):
    cfg_name, cls_name, extra = FAMILIES[case.get("family", "llama")]
    cfg = getattr(transformers, cfg_name)(vocab_size=case.get("vocab", 64),
                                          **{**SIZES, "attn_implementation": "sdpa", **extra})
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).float()
    if case.get("frozen_head"):
        model.get_output_embeddings().requires_grad_(False)
    if case.get("lora"):  # lm_head too: a head that is not a plain nn.Linear takes the checkpointed path
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"]))
        for n, p in model.named_parameters():  # non-zero B so that every LoRA grad is exercised
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(n)))
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def inputs(case: dict):
    """(model inputs, labels, mask): make_batch's rows; the mask drops a few targets (a completion mask)."""
    batch = make_batch({**case, "B": 2})
    labels = batch.pop("labels")
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[1, -4:] = False
    return batch, labels, mask


def plain(model, batch, labels, mask, temperature):
    """One process from whole logits, as TRL computes it: (sums, counts, token logps (B, L) with 0 where no target)."""
    logits = model(**batch, use_cache=False).logits / temperature
    target = labels[:, 1:]
    counted = (target != -100) & mask[:, 1:]
    if "attention_mask" in batch:
        counted &= batch["attention_mask"][:, 1:].bool()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, target.clamp_min(0)[..., None])[..., 0]
    tokens = F.pad(torch.where(counted, lp, 0.0), (0, 1))  # (B, L): position i scores target i + 1
    return tokens.sum(1), counted.sum(1), tokens


def objective(sums, tokens):
    """DPO-like over the two rows, plus a nonlinear term of the per-token values."""
    return -F.logsigmoid(BETA * (sums[0] - sums[1])) + 0.1 * tokens.exp().sum()


def compare(case: dict) -> dict:
    """Errors of the patched model (case["cp"], case["strategy"]) and of the unpatched one against plain()."""
    T, chunk = case.get("temperature", 1.0), case.get("chunk", 5)
    dp_rank = torch.distributed.get_rank() // case["cp"]  # each CP group its own batch (dp x cp)
    batch, labels, mask = inputs({**case, "seed": 1 + dp_rank})
    ref = build(case)
    want_sums, want_counts, want_tokens = plain(ref, batch, labels, mask, T)
    objective(want_sums, want_tokens).backward()
    want_grads = _grads(ref)
    ref.zero_grad()
    alone = hfcp.sequence_logps(ref, labels=labels, mask=mask, temperature=T, chunk=chunk, **batch)  # not patched
    objective(alone.sums, alone.token_logps).backward()
    model = build(case)
    hfcp.patch(model, cp_size=case["cp"], strategy=case["strategy"])
    got = hfcp.sequence_logps(model, labels=labels, mask=mask, temperature=T, chunk=chunk, **batch)
    tokens = hfcp.gather_sequence(got.token_logps, model)
    objective(got.sums, tokens).backward()
    hfcp.average_gradients(model)
    grads = _grads(model)
    result = {
        "sums": _rel(got.sums.detach(), want_sums.detach()), "tokens": _rel(tokens.detach(), want_tokens.detach()),
        "counts": got.counts.tolist() == want_counts.tolist(), "n_grads": (len(grads), len(want_grads)),
        "grad": max(_rel(grads[n], want_grads[n]) for n in want_grads) if grads.keys() == want_grads.keys() else 1.0,
        "alone_sums": _rel(alone.sums.detach(), want_sums.detach()),
        "alone_grad": max(_rel(_grads(ref)[n], want_grads[n]) for n in want_grads),
        "mask": torch.equal(hfcp.gather_sequence(got.token_mask.long(), model).bool(), want_tokens != 0),
        "sums_value": got.sums.tolist(), "local_len": got.token_logps.shape[1],
    }
    hfcp.unpatch(model)
    return result


def largest_logits(case: dict) -> dict:
    """The most rows of any (rows x vocab) tensor made in a forward + backward, patched and not: vocab 97, which no
    other dimension of the tiny model has."""
    case = {**case, "vocab": 97}
    batch, labels, mask = inputs(case)
    rows = {}
    for name in ("alone", "patched"):
        model = build(case)
        if name == "patched":
            hfcp.patch(model, cp_size=case["cp"], strategy=case["strategy"])
        with LargestLogits(97) as spy:
            got = hfcp.sequence_logps(model, labels=labels, mask=mask, chunk=case["chunk"], **batch)
            objective(got.sums, got.token_logps).backward()
        rows[name] = spy.rows
        hfcp.unpatch(model)
    return rows


def refusals(case: dict) -> dict:
    """{what: the ValueError's message} on this rank (every rank must raise, none hang)."""
    batch, labels, mask = inputs(case)
    out = {}

    def message(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return ""

    model = build(case)
    hfcp.patch(model, cp_size=case["cp"], strategy=case["strategy"])
    out["temperature"] = message(lambda: hfcp.sequence_logps(model, labels=labels, temperature=0.0, **batch))
    out["labels kwarg"] = message(lambda: hfcp.sequence_logps(model, **batch, logits_to_keep=1))
    out["weights"] = message(lambda: hfcp.sequence_logps(model, labels=labels, mask=mask * 0.5, **batch))
    out["1-d input_ids"] = message(lambda: hfcp.sequence_logps(model, input_ids=batch["input_ids"][0]))
    out["no rows"] = message(lambda: model(input_ids=batch["input_ids"][:0]))  # (a raw amax() error before)
    out["no rows logps"] = message(lambda: hfcp.sequence_logps(model, input_ids=batch["input_ids"][:0]))
    out["no tokens"] = message(lambda: model(input_ids=batch["input_ids"][:, :0]))  # (an IndexError before)
    other = labels.clone()
    other[0, -1] = (other[0, -1] + torch.distributed.get_rank()) % 64  # rank 1's labels differ
    out["different labels"] = message(lambda: hfcp.sequence_logps(model, labels=other, **batch))
    kept = hfcp.sequence_logps(model, labels=labels, **batch)
    out["after"] = kept.counts.tolist()  # still in step
    for find_unused in (True, False):  # DDP that looks for unused parameters would fail in backward; without, works
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
        out[f"ddp find_unused={find_unused}"] = message(
            lambda: hfcp.sequence_logps(ddp, labels=labels, **batch).sums.sum().backward())
    model(**batch)  # another forward: the kept per-token values' layout is gone
    out["stale gather"] = message(lambda: hfcp.gather_sequence(kept.token_logps, model))
    hfcp.unpatch(model)
    base = transformers.LlamaModel(transformers.LlamaConfig(vocab_size=64, attn_implementation="sdpa", **SIZES))
    hfcp.patch(base, cp_size=case["cp"], strategy=case["strategy"])
    out["base model"] = message(lambda: hfcp.sequence_logps(base, **batch))
    hfcp.unpatch(base)

    class ShiftedLlama(transformers.LlamaForCausalLM):  # a logit transform hfcp does not read
        def forward(self, input_ids=None, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = self.lm_head(hidden)
            logits = logits + 1.0
            return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)

    shifted = ShiftedLlama(transformers.LlamaConfig(vocab_size=64, attn_implementation="sdpa", **SIZES))
    out["unread transform"] = message(lambda: hfcp.sequence_logps(shifted, **batch))
    return out
