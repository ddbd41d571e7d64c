"""tiled_mlp's norms (hfcp/memory/norm_recompute.py), in one process on a tiny Llama with the MLPs tiled and the norms
recomputed by hand as hfcp.patch does: the loss and every gradient (the norms' weights included) equal the model's
own; each norm is recomputed by its readers (q, k and v in tiles in backward, the MLP in its tiles) and its output
never kept; a reader whose forward drew random numbers (LoRA's dropout) is recomputed in one tile; a norm output
changed in place after the norm is not folded."""
import pytest
import torch

from hfcp.memory.norm_recompute import recompute_norms, norms_of, source
from hfcp.memory.tiled_mlp import tile_mlps
from workers_model import make_batch, tiny_model

L, TILE = 32, 8


def _pair(lora_dropout: float | None, targets=("q_proj",)):
    models = []
    for _ in range(2):
        m = tiny_model("llama", num_hidden_layers=2)
        if lora_dropout is not None:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(1)
            m = get_peft_model(m, LoraConfig(r=4, lora_dropout=lora_dropout, target_modules=list(targets)))
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
        models.append(m.train())
    ref, model = models
    layers = model.base_model.model.model.layers if lora_dropout is not None else model.model.layers
    mlps = [layer.mlp for layer in layers]
    tile_mlps(mlps, TILE)
    recompute_norms(list(layers), mlps, 32, TILE)
    return ref, model, layers


def _step(model, batch, seed=5):
    torch.manual_seed(seed)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora_dropout, q_tiles", [(None, L // TILE), (0.3, 1)])
def test_folded_norms_equal_the_model_and_are_recomputed_by_their_readers(lora_dropout, q_tiles):
    ref, model, layers = _pair(lora_dropout)
    batch = make_batch(dict(B=2, L=L))
    want, ref_grads = _step(ref, batch)
    calls, saved, outputs = [0, 0], [0], []
    phase = ["forward"]
    norm_hooks = [layer.input_layernorm.register_forward_hook(
        lambda m, a, out: calls.__setitem__(0, calls[0] + (phase[0] == "backward"))) for layer in layers]
    norm_hooks += [layer.post_attention_layernorm.register_forward_hook(
        lambda m, a, out: calls.__setitem__(1, calls[1] + (phase[0] == "backward"))) for layer in layers]
    keep = [n.register_forward_hook(lambda m, a, out: outputs.append(out)) for layer in layers for n in norms_of(layer)]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        saved[0] += any(o.untyped_storage().data_ptr() == ptr for o in outputs)
        return t

    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch, use_cache=False).loss
    phase[0] = "backward"
    loss.backward()
    for h in norm_hooks + keep:
        h.remove()
    got = loss.item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert abs(got - want) <= 1e-6 * abs(want)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    if lora_dropout is None:
        assert any("norm" in n for n in grads)  # (every weight trained: the norms' gradients compared too)
    for n, g in grads.items():
        assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-6), n
    assert saved[0] == 0  # no norm output kept for backward
    # in backward, per layer: q (q_tiles), k and v (L / TILE each) recompute the input norm; the MLP's tiles the other
    # (with LoRA on q only, layer 0's k and v take no gradient: nothing before them trains)
    first = q_tiles + (2 * L // TILE if lora_dropout is None else 0)
    assert calls == [first + q_tiles + 2 * L // TILE, len(layers) * L // TILE], calls


@pytest.mark.parametrize("lora_dropout, tiles", [(0.0, L // TILE), (0.3, 1)])
def test_an_adapter_on_a_linear_that_reads_no_norm_runs_in_tiles(lora_dropout, tiles):
    """o_proj with LoRA reads attention's output, no norm: its adapter's whole-width temporaries exist for a tile at
    a time, forward and backward, where the adapter draws no random numbers; with LoRA's dropout in one tile, drawing
    the masks the model draws (the gradients equal the model's either way)."""
    ref, model, layers = _pair(lora_dropout, targets=("q_proj", "o_proj"))
    batch = make_batch(dict(B=2, L=L))
    want, ref_grads = _step(ref, batch)
    rows = []
    hooks = [layer.self_attn.o_proj.lora_B["default"].register_forward_hook(
        lambda m, a, out: rows.append(a[0].shape[-2])) for layer in layers]
    got, grads = _step(model, batch)
    for h in hooks:
        h.remove()
    assert abs(got - want) <= 1e-6 * abs(want)
    assert grads.keys() == ref_grads.keys() and any("o_proj" in n for n in grads)
    for n, g in grads.items():
        assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-6), n
    # rows of each call of an o_proj's adapter: its tiles in forward and again in backward; under dropout one fine
    # tile tried (it drew: undone), then the whole rows in forward and in backward
    per_layer = [TILE] * (2 * L // TILE) if tiles > 1 else [TILE, L, L]
    assert sorted(rows) == sorted(per_layer * len(layers)), rows


def test_a_norm_output_changed_in_place_is_not_folded():
    _, model, layers = _pair(None)
    norm = layers[0].input_layernorm
    x = torch.randn(1, L, 32)
    y = norm(x)
    assert source([norm], (y,), {})[1] is x
    y.mul_(2)  # (changed after the norm: its readers must see what they are given)
    assert source([norm], (y,), {}) is None
    with torch.no_grad():
        assert source([norm], (norm(x),), {}) is None  # nothing noted without autograd's record
