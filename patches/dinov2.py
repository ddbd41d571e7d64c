# Tokens are sharded after Dinov2Embeddings (CLS + patches, position embeddings always interpolated).
# Dinov2Model's pooler_output is `sequence_output[:, 0]` in forward code, so hfcp replaces it with the global
# CLS; Dinov2ForImageClassification reads CLS and the patch-token mean from the gathered sequence.
from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(
    model_type="dinov2", attention_classes=("Dinov2Attention",), causal=False,
    num_kv_heads_attr="num_attention_heads",
    embeddings_classes=("Dinov2Embeddings",), pooler_output_is_first_token=True,
))
