"""Sequence- and token-classification heads and hfcp.pool_sequence under CP: loss, whole logits / pooled vectors and
every gradient equal one process, table-driven over the supported families that transformers gives these heads;
what hfcp cannot reproduce is refused on every rank."""
import pytest

import workers_heads as W

TOL, GRAD_TOL = 1e-5, 1e-4

# (family, padding of row 0, problem type, num_labels): every family at cp 2, each padding and problem type met
SEQUENCE_CASES = [
    ("llama", "right", "single_label_classification", 3),
    ("llama", "left", "multi_label_classification", 3),
    ("llama", None, "regression", 1),
    ("mistral", "left", "regression", 1),
    ("qwen2", None, "multi_label_classification", 3),
    ("qwen3", "right", "regression", 2),
    ("gemma", "left", "single_label_classification", 3),
    ("gemma2", "right", "multi_label_classification", 4),
    ("phi3", None, "single_label_classification", 2),
    ("olmo2", "left", "multi_label_classification", 3),
    ("starcoder2", "right", "regression", 1),
    ("glm", None, "regression", 3),
    ("mixtral", "right", "single_label_classification", 3),
    # forwards of their own that pool as the generic one, accepted by their fingerprint (patches/sequence_heads.py)
    ("gpt2", "right", "single_label_classification", 3),
    ("gpt_neox", "left", "regression", 1),
    ("opt", None, "multi_label_classification", 3),
    ("gpt_bigcode", "left", "single_label_classification", 2),
]
TOKEN_CASES = [("llama", "right"), ("llama", "left"), ("mistral", None), ("qwen2", "right"), ("qwen3", "left"),
               ("gemma", None), ("phi3", "right"), ("starcoder2", "left")]


def _check(results):
    r = results[0]
    assert r["loss"] < TOL and r["whole"] < TOL and r["grad"] < GRAD_TOL and r["n_grads"] > 0, r
    assert len({x["loss_value"] for x in results}) == 1, "loss differs between ranks"
    assert all(x["whole_value"] == r["whole_value"] for x in results), "logits / pooled vectors differ between ranks"
    return r


@pytest.mark.parametrize("family,padding,problem,num_labels", SEQUENCE_CASES)
def test_sequence_classification_cp2(pool2, family, padding, problem, num_labels):
    # (float labels with num_labels > 1 are read as multi-label unless the config says regression, as in transformers)
    config = dict(problem_type=problem) if problem == "regression" and num_labels > 1 else {}
    case = dict(family=family, padding=padding, problem=problem, num_labels=num_labels, config=config)
    r = _check(pool2.run(W.run_case, case))
    assert r["shape"] == (2, num_labels) and r["logits_whole_flag"] and r["problem_type"] == problem, r


SEQUENCE_VARIANTS = {
    "no_labels": dict(problem=None, padding="right"),  # a reward model's scores, any objective built on them
    "ulysses": dict(strategy="ulysses", padding="left", problem="single_label_classification"),
    "allgather": dict(strategy="allgather", padding="right", problem="regression", num_labels=1),
    "inputs_embeds": dict(embeds=True, problem="single_label_classification"),  # transformers: the last token
    "no_pad_token_batch_1": dict(B=1, config=dict(pad_token_id=None), problem="regression", num_labels=1),
    "eval_mode": dict(train=False, padding="right", problem="multi_label_classification"),
    "lora_seq_cls": dict(lora=True, padding="right", problem="single_label_classification"),  # score in modules_to_save
    "ddp": dict(ddp=True, padding="right", problem="single_label_classification"),
    "lora_patched_first": dict(lora=True, patch_first=True, padding="left", problem="regression", num_labels=1),
    "loss_chunk_int": dict(loss_chunk=8, padding="left", problem="single_label_classification"),
    "per_call_loss_chunk": dict(call=dict(hfcp_loss_chunk=8), problem="regression", num_labels=1),
    "local_len_equals_num_labels": dict(L=16, num_labels=8, problem="single_label_classification"),
}


@pytest.mark.parametrize("variant", list(SEQUENCE_VARIANTS))
def test_sequence_classification_variants(pool2, variant):
    _check(pool2.run(W.run_case, dict(family="llama", **SEQUENCE_VARIANTS[variant])))


def test_sequence_classification_cp4(pool4):
    case = dict(family="llama", padding="right", problem="single_label_classification", B=3, L=38,
                config=dict(num_key_value_heads=4), strategy="allgather")
    _check(pool4.run(W.run_case, case))


@pytest.mark.parametrize("family,padding", TOKEN_CASES)
def test_token_classification_cp2(pool2, family, padding):
    r = _check(pool2.run(W.run_case, dict(family=family, head="token", padding=padding, problem="token")))
    assert r["shape"] == (2, 29, 3), r


@pytest.mark.parametrize("variant", [dict(problem=None), dict(loss_chunk=8, problem="token"),
                                     dict(train=False, problem="token", call=dict(hfcp_loss_chunk=8)),
                                     dict(strategy="ulysses", problem="token", padding="left")])
def test_token_classification_variants(pool2, variant):
    _check(pool2.run(W.run_case, dict(family="llama", head="token", **variant)))


def test_token_classification_cp4(pool4):
    case = dict(family="qwen3", head="token", padding="left", problem="token", L=38, config=dict(num_key_value_heads=4))
    _check(pool4.run(W.run_case, case))


@pytest.mark.parametrize("how", ["mean", "last"])
@pytest.mark.parametrize("padding", ["right", "left", None])
def test_pool_sequence_of_a_base_model(pool2, how, padding):
    r = _check(pool2.run(W.run_case, dict(family="llama", head="base", how=how, padding=padding, pass_mask=True)))
    assert r["shape"] == (2, 32), r


def test_pool_sequence_cp4(pool4):
    case = dict(family="mistral", head="base", how="mean", padding="left", pass_mask=True, L=38,
                config=dict(num_key_value_heads=4))
    _check(pool4.run(W.run_case, case))


REFUSALS = {
    "own_pooling_forward": (dict(family="llama", custom="first_token"),
                            "UnsupportedModelError: FirstTokenLlamaForSequenceClassification.forward is not "
                            "transformers' GenericForSequenceClassification.forward"),
    "transformers_own_forward": (dict(family="biogpt", custom="BioGptForSequenceClassification"),
                                 "UnsupportedModelError: BioGptForSequenceClassification.forward is not transformers' "
                                 "GenericForSequenceClassification.forward"),
    "subclass_of_a_registered_one": (dict(family="gpt2", custom="gpt2_subclass"),
                                     "UnsupportedModelError: MyGPT2ForSequenceClassification.forward is not "
                                     "transformers' GenericForSequenceClassification.forward"),
    "kv_cache": (dict(family="llama", call=dict(use_cache=True)),
                 "ValueError: a KV cache (use_cache=True, a cache, generate()) on a patched "
                 "LlamaForSequenceClassification"),
    "no_pad_token_batch_2": (dict(family="llama", config=dict(pad_token_id=None)),
                             "ValueError: LlamaForSequenceClassification: cannot handle batch sizes > 1 if no padding "
                             "token is defined"),
    "logits_to_keep": (dict(family="llama", call=dict(logits_to_keep=1)),
                       "ValueError: logits_to_keep=1 on a LlamaForSequenceClassification"),
    "token_label_out_of_range": (dict(family="llama", head="token", num_labels=3,
                                      call=dict(labels=__import__("torch").full((2, 29), 3))),
                                 "ValueError: labels[0, 0] = 3 is outside"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals(pool2, name):
    case, message = REFUSALS[name]
    results = pool2.run(W.refused, case)
    assert results[0].startswith(message), results[0]
    assert results[1] == results[0], results  # the same error on every rank, none left waiting


def test_registered_forward_with_other_source_is_refused(pool2):
    results = pool2.run(W.changed_source, dict(padding="right"))
    assert results[0].startswith("UnsupportedModelError: GPT2ForSequenceClassification: hfcp: "
                                 "GPT2ForSequenceClassification.forward is not the code hfcp verified"), results[0]
    assert results[1] == results[0]


def test_base_model_patched_alone_inside_a_sequence_classifier_is_refused(pool2):
    results = pool2.run(W.base_patched_alone, dict(family="llama", padding="right"))
    assert results[0].startswith("ValueError: LlamaForSequenceClassification picks each row's score at its last "
                                 "non-pad token, but only its LlamaModel is hfcp-patched"), results[0]
    assert results[1] == results[0]


def test_pool_sequence_unpatched_and_bad_arguments():
    import torch

    import hfcp

    model = W.tiny_model("llama", "base")
    batch = W.make_batch(dict(padding="right"))
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"]
    mean = hfcp.pool_sequence(hidden, model, mask)
    assert torch.allclose(mean[0], hidden[0, mask[0].bool()].mean(0), atol=1e-6)
    assert torch.equal(hfcp.pool_sequence(hidden, model, mask, how="last")[0], hidden[0, 28 - 29 // 3])
    with pytest.raises(ValueError, match="how='max' is not one of"):
        hfcp.pool_sequence(hidden, model, how="max")


def test_classification_head_of_a_vision_language_model_is_refused():
    import transformers

    import hfcp
    from hfcp.testing.tiny_vlm import tiny_vlm

    config = tiny_vlm("gemma3").config
    config.num_labels = 2
    model = transformers.Gemma3ForSequenceClassification(config)
    with pytest.raises(hfcp.UnsupportedModelError, match=r"Gemma3ForSequenceClassification \(model_type='gemma3'\): "
                                                         "hfcp runs classification heads of language models, not of "
                                                         "vision-language models"):
        hfcp.patch(model)  # (raised before any collective: here, with one process)
