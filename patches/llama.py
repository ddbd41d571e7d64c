from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(model_type="llama", attention_classes=("LlamaAttention",)))
