"""Losses over the whole sequence from local tokens, functions of tensors: the token-mean cross entropy
(cross_entropy), its chunked form that never materialises the logits (linear_ce), per-token target log-probabilities
chunk by chunk (target_logps) and the MoE router auxiliary loss (router). Per-sequence log-probabilities of a model
(sequence_logps) are hfcp/outputs/logps.py's."""
