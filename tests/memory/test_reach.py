"""hfcp.patch(tiled_mlp=..., offload_checkpoints=...) (issue 44). tiled_mlp: each decoder layer's MLP run over
tiles of the rank's tokens in training, each tile recomputed in backward; offload_checkpoints: each checkpointed
layer's input held in host memory. At cp 2 the loss and every gradient equal the unpatched model's in one process,
for a Llama (LoRA, gradient checkpointing), a hybrid's MLPs beside its short convolutions, a VLM's language
model and two mixtures of experts (the experts tiled, the router and its aux loss whole); MLPs hfcp cannot show compute
each token alone, and offloading without checkpoints, are refused by name."""
import pytest

import workers_reach as W


@pytest.mark.parametrize("kind, tile, lora, checkpointing", [
    ("llama", 8, False, False),
    ("llama", 12, True, True),   # LoRA on the MLP, checkpointed layers, a last tile shorter than the others
    ("qwen3", 8, True, False),
    ("lfm2", 4, False, False),   # hybrid
    ("llava", 8, False, False),  # VLM: the language model's MLPs
    ("mixtral", 16, False, False),  # MoE: the experts tiled, the router (and its aux loss) whole
    ("qwen2_moe", 16, True, True),  # and the shared expert, LoRA on it
    ("deepseek_v3", 16, False, False),  # shared experts, group-limited routing
    ("gpt_oss", 16, False, False),  # experts with biases and a clamped SwiGLU, (router_indices, routing_weights)
])
def test_tiled_mlp_exact_at_cp2(pool2, kind, tile, lora, checkpointing):
    for r in pool2.run(W.tiled_step, kind, tile, lora, checkpointing):
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["grads"] > 0 and not r["missing"], r
        assert r["calls"], r
        assert max(r["tiles"]) > 1, r
        for calls, tiles in zip(r["calls"], r["tiles"]):  # each tile in forward and again in backward; under
            # checkpointing a Llama's MLP ends its layer, so the layer's recompute stops before computing it (the
            # call's arguments saved first): twice still. Where something after the MLP saves a tensor (qwen2_moe's
            # shared-expert gate), the recompute computes it too.
            assert calls == 2 * tiles if not checkpointing or kind == "llama" else calls >= 2 * tiles, r
        assert r["eval_calls"] == [1] * len(r["calls"]), r  # no tiles without gradients
        assert not r["left_after_unpatch"], r  # hfcp.unpatch gives the MLPs their own forwards back
        if kind in ("llama", "qwen3", "lfm2", "llava") and not checkpointing:  # every norm output read by a linear
            assert r["norm_saves"] == 0, r  # layer or the MLP: recomputed from the norm's input, never kept


@pytest.mark.parametrize("kind, tile, lora, checkpointing", [
    ("llama", 0, True, True),
    ("llama", 8, False, "reentrant"),  # with tiles; reentrant checkpoints save their inputs themselves
    ("lfm2", 0, False, True),
    ("llava", 0, False, True),
])
def test_offload_checkpoints_exact_at_cp2(pool2, kind, tile, lora, checkpointing):
    for r in pool2.run(W.tiled_step, kind, tile, lora, checkpointing, True):
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["grads"] > 0 and not r["missing"], r
        # every checkpointed layer's input (the residual stream) went to the host, with a few tensors beside
        assert r["offloaded_bytes"] >= 2 * r["hidden_bytes"], r
        assert not r["left_after_unpatch"], r


@pytest.mark.parametrize("kind, tile, offload, message", [
    ("llama", 0, False, "tiled_mlp=0: pass False, True (tiles of hidden_size tokens) or a positive int"),
    ("llama", "big", False, "tiled_mlp='big': pass False, True"),
    ("llama4_text", 8, False, "tiled_mlp: decoder layer 0's Llama4TextMoe is not a block hfcp can show computes "
                              "each token alone (its Llama4TextExperts takes (hidden_states), not (hidden_states, "
                              "top_k_index, top_k_weights))"),
    ("mixtral_capacity", 8, False, "(its CapacityExperts's output for some tokens changes with the others)"),
    ("mixtral_bound", 8, False, "(its CapacityExperts's output for some tokens changes with the others)"),
    ("llama", False, "yes", "offload_checkpoints='yes' must be True or False"),
    ("zero3", 2, False,
     "tiled_mlp: LlamaMLP's weights are gathered by DeepSpeed ZeRO-3 per sub-layer (up_proj.weight)"),
    ("llama", False, True, "offload_checkpoints=True: LlamaForCausalLM's decoder layers are not checkpointed"),
])
def test_reach_options_refused_by_name(pool2, kind, tile, offload, message):
    for msg in pool2.run(W.refused, kind, tile, offload):
        assert msg and message in msg, msg


def test_tiles_are_recomputed_under_the_forwards_autocast():
    """A tile's recompute in backward runs under the autocast its forward ran under (bf16 matmuls both times), as
    torch's checkpoint does: without it, the gradient would be taken through fp32 arithmetic the forward never did."""
    import torch
    import transformers

    from hfcp.memory.tiled_mlp import tiled_forward

    mlp = transformers.models.llama.modeling_llama.LlamaMLP(transformers.LlamaConfig(hidden_size=32,
                                                                                     intermediate_size=64))
    seen = []

    def forward(x):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return mlp.forward(x)

    x = torch.randn(1, 12, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tiled_forward(mlp, forward, 4)(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad is not None
    assert seen == [(False, True, torch.bfloat16)] * 3 + [(True, True, torch.bfloat16)] * 3, seen


def test_tiles_that_draw_nothing_share_one_random_state():
    """A call's tiles keep the random state each starts from until its backward (under checkpointing, every layer's
    call of the step at once): one object where nothing is drawn (5 KB, not 5 KB a tile), one a tile under LoRA's
    dropout."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from hfcp.memory.tiled_mlp import tiled_forward

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64)
    for dropout, distinct in ((0.0, 1), (0.5, 3)):
        holder = torch.nn.Module()
        holder.mlp = transformers.models.llama.modeling_llama.LlamaMLP(config)
        mlp = get_peft_model(holder, LoraConfig(r=4, lora_dropout=dropout, target_modules=["up_proj"])).base_model \
            .model.mlp
        y = tiled_forward(mlp, mlp.forward, 4)(torch.randn(1, 12, 32, requires_grad=True))
        assert len(y.grad_fn.call.rng) == 3 and len({id(state) for state in y.grad_fn.call.rng}) == distinct, dropout


def test_an_mlp_that_draws_random_numbers_is_refused():
    """Dropout in an MLP's forward (functional, not a child module): tiles would draw other numbers than the whole."""
    from torch import nn

    from hfcp.memory.tiled_mlp import check_per_token

    class DropoutMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down(nn.functional.dropout(self.up(x), p=0.1, training=self.training))

    assert check_per_token(DropoutMLP()) == "its forward uses 'dropout'"


@pytest.mark.parametrize("reentrant", [False, True])
def test_lora_dropout_draws_the_same_masks_in_a_tiles_recompute(reentrant):
    """LoRA's dropout in a tiled MLP: backward recomputes each tile from the random state its forward started from,
    so the gradient is that of the function the forward computed (the MLP run tile by tile, as here by hand). Under
    reentrant checkpointing the first pass runs without autograd's record: tile by tile all the same, so that the
    recompute draws its masks."""
    import torch
    from torch.utils.checkpoint import checkpoint
    import transformers
    from peft import LoraConfig, get_peft_model

    from hfcp.memory.tiled_mlp import tiled_forward

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.mlp = transformers.models.llama.modeling_llama.LlamaMLP(config)
    mlp = get_peft_model(holder, LoraConfig(r=4, lora_dropout=0.5, init_lora_weights=False,
                                            target_modules=["gate_proj", "up_proj", "down_proj"])).base_model.model.mlp
    x = torch.randn(2, 12, 32, requires_grad=True)
    grads = []
    for tiled in (True, False):
        torch.manual_seed(5)
        run = tiled_forward(mlp, mlp.forward, 4) if tiled else \
            (lambda h: torch.cat([mlp(p) for p in h.split(4, dim=1)], dim=1))
        y = checkpoint(run, x, use_reentrant=True) if reentrant else run(x)
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        grads.append([y.detach(), *(t.grad.clone() for t in (x, *(p for p in mlp.parameters() if p.requires_grad)))])
        for t in (x, *mlp.parameters()):
            t.grad = None
    assert len(grads[0]) == 8 and bool(grads[0][2].any())  # the output (what the loss saw), x, six LoRA matrices
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())


def test_a_tile_reading_a_trainable_tensor_outside_the_module_is_refused():
    """A tiled module whose forward reads a tensor that takes a gradient but is not its parameter (here a tensor
    attribute): its gradient would be lost in tiles, so backward raises, naming it."""
    import pytest
    import torch
    from torch import nn

    from hfcp.memory.tiled_mlp import tiled_forward

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
            self.outside = torch.ones(8, requires_grad=True)  # (not registered: not in parameters())

        def forward(self, x):
            return self.down(self.up(x)) * self.outside

    mlp = Scaled()
    y = tiled_forward(mlp, mlp.forward, 4)(torch.randn(1, 12, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"reads a tensor that takes a gradient but is not one of its parameters "
                                           r"or arguments \(shape \(8,\)\)"):
        y.sum().backward()


def test_an_mlp_with_trained_lora_and_dropout_is_tiled():
    """LoRA with dropout on an MLP whose adapters are trained (lora_B not zero) passes the checks: the probe runs in
    eval mode, where dropout draws nothing."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from hfcp.memory.tiled_mlp import check_per_token

    holder = nn.Module()
    holder.mlp = transformers.models.llama.modeling_llama.LlamaMLP(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4))
    mlp = get_peft_model(holder, LoraConfig(r=4, lora_dropout=0.1, init_lora_weights=False,
                                            target_modules=["gate_proj", "up_proj"])).base_model.model.mlp
    mlp.train()
    assert check_per_token(mlp) is None
