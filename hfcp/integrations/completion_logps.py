"""Per-token log-probabilities (and entropies) of the completion tokens of prompt + completion rows under CP, as TRL's
GRPOTrainer reads them: (B, C) on every rank, whole and identical, differentiable; logits never whole.

`hfcp.sequence_logps` computes log p(target) of this rank's tokens chunk by chunk through the output head;
`hfcp.gather_sequence` makes them whole (its backward sums over the CP group and gives each rank its slice, so a loss
of them computed alike on every rank keeps hfcp's gradient convention). The entropies, a metric, are computed
without gradient from the hidden states the head is given, chunk by chunk, at the positions whose target counts.
"""
from __future__ import annotations

import torch

from ..outputs import gather_sequence
from ..families.forward_reading import logit_transform
from ..outputs.logps import sequence_logps
from ..loss.target_logps import with_temperature
from ..state import find_pretrained

_CHUNK = 1024  # tokens per chunk through the output head


@torch.no_grad()
def token_entropy(hidden: torch.Tensor, counted: torch.Tensor, head, transform, chunk: int = _CHUNK) -> torch.Tensor:
    """Entropy of softmax(transform(head(hidden))) per token: hidden (B, n, H), counted (B, n) bool -> (B, n) fp32,
    0 where not counted; no (tokens x vocab) logits beyond `chunk` tokens."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.zeros(counted.numel(), dtype=torch.float32, device=hidden.device)
    where = counted.reshape(-1).nonzero()[:, 0].to(hidden.device)
    for start in range(0, where.numel(), chunk):
        rows = where[start : start + chunk]
        logp = torch.log_softmax(transform(head(flat[rows]).float()), dim=-1)  # (n, V)
        out[rows] = -(logp.exp() * logp).sum(-1)
    return out.view(counted.shape)


def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                     temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p of each completion token (B, C), its entropy (B, C) or None), as TRL's fused LM head returns them for
    `labels[:, :-C] = -100`: the last C tokens of each row are scored, 0 where attention_mask is 0.

    input_ids, attention_mask: (B, L) prompt + completion, the same on every rank of the CP group; model: the
    patched policy or reference (DDP / PEFT-wrapped or not). The logits are divided by `temperature`.
    """
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : labels.shape[1] - completion_len] = -100
    inner = find_pretrained(model)
    head = inner.get_output_embeddings()
    kept = []
    hook = head.register_forward_pre_hook(lambda module, args: kept.append(args[0])) if with_entropy else None
    try:
        out = sequence_logps(model, input_ids=input_ids, labels=labels, attention_mask=attention_mask,
                             temperature=temperature)
    finally:
        if hook is not None:
            hook.remove()
    # (B, L): position i holds log p(labels[:, i + 1]); the completion's targets are at L - 1 - C .. L - 2
    scored = slice(input_ids.shape[1] - 1 - completion_len, input_ids.shape[1] - 1)
    logps = gather_sequence(out.token_logps, model)[:, scored]
    if not with_entropy:
        return logps, None
    transform = with_temperature(logit_transform(inner), float(temperature))
    entropy = token_entropy(kept[0], out.token_mask, head, transform)  # (B, L_local)
    return logps, gather_sequence(entropy, model)[:, scored]
