"""The chunked causal-LM loss in one process: fused linear cross-entropy and the checkpointed fallback against
F.cross_entropy on full logits (values and every gradient)."""
import pytest
import torch
import torch.nn.functional as F

from hfcp.loss.linear_ce import LogitTransform
from hfcp.loss.cross_entropy import IGNORE_INDEX, chunked_ce_sum


class ScaledHead(torch.nn.Module):
    """Not a plain nn.Linear (as a PEFT-wrapped lm_head is not): takes the checkpointed path."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x) * 1.5


def _case(bias, head_trains, wrap):
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 50, bias=bias)
    linear.requires_grad_(head_trains)
    head = ScaledHead(linear) if wrap else linear
    hidden = torch.randn(2, 13, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 13))
    targets[0, :6] = IGNORE_INDEX
    return head, hidden, targets


def _run(loss_fn, head, hidden, targets):
    hidden.grad = None
    head.zero_grad()
    loss = loss_fn(head, hidden, targets)
    (loss * 0.37).backward()  # a non-unit upstream gradient, as the global mean gives
    grads = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters() if p.requires_grad]
    return loss.detach(), grads


@pytest.mark.parametrize("wrap", [False, True], ids=["fused", "checkpointed"])
@pytest.mark.parametrize("bias,head_trains", [(False, False), (True, True), (False, True)])
def test_chunked_loss_equals_full_logits(bias, head_trains, wrap):
    head, hidden, targets = _case(bias, head_trains, wrap)

    def full(h, x, t):
        return F.cross_entropy(h(x).reshape(-1, 50), t.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")

    ref_loss, ref_grads = _run(full, head, hidden, targets)
    loss, grads = _run(lambda h, x, t: chunked_ce_sum(x, t, h, 5), head, hidden, targets)
    assert abs(float(loss - ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert len(grads) == len(ref_grads) == 1 + head_trains * (1 + bias)
    for g, r in zip(grads, ref_grads):
        assert float((g - r).abs().max()) <= 1e-6 * float(r.abs().max()), (g - r).abs().max()


def test_no_valid_target_gives_zero_loss_and_zero_grads():
    head, hidden, targets = _case(False, True, False)
    loss, grads = _run(lambda h, x, t: chunked_ce_sum(x, t, h, 5), head, hidden, torch.full_like(targets, IGNORE_INDEX))
    assert float(loss) == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads)


def test_label_outside_the_vocabulary_is_refused():
    head, hidden, targets = _case(False, False, False)
    targets[1, 3] = -1
    with pytest.raises(ValueError, match="label -1 is outside the vocabulary"):
        chunked_ce_sum(hidden, targets, head, 5)


def test_no_grad_gives_the_same_loss_and_second_backward_is_refused():
    head, hidden, targets = _case(False, True, False)
    loss = chunked_ce_sum(hidden, targets, head, 5)
    with torch.no_grad():
        assert torch.equal(chunked_ce_sum(hidden, targets, head, 5), loss.detach())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through it only once"):
        loss.backward()


@pytest.mark.parametrize("wrap", [False, True], ids=["fused", "checkpointed"])
@pytest.mark.parametrize("transform", [LogitTransform(0.0625), LogitTransform(0.5), LogitTransform(1 / 3.0, True, 3.0),
                                       LogitTransform(0.7, True, 1.3)], ids=["cohere", "granite", "gemma", "both"])
def test_chunked_loss_applies_the_models_logit_transform(transform, wrap):
    """Scale and softcap after the head (Cohere, Granite, Gemma 2): the same loss and gradients as the model's own
    post-processed logits; the caps bite (logits scaled up so tanh saturates)."""
    head, hidden, targets = _case(True, True, wrap)
    with torch.no_grad():
        hidden.mul_(4.0)
    full = lambda h, x, t: F.cross_entropy(transform(h(x)).reshape(-1, 50), t.reshape(-1),  # noqa: E731
                                           ignore_index=IGNORE_INDEX, reduction="sum")
    ref_loss, ref_grads = _run(full, head, hidden, targets)
    plain_loss, _ = _run(lambda h, x, t: chunked_ce_sum(x, t, h, 5), head, hidden, targets)
    loss, grads = _run(lambda h, x, t: chunked_ce_sum(x, t, h, 5, transform=transform), head, hidden, targets)
    assert abs(float(plain_loss - ref_loss)) > 1e-2 * abs(float(ref_loss)), "the transform does not matter here"
    assert abs(float(loss - ref_loss)) <= 1e-6 * abs(float(ref_loss))
    for g, r in zip(grads, ref_grads):
        assert float((g - r).abs().max()) <= 2e-6 * float(r.abs().max()), (g - r).abs().max()


@pytest.mark.parametrize("wrap", [False, True], ids=["fused", "checkpointed"])
def test_token_stats_of_a_training_chunked_loss(wrap):
    """The (3,) statistics of HfcpSFTTrainer's metrics with a head that trains, under backward: the checkpointed path
    (a PEFT modules_to_save head) once failed in backward, its stats an input of the checkpoint changed in place."""
    from hfcp.loss.linear_ce import add_token_stats

    head, hidden, targets = _case(True, True, wrap)
    want = torch.zeros(3, dtype=torch.float64)
    add_token_stats(head(hidden).detach().reshape(-1, 50), targets.reshape(-1), want)
    stats = torch.zeros(3, dtype=torch.float64)
    loss, grads = _run(lambda h, x, t: chunked_ce_sum(x, t, h, 5, stats), head, hidden, targets)
    ref_loss, ref_grads = _run(lambda h, x, t: chunked_ce_sum(x, t, h, 5), head, hidden, targets)
    assert torch.allclose(stats, want, rtol=1e-6) and stats[0] == (targets != IGNORE_INDEX).sum(), (stats, want)
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
