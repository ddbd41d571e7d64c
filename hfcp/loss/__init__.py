"""Losses over the whole sequence from local tokens: the token-mean cross entropy (cross_entropy), its chunked form
that never materialises the logits (linear_ce), per-sequence target log-probabilities (logps, chunked through
target_logps) and the MoE router auxiliary loss (router)."""
