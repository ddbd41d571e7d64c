from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(
    model_type="vivit", attention_classes=("VivitAttention",), causal=False,
    num_kv_heads_attr="num_attention_heads",
    embeddings_classes=("VivitEmbeddings",), first_token_pooler=True,
))
