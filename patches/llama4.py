"""Llama 4 text: verified exact by the family sweep (attention read from the model, chunked attention), with one
limit: its NoPE layers scale queries by a temperature computed from torch.arange over the tokens the layer sees
(attn_temperature_tuning), which under CP is the index within a rank's shard. The scale is 1 for every token below
floor_scale, so sequences shorter than that are exact and longer ones are refused."""
from hfcp.families.registry import Patcher, register_patcher

from .verified import TRANSFORMERS_VERSION


def _longest(cfg):
    return cfg.floor_scale - 1 if getattr(cfg, "attn_temperature_tuning", False) else None


register_patcher(Patcher(model_type="llama4_text", attention_classes=(), read_from_model=True,
                         verified_with=TRANSFORMERS_VERSION, max_seq_len=_longest,
                         max_seq_len_reason="attn_temperature_tuning scales queries by the index within a rank's "
                                            "shard; set config.attn_temperature_tuning=False or use shorter sequences"))
