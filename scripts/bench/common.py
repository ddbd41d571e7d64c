"""What the benchmarks share: the benchmark's Llama (MODEL_SHAPE; REACH_SHAPE with Llama-3-8B's ratios scaled down)
with LoRA. How they measure memory: hfcp.testing.memory (PeakRSS, fix_mmap_threshold)."""
from __future__ import annotations

import torch

MODEL_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2)
REACH_SHAPE = dict(MODEL_SHAPE, intermediate_size=896, num_hidden_layers=8)  # Llama-3-8B's ratios, scaled down


def lora_llama(seq_len: int, device, shape: dict = MODEL_SHAPE):
    """The benchmark's Llama (MODEL_SHAPE, seeded) with LoRA adapters on its attention projections."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, max_position_embeddings=seq_len))
    return get_peft_model(model.to(device), LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
