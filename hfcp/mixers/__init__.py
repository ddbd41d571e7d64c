"""Sequence mixers other than attention made exact: binding a record's forwards (binding), recurrent state folds
across ranks (state_fold) and the short-convolution halo (conv_halo). Record authors use the names below."""
from .binding import bind, check_source, check_step_tokens, local_key_valid, source_fingerprint, unbind

__all__ = ["bind", "unbind", "check_source", "check_step_tokens", "local_key_valid", "source_fingerprint"]
