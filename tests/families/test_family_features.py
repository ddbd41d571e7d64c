"""Family features hfcp implements beyond plain attention, patched vs unpatched on tiny models (every gradient):
the MoE router aux loss from whole-sequence statistics, the model's logit scale / softcap inside the chunked loss,
chunked attention (Llama 4). The family sweep covers them on every family; these add padding, packing and cp 4."""
import pytest
import torch

import workers_families as W
from hfcp.loss.router import RouterAux, check_form

AUX = {"output_router_logits": True, "router_aux_loss_coef": 1.0}


def _exact(r, tol=1e-5):
    assert r["loss"] < tol and r["grad"] < 1e-4, r


@pytest.mark.parametrize("model_type,strategy,padding,packed", [
    ("mixtral", "ring", True, False), ("qwen2_moe", "allgather", False, True), ("olmoe", "ulysses", True, False)])
def test_moe_router_aux_loss_is_the_whole_sequence_one(pool2, model_type, strategy, padding, packed):
    r = pool2.run(W.compare, model_type, AUX, strategy, padding, packed)[0]
    _exact(r)
    assert r["aux"] < 1e-5 and r["aux_value"] > 1.0, r  # weighted 1.0: a local aux loss would change the total
    assert r["router_logits_local"], "router logits are a sequence output: they stay local"
    assert r["router_logits_gathered"] < 1e-5, r  # and HfcpTrainer's predictions gather them whole


def test_moe_router_aux_loss_cp4(pool4):
    r = pool4.run(W.compare, "mixtral", AUX, "ring", True)[0]
    _exact(r)
    assert r["aux"] < 1e-5, r


def test_aux_loss_of_another_form_is_refused():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    aux = RouterAux(num_experts=4, top_k=2, coef=0.01)
    assert check_form(load_balancing_loss_func, aux)
    assert not check_form(lambda logits, e, k, mask: load_balancing_loss_func(logits, e, k, None), aux)  # unmasked
    assert not check_form(lambda *a: 2 * load_balancing_loss_func(*a), aux)


@pytest.mark.parametrize("model_type,config,transform", [
    ("gemma2", {}, (1 / 3, True, 3.0)), ("cohere", {}, (0.0625, False, 1.0)),
    ("granite", {"logits_scaling": 4.0}, (0.25, False, 1.0))])
def test_logit_scale_and_softcap_in_the_chunked_loss(pool2, model_type, config, transform):
    r = pool2.run(W.compare, model_type, config, "ring", True)[0]
    _exact(r)
    assert r["chunked"], "the loss must come from the chunked path, not the logits fallback"
    t = r["transform"]
    assert (t.scale, t.tanh, t.out_scale) == pytest.approx(transform), t


@pytest.mark.parametrize("strategy,padding,packed,chunk", [
    ("ring", False, False, 8), ("ring", False, True, 8), ("allgather", True, False, 5), ("ulysses", True, True, 4)])
def test_chunked_attention(pool2, strategy, padding, packed, chunk):
    _exact(pool2.run(W.compare, "llama4_text", {"attention_chunk_size": chunk}, strategy, padding, packed)[0])


def test_chunked_attention_cp4(pool4):
    _exact(pool4.run(W.compare, "llama4_text", {"attention_chunk_size": 6}, "ring", True, False)[0])


class _Shifted:  # forwards that change logits in ways hfcp does not read (one line each, after the head)
    def add(self, hidden):
        logits = self.lm_head(hidden)
        logits = logits + 1.0
        return logits

    def masked(self, hidden):  # as Chameleon masks image tokens
        logits = self.lm_head(hidden)
        logits[:, :, 0] = -1e9
        return logits

    def in_place(self, hidden):
        logits = self.lm_head(hidden)
        logits.mul_(2.0)
        return logits

    def out_arg(self, hidden):
        logits = self.lm_head(hidden)
        torch.tanh(logits, out=logits)
        return logits


@pytest.mark.parametrize("form", ["add", "masked", "in_place", "out_arg"])
def test_unreadable_logit_postprocessing_falls_back_to_the_logits(form):
    """A forward that changes logits in a way hfcp does not read gets no transform (None): patch then computes the
    loss from the model's own logits, never skipping the change."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfcp.families.forward_reading import logit_transform

    cls = type(f"Llama_{form}", (LlamaForCausalLM,), {"forward": getattr(_Shifted, form)})
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    assert logit_transform(cls(cfg)) is None
    assert logit_transform(LlamaForCausalLM(cfg)).scale == 1.0


def test_llama4_temperature_tuning_beyond_floor_scale_is_refused(pool2):
    """Llama 4's NoPE layers scale queries by a temperature of torch.arange over the tokens they see (a rank's
    shard under CP): exact below floor_scale, refused from there on (patches/llama4.py)."""
    for msg in pool2.run(W.refused, "llama4_text", {"floor_scale": 16, "attn_temperature_tuning": True}):
        assert "exceed the 15 hfcp runs exactly" in msg and "attn_temperature_tuning" in msg, msg


def test_router_logits_with_tuple_outputs_are_refused(pool2):
    for msg in pool2.run(W.refused, "mixtral", {**AUX, "return_dict": False}):
        assert "return_dict=False (argument or config)" in msg, msg


def test_bidirectional_sliding_window_is_refused(pool2):
    for msg in pool2.run(W.bidirectional_window):
        assert "attends bidirectionally with a sliding window of" in msg, msg
