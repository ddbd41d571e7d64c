"""Real pretrained model (SmolLM2-135M, Llama architecture) patched vs unpatched, with LoRA."""
from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from peft import LoraConfig, get_peft_model

import hfcp


def smollm2_equivalence(path: str, strategy: str, seq_len: int, options: dict | None = None):
    """options: more of hfcp.patch's; with any, LoRA on the MLP's projections too and the patched model's layers
    checkpointed (non-reentrant)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = " ".join(f"Paragraph {i}: the river passes the stone mill and turns north." for i in range(200))
    ids = torch.tensor([tok(text)["input_ids"][:seq_len]])

    def build():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        torch.manual_seed(0)
        targets = ["q_proj", "v_proj"] + (["gate_proj", "up_proj", "down_proj"] if options else [])
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
        return model

    ref = build()
    ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    model = build()
    if options:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = hfcp.patch(model, strategy=strategy, **(options or {}))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    worst = 0.0
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= dist.get_world_size()
            worst = max(worst, float((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max()))
    return {"loss": float(loss), "ref_loss": float(ref_loss), "grad": worst, "n": len(ref_grads)}
