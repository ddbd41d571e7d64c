"""Classification heads and pooling under CP, run on every rank of a DistPool: a patched tiny seeded model against the
same model unpatched on one process (loss, logits, every gradient averaged over the CP group as DDP does)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import transformers

import hfcp

PAD = 0
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1,
             eos_token_id=2, classifier_dropout=0.0)
FAMILY_CONFIGS = {  # model_type -> (config class prefix, what the family needs beyond SIZES)
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {"sliding_window": 7}),
    "qwen2": ("Qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("Qwen3", {}),
    "gemma": ("Gemma", {}),
    "gemma2": ("Gemma2", {"sliding_window": 6, "attn_implementation": "eager"}),  # (transformers: no sdpa for it)
    "phi3": ("Phi3", {}),
    "olmo2": ("Olmo2", {}),
    "starcoder2": ("Starcoder2", {}),
    "glm": ("Glm", {}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # sequence classifiers with a forward of their own, fingerprinted (patches/sequence_heads.py)
    # (training dropout off: hfcp refuses attention dropout, and a rank would draw other noise than one process)
    "gpt2": ("GPT2", {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "gpt_neox": ("GPTNeoX", {}),
    "opt": ("OPT", {"ffn_dim": 64, "word_embed_proj_dim": 32, "dropout": 0.0, "attention_dropout": 0.0}),
    "gpt_bigcode": ("GPTBigCode", {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "biogpt": ("BioGpt", {}),  # (its forward slices by logits_to_keep: not registered, refused)
}
HEADS = {"sequence": "ForSequenceClassification", "token": "ForTokenClassification", "base": "Model"}


def tiny_model(family: str, head: str = "sequence", num_labels: int = 3, seed: int = 0, cls=None, **overrides):
    prefix, extra = FAMILY_CONFIGS[family]
    settings = {**SIZES, **extra, "num_labels": num_labels, **overrides}
    attn = settings.pop("attn_implementation", "sdpa")
    cfg = getattr(transformers, prefix + "Config")(**settings)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return (cls or getattr(transformers, prefix + HEADS[head]))(cfg).float()


def make_batch(case: dict) -> dict:
    """Token ids that are never the pad id, padded as the case says (row 0: right or left; row 1 not padded)."""
    g = torch.Generator().manual_seed(case.get("seed", 1))
    B, L, C = case.get("B", 2), case.get("L", 29), case.get("num_labels", 3)
    ids = torch.randint(3, 64, (B, L), generator=g)
    batch = {"input_ids": ids}
    padding = case.get("padding")
    if padding:
        n = L // 3
        pad = torch.zeros(B, L, dtype=torch.bool)
        pad[0, L - n:] = padding == "right"
        pad[0, :n] = padding == "left"
        ids.masked_fill_(pad, PAD)
        batch["attention_mask"] = (~pad).long()
    problem = case.get("problem")
    if problem == "token":
        labels = torch.randint(0, C, (B, L), generator=g)
        labels[:, : L // 5] = -100
        if padding:
            labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
    elif problem == "regression":
        batch["labels"] = torch.randn(B, generator=g) if C == 1 else torch.randn(B, C, generator=g)
    elif problem == "single_label_classification":
        batch["labels"] = torch.randint(0, C, (B,), generator=g)
    elif problem == "multi_label_classification":
        batch["labels"] = torch.randint(0, 2, (B, C), generator=g).float()
    if case.get("embeds"):
        batch["inputs_embeds"] = torch.randn(B, L, SIZES["hidden_size"], generator=g)
        del batch["input_ids"]
    return batch


def _build(case: dict, patch: dict | None = None):
    """The case's model; `patch`: hfcp.patch's options, applied to the bare model before PEFT wraps it (patch_first)
    or to the model built (otherwise); None: unpatched."""
    model = tiny_model(case["family"], case.get("head", "sequence"), case.get("num_labels", 3),
                       **case.get("config", {}))
    if patch is not None and case.get("patch_first"):
        hfcp.patch(model, **patch)
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                 target_modules=["q_proj", "v_proj"]))
        for n, p in model.named_parameters():  # non-zero B so that every LoRA grad is exercised
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(n)))
    model.train(case.get("train", True))
    if patch is not None and not case.get("patch_first"):
        hfcp.patch(model, **patch)
    return model


def _objective(out, batch: dict, case: dict, model):
    """(the scalar whose gradients are compared, the whole output compared): the loss with labels, else a fixed
    weighted sum of the whole logits (sequence), of the gathered logits (token) or of the pooled states (base)."""
    head = case.get("head", "sequence")
    if head == "base":
        whole = hfcp.pool_sequence(out.last_hidden_state, model, batch.get("attention_mask") if case.get("pass_mask")
                                   else None, how=case.get("how", "mean"))
    else:
        whole = out.logits if head == "sequence" else hfcp.gather_sequence(out.logits, model)
    if "labels" in batch:
        return out.loss, whole
    weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(7))
    return (whole.float() * weights).sum(), whole


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def run_case(case: dict) -> dict:
    """The unpatched model on the whole batch (the one-process reference), then the patched model on the same batch
    on every rank; grads averaged over the CP group. Returns the relative errors and this rank's loss value."""
    batch = make_batch(case)
    ref = _build(case)
    ref_loss, ref_whole = _objective(ref(**batch), batch, case, ref)
    ref_loss.backward()
    ref_grads = _grads(ref)

    model = _build(case, dict(cp_size=case.get("cp", 2), strategy=case.get("strategy", "ring"),
                              loss_chunk=case.get("loss_chunk", "auto")))
    if case.get("ddp"):  # (every parameter takes part on every rank: the score head's rows of other ranks are zeros)
        model = torch.nn.parallel.DistributedDataParallel(model)
    out = model(**batch, **case.get("call", {}))
    loss, whole = _objective(out, batch, case, model)
    loss.backward()
    grads = {n.removeprefix("module."): g for n, g in _grads(model).items()}
    assert grads.keys() == ref_grads.keys(), (sorted(grads), sorted(ref_grads))
    worst = 0.0
    group_size = dist.get_world_size()
    # a gradient that is 0 in exact arithmetic (a key bias: softmax ignores a shift of every key's score) holds float
    # noise in both computations: each gradient relative to its own max, with a floor at 1e-3 of the largest
    floor = 1e-3 * max(float(g.abs().max()) for g in ref_grads.values())
    for name, g in grads.items():
        if not case.get("ddp"):
            dist.all_reduce(g)  # what DDP does: the mean over the group
            g /= group_size
        scale = max(float(ref_grads[name].abs().max()), floor)
        worst = max(worst, float((g - ref_grads[name]).abs().max()) / scale)
    rel = abs(float(loss.detach()) - float(ref_loss.detach())) / max(abs(float(ref_loss.detach())), 1e-12)
    hfcp.unpatch(model)
    return {"loss": rel, "whole": _rel(whole.detach(), ref_whole.detach()), "grad": worst, "n_grads": len(grads),
            "loss_value": float(loss.detach()), "whole_value": whole.detach().tolist(), "shape": tuple(whole.shape),
            "logits_whole_flag": bool(getattr(out.logits, "hfcp_whole", False)) if hasattr(out, "logits") else None,
            "problem_type": getattr(_inner(model).config, "problem_type", None)}


def _inner(model):
    from hfcp.state import find_pretrained

    return find_pretrained(model)


def refused(case: dict) -> str:
    """The error (type and message) patching or calling the case's model raises on this rank; '' when none."""
    model = tiny_model(case["family"], case.get("head", "sequence"), cls=_custom_class(case.get("custom")),
                       **case.get("config", {}))
    try:
        hfcp.patch(model, cp_size=2, loss_chunk=case.get("loss_chunk", "auto"))
        batch = make_batch(case)
        model(**batch, **case.get("call", {}))
    except Exception as e:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(e).__name__}: {e}"
    finally:
        hfcp.unpatch(model)
    return ""


def _custom_class(name: str | None):
    if name is None:
        return None
    if name == "first_token":
        class FirstTokenLlamaForSequenceClassification(transformers.LlamaForSequenceClassification):
            """A reward model of one's own that scores the first token."""

            def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
                hidden = self.model(input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
                return transformers.modeling_outputs.SequenceClassifierOutput(logits=self.score(hidden[:, 0]))

        return FirstTokenLlamaForSequenceClassification
    if name == "gpt2_subclass":
        class MyGPT2ForSequenceClassification(transformers.GPT2ForSequenceClassification):
            """A subclass: its forward is GPT-2's, but the class is not the one registered."""

        return MyGPT2ForSequenceClassification
    return getattr(transformers, name)


def changed_source(case: dict) -> str:
    """A registered sequence classifier whose forward is not the code fingerprinted (another transformers version)."""
    from hfcp.families.heads import SEQUENCE_HEADS

    name = "GPT2ForSequenceClassification"
    kept = SEQUENCE_HEADS[name]
    SEQUENCE_HEADS[name] = (kept[0], {f"{name}.forward": "0" * 16}, kept[2])
    try:
        return refused({**case, "family": "gpt2"})
    finally:
        SEQUENCE_HEADS[name] = kept


def base_patched_alone(case: dict) -> str:
    """Only the base model of a sequence classifier patched: the classifier's pooling would run on local ids."""
    model = tiny_model(case["family"], "sequence")
    try:
        hfcp.patch(model.model, cp_size=2)
        model(**make_batch(case))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        hfcp.unpatch(model.model)
    return ""
