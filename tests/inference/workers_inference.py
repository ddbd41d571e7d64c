"""Workers for inference calls on a patched model (issue 20): the logits of the last positions only."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hfcp
from hfcp.testing.compare import grad_error
from workers_model import averaged_grads, tiny_model


def _model(kind: str):
    """A tiny model of tests/families/workers_model.py (llama, mistral: a window of 7, qwen2: a window of 6 on a
    layer) with
    4096 positions, or hfcp.testing.tiny's of a type (gemma2: attention and final-logit softcapping, sliding and full
    layers; gpt_oss: attention sinks, sliding layers, MoE)."""
    if kind in ("gemma2", "gpt_oss", "mixtral"):  # mixtral: MoE with the router aux loss on (output_router_logits)
        from hfcp.testing.tiny import tiny_model as tiny_of_type

        model = tiny_of_type(kind).float()
        model.config.output_router_logits = kind == "mixtral"
        model.config.use_cache = model.generation_config.use_cache = True  # hfcp.testing.tiny turns it off for training
        return model
    if kind == "llama_dynamic":  # dynamic NTK RoPE: the frequencies change once positions pass 64
        return tiny_model("llama", max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                                "rope_theta": 10000.0})
    return tiny_model(kind, max_position_embeddings=4096)


def last_logits(kind: str, keep: int, length: int = 37) -> dict:
    """logits_to_keep=keep on the patched model (cp = world, left padding in row 0) against the unpatched model's
    last `keep` logits: the values on this rank, and the gradients of their sum (averaged over the ranks)."""
    ref, model = _model(kind), _model(kind)
    model.load_state_dict(ref.state_dict())
    vocab = ref.config.vocab_size
    ids = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    want = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -keep:]
    want.sum().backward()
    hfcp.patch(model, process_group=dist.group.WORLD)
    try:
        out = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep)
        out.logits.sum().backward()
        whole = hfcp.gather_sequence(out.logits, model) is out.logits  # already whole (also when keep = local_len)
    finally:
        hfcp.unpatch(model)
    grads = averaged_grads(model)
    return {"shape": tuple(out.logits.shape), "want_shape": tuple(want.shape),
            "err": float((out.logits - want).abs().max() / want.abs().max()),
            "grad_err": grad_error(grads, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}),
            "stamped": getattr(out.logits, "hfcp_step", None) is not None, "whole": whole}


def refusal(call: str) -> str:
    """hfcp's message for a logits_to_keep call it refuses."""
    import transformers

    class HeadByHand(transformers.LlamaForCausalLM):  # applies its head's weight itself, not its head module
        def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            return transformers.modeling_outputs.CausalLMOutputWithPast(
                logits=torch.nn.functional.linear(hidden[:, -logits_to_keep:], self.lm_head.weight))

    base = tiny_model("llama")
    model = {"base_model": tiny_model("llama", base=True),
             "head_by_hand": HeadByHand(base.config)}.get(call, base)
    hfcp.patch(model, process_group=dist.group.WORLD)
    ids = torch.randint(3, 60, (1, 16), generator=torch.Generator().manual_seed(0))
    calls = {"with_labels": lambda: model(input_ids=ids, labels=ids, logits_to_keep=1),
             "negative": lambda: model(input_ids=ids, logits_to_keep=-1)}
    try:
        calls.get(call, lambda: model(input_ids=ids, logits_to_keep=2))()
        return "ran"
    except (ValueError, RuntimeError) as e:
        return str(e)
    finally:
        hfcp.unpatch(model)


def _prompts(vocab: int, length: int, pad: int) -> dict:
    """Two prompts, row 0 left-padded by `pad` tokens."""
    ids = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids[0, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest value, over the finite entries (sampling's processors put -inf);
    inf where the two differ in which entries are finite."""
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    return float((got[finite] - want[finite]).abs().max() / want[finite].abs().max())


def generated(kind: str, length: int = 300, new: int = 8, pad: int = 5, sample: bool = False,
              stop_early: bool = False, strategy: str = "ring") -> dict:
    """model.generate on the patched model (cp = world) against the unpatched model in this process: the tokens,
    the worst logit error over the steps, and the KV bytes this rank holds against the unpatched cache's.
    stop_early: with an eos token, the one row 1 generates at step 2; strategy: the prefill's."""
    ref, model = _model(kind), _model(kind)
    model.load_state_dict(ref.state_dict())
    ref.eval(), model.eval()
    ref.config.output_router_logits = False  # (unpatched, transformers' own generate fails with it on: its aux loss
    # pairs a decode step's router logits with the whole mask)
    prompts = _prompts(ref.config.vocab_size, length, pad)
    settings = dict(max_new_tokens=new, do_sample=sample, return_dict_in_generate=True, output_scores=True,
                    pad_token_id=0)
    with torch.no_grad():
        if stop_early:
            first = ref.generate(**prompts, max_new_tokens=3, do_sample=False, pad_token_id=0)
            settings = {**settings, "eos_token_id": int(first[1, length + 2])}
        torch.manual_seed(3)
        want = ref.generate(**prompts, **settings)
        hfcp.patch(model, timeout=60, strategy=strategy)  # hfcp's own group and a timeout: a rank left waiting fails
        try:
            torch.manual_seed(3)
            got = model.generate(**prompts, **settings)
        finally:
            hfcp.unpatch(model)
    err = max(_relative(g, w) for g, w in zip(got.scores, want.scores))
    return {"same_tokens": torch.equal(got.sequences, want.sequences), "logit_err": err,
            "new_tokens": got.sequences.shape[1] - length, "cache": type(got.cache).__name__,
            "kv_bytes": got.cache.bytes_held() if hasattr(got.cache, "bytes_held") else None,
            "ref_kv_bytes": sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in want.cache.layers)}


def generate_refusal(case: str) -> str:
    """hfcp's message for a generation call it refuses (the same on every rank, no rank left waiting)."""
    model = _model("llama")
    prompts = _prompts(model.config.vocab_size, 40, 3)
    if case == "differing_prompts":
        prompts["input_ids"][1, 7] += dist.get_rank()
    if case == "prompt_lookup":  # assisted decoding takes one row
        prompts = {k: v[1:] for k, v in prompts.items()}
    if case == "packed_prompt":  # documents packed into a row (position_ids restart, no mask): its prefill kept them
        # apart, its decode steps attended across them (transformers with a cache attends across them throughout)
        prompts = {"input_ids": prompts["input_ids"][1:],
                   "position_ids": torch.cat([torch.arange(25), torch.arange(15)])[None]}
    options = {"beam_search": dict(num_beams=2), "static_cache": dict(cache_implementation="static"),
               "prompt_lookup": dict(prompt_lookup_num_tokens=2), "differing_prompts": {},
               "max_time": dict(max_time=5.0), "unshared_seed": dict(do_sample=True), "packed_prompt": {}}[case]
    if case == "unshared_seed":  # each rank its own seed: the sampled tokens differ (refused, not a hang)
        torch.manual_seed(100 + dist.get_rank())
    hfcp.patch(model, timeout=30)  # hfcp's own group, with a timeout: a rank left waiting would fail the test
    try:
        with torch.no_grad():
            model.generate(**prompts, max_new_tokens=4, pad_token_id=0, **{"do_sample": False, **options})
        return "ran"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)


def manual_steps(kind: str = "llama", length: int = 45) -> dict:
    """A forward with use_cache=True (the prompt: its logits a local sequence, whole through hfcp.gather_sequence),
    then two decode forwards with the cache it returned, against the unpatched model's."""
    ref, model = _model(kind), _model(kind)
    model.load_state_dict(ref.state_dict())
    prompts = _prompts(ref.config.vocab_size, length, 4)
    nxt = torch.tensor([[5], [9]])
    mask = torch.cat([prompts["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)
    with torch.no_grad():
        first = ref(**prompts, use_cache=True)
        want = [first.logits, ref(input_ids=nxt, attention_mask=mask, cache=first.cache).logits]
        hfcp.patch(model, process_group=dist.group.WORLD)
        try:
            out = model(**prompts, use_cache=True)
            got = [hfcp.gather_sequence(out.logits, model),
                   model(input_ids=nxt, attention_mask=mask, cache=out.cache).logits]
            mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            got.append(model(input_ids=nxt + 1, attention_mask=mask2, cache=out.cache).logits)
            want.append(ref(input_ids=nxt + 1, attention_mask=mask2, cache=first.cache).logits)
            columns = out.cache.get_seq_length()
        finally:
            hfcp.unpatch(model)
    return {"errs": [_relative(g, w) for g, w in zip(got, want)], "columns": columns}


def refused_generation(kind: str) -> str:
    """hfcp's message for generate() on a patched model it does not generate with (a vision-language model, a
    recurrent hybrid)."""
    if kind == "qwen2_vl":
        from hfcp.testing.tiny_vlm import tiny_vlm

        model = tiny_vlm(kind)
    else:
        from hfcp.testing.tiny import tiny_model as tiny_of_type

        model = tiny_of_type(kind)
    model.config.get_text_config().use_cache = model.generation_config.use_cache = True
    hfcp.patch(model, timeout=30)
    try:
        with torch.no_grad():
            model.generate(input_ids=torch.randint(3, 60, (1, 24)), max_new_tokens=2, do_sample=False, pad_token_id=0)
        return "ran"
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)


def continued(kind: str = "llama") -> dict:
    """A generation continued from the cache of an earlier one (new tokens appended to its sequences), against the
    unpatched model doing the same."""
    ref, model = _model(kind), _model(kind)
    model.load_state_dict(ref.state_dict())
    prompts = {"input_ids": _prompts(ref.config.vocab_size, 40, 0)["input_ids"]}
    more = torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]])
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        first = ref.generate(**prompts, **settings)
        want = ref.generate(input_ids=torch.cat([first.sequences, more], 1), cache=first.cache, **settings)
        hfcp.patch(model, timeout=60)
        try:
            out = model.generate(**prompts, **settings)
            got = model.generate(input_ids=torch.cat([out.sequences, more], 1), cache=out.cache, **settings)
        finally:
            hfcp.unpatch(model)
    return {"same_tokens": torch.equal(got.sequences, want.sequences),
            "logit_err": max(_relative(g, w) for g, w in zip(got.scores, want.scores)),
            "columns": got.cache.get_seq_length(), "ref_columns": want.cache.get_seq_length()}
