# Tokens are sharded after ViTEmbeddings (patch embedding + CLS + position, interpolated or not).
from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(
    model_type="vit", attention_classes=("ViTAttention",), causal=False,
    num_kv_heads_attr="num_attention_heads",
    embeddings_classes=("ViTEmbeddings",), first_token_pooler=True,
))
