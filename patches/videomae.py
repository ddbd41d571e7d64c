# VideoMAEForVideoClassification mean-pools (or takes token 0 of) the full gathered sequence.
# VideoMAEForPreTraining (masked encoder + decoder) is neither a base nor a classification head: refused.
from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(
    model_type="videomae", attention_classes=("VideoMAESelfAttention",), causal=False,
    num_kv_heads_attr="num_attention_heads",
    embeddings_classes=("VideoMAEEmbeddings",),
))
