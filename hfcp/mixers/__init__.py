"""Sequence mixers other than attention made exact: binding a record's forwards (binding), running a family's code
with some calls replaced (family_code), recurrent scans over the global sequence (scans) and their state folds across
ranks (state_fold), the short-convolution halo (conv_halo). Record authors use the names below (check_source, the one
source guard of records that run a family's code, is hfcp/families/source_guard.py's)."""
from .binding import bind, check_step_tokens, local_key_valid, unbind
from ..families.source_guard import check_source, fingerprints_of, source_fingerprint

__all__ = ["bind", "unbind", "check_source", "check_step_tokens", "fingerprints_of", "local_key_valid",
           "source_fingerprint"]
