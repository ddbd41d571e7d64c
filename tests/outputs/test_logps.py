"""hfcp.sequence_logps: per-row sums of target log-probabilities without whole logits, under CP and without it,
equal to the plain computation from whole logits on one process (values, per-token values, every gradient)."""
import pytest
import torch

import workers_logps as W
import hfcp
from hfcp.loss.linear_ce import IGNORE_INDEX, LogitTransform
from hfcp.loss.target_logps import target_logps


def _exact(r):
    assert r["counts"] and r["mask"], r
    assert r["sums"] < 1e-5 and r["tokens"] < 1e-5 and r["alone_sums"] < 1e-5, r
    assert r["n_grads"][0] == r["n_grads"][1] > 0, r
    assert r["grad"] < 1e-4 and r["alone_grad"] < 1e-4, r


@pytest.mark.parametrize("case", [
    dict(strategy="ring", L=29),
    dict(strategy="allgather", L=30, padded="left", temperature=0.7),
    dict(strategy="ulysses", L=27, packed=True, frozen_head=True),
    dict(strategy="usp", L=26, padded="right", checkpointing=True),
    dict(strategy="ring", L=28, lora=True, padded="left"),
    dict(strategy="ring", L=25, family="gemma2", temperature=1.3),
    dict(strategy="allgather", L=25, family="cohere", packed=True),
], ids=["ring", "allgather-left-temperature", "ulysses-packed-frozen-head", "usp-right-checkpointing",
        "ring-lora-head", "gemma2-softcap", "cohere-logit-scale"])
def test_cp2_equals_one_process(pool2, case):
    results = pool2.run(W.compare, {**case, "cp": 2})
    for r in results:
        _exact(r)
    assert results[0]["sums_value"] == results[1]["sums_value"], "the sums must be identical on every rank"


def test_cp4_zigzag_equals_one_process(pool4):
    results = pool4.run(W.compare, dict(strategy="ring", cp=4, L=37, padded="left", temperature=0.5))
    for r in results:
        _exact(r)
    assert len({tuple(r["sums_value"]) for r in results}) == 1
    assert results[0]["local_len"] == 40 // 4  # padded to 8 chunks of 5: every rank holds 10 tokens


def test_dp2_x_cp2_each_group_its_own_batch(pool4):
    """The sums are reduced over the CP group, not the world: two CP groups with different batches each equal
    one process on their own batch."""
    results = pool4.run(W.compare, dict(strategy="allgather", cp=2, L=23, padded="right"))
    for r in results:
        _exact(r)
    assert results[0]["sums_value"] == results[1]["sums_value"] != results[2]["sums_value"] == results[3]["sums_value"]


def test_logits_never_whole(pool2):
    """At chunk 4, no (rows x vocab) tensor of more than 4 rows exists in forward or backward; each rank's whole
    logits would be 2 x 32 rows (and 2 x 64 in one process)."""
    rows = pool2.run(W.largest_logits, dict(strategy="ring", cp=2, L=64, chunk=4))
    assert all(r == {"alone": 4, "patched": 4} for r in rows), rows


def test_refusals_on_every_rank(pool2):
    results = pool2.run(W.refusals, dict(strategy="ring", cp=2, L=20))
    for r in results:
        assert "temperature=0.0 must be a positive number" in r["temperature"], r
        assert "logits_to_keep" in r["labels kwarg"], r
        assert "values other than 0 and 1" in r["weights"], r
        assert "input_ids has shape (20,); hfcp needs (batch, seq)" in r["1-d input_ids"], r
        assert "(0, 20): a batch of no rows" in r["no rows"] and "a batch of no rows" in r["no rows logps"], r
        assert "(2, 0): no tokens" in r["no tokens"], r
        assert "different batches (logps labels)" in r["different labels"], r
        assert r["after"] == [16, 16], r  # no rank left behind in a collective
        assert "find_unused_parameters=False" in r["ddp find_unused=True"], r
        assert r["ddp find_unused=False"] == "", r
        assert "an output of an earlier forward" in r["stale gather"], r
        assert "needs a causal LM" in r["base model"] and "LlamaModel" in r["base model"], r
        assert "cannot read what the forward of ShiftedLlama" in r["unread transform"], r


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(0.25), LogitTransform(1 / 3, True, 3.0)],
                         ids=["identity", "scale", "softcap"])
def test_linear_head_backward_recomputes_exactly(transform):
    """The hand-written backward (nn.Linear with a bias, trained) against autograd through whole logits, with a
    per-token upstream gradient, chunks that cut rows and a chunk without any target."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(26, 16, requires_grad=True)
    targets = torch.randint(0, 50, (26,))
    targets[:7] = IGNORE_INDEX
    upstream = torch.randn(26)
    want = torch.log_softmax(transform(head(hidden)), -1).gather(1, targets.clamp_min(0)[:, None])[:, 0]
    want = torch.where(targets != IGNORE_INDEX, want, 0.0)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, head.weight, head.bias))
    got = target_logps(hidden, targets, head, 6, transform)
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, head.weight, head.bias))
    assert float((got - want).detach().abs().max()) < 1e-5
    for g, w in zip(grads, want_grads):
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())
    with torch.no_grad():
        assert torch.equal(target_logps(hidden, targets, head, 6, transform), got.detach())


def test_one_process_without_patch_needs_no_process_group():
    case = dict(L=15, padded="right", temperature=0.9)
    batch, labels, mask = W.inputs(case)
    model = W.build(case)
    sums, counts, tokens = W.plain(model, batch, labels, mask, 0.9)
    got = hfcp.sequence_logps(model, labels=labels, mask=mask, temperature=0.9, **batch)
    assert torch.allclose(got.sums, sums, rtol=1e-5) and got.counts.tolist() == counts.tolist()
    assert torch.allclose(got.token_logps, tokens, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got.means, sums / counts, rtol=1e-5) and got.output.logits is None
    default = hfcp.sequence_logps(model, **batch)  # labels default to input_ids, padding never a target
    every = torch.ones_like(labels, dtype=torch.bool)
    sums, counts, _ = W.plain(model, batch, batch["input_ids"], every, 1.0)
    assert torch.allclose(default.sums, sums, rtol=1e-5) and default.counts.tolist() == counts.tolist()
    assert counts.tolist() == batch["attention_mask"][:, 1:].sum(1).tolist()
    embeds = model.get_input_embeddings()(batch["input_ids"])
    other = {k: v for k, v in batch.items() if k != "input_ids"}
    from_embeds = hfcp.sequence_logps(model, labels=labels, mask=mask, temperature=0.9, inputs_embeds=embeds, **other)
    assert torch.allclose(from_embeds.sums, got.sums, rtol=1e-6)
    with pytest.raises(ValueError, match="needs labels= when the model gets inputs_embeds"):
        hfcp.sequence_logps(model, inputs_embeds=embeds, **other)


def test_vision_language_model_is_refused():
    from hfcp.testing.tiny_vlm import tiny_vlm

    model = tiny_vlm("llava")
    with pytest.raises(ValueError, match="does not support vision-language models yet; LlavaForConditionalGeneration"):
        hfcp.sequence_logps(model, input_ids=torch.randint(0, 64, (1, 16)))
