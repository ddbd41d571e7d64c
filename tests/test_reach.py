"""hfcp.patch(tiled_mlp=..., offload_checkpoints=...) (issue 44). tiled_mlp: each decoder layer's MLP run over
tiles of the rank's tokens in training, each tile recomputed in backward; offload_checkpoints: each checkpointed
layer's input held in host memory. At cp 2 the loss and every gradient equal the unpatched model's in one process,
for a Llama (LoRA, gradient checkpointing), a hybrid's MLPs beside its short convolutions, a VLM's language
model and two mixtures of experts (the experts tiled, the router and its aux loss whole); MLPs hfcp cannot show compute each token alone, and offloading without checkpoints, are refused by name."""
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
        for calls, tiles in zip(r["calls"], r["tiles"]):  # each tile in forward and again in backward (and in the
            assert calls == 2 * tiles if not checkpointing else calls >= 2 * tiles, r  # layer's recompute)
        assert r["eval_calls"] == [1] * len(r["calls"]), r  # no tiles without gradients
        assert not r["left_after_unpatch"], r  # hfcp.unpatch gives the MLPs their own forwards back


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
    ("mixtral_capacity", 8, False, "(its CapacityExperts's output for two tokens changes with the other two)"),
    ("llama", False, "yes", "offload_checkpoints='yes' must be True or False"),
    ("zero3", 2, False, "tiled_mlp: LlamaMLP's weights are gathered by DeepSpeed ZeRO-3 per sub-layer (up_proj.weight)"),
    ("llama", False, True, "offload_checkpoints=True: LlamaForCausalLM's decoder layers are not checkpointed"),
])
def test_reach_options_refused_by_name(pool2, kind, tile, offload, message):
    for msg in pool2.run(W.refused, kind, tile, offload):
        assert msg and message in msg, msg
