# Sliding window: transformers passes `sliding_window` to the attention function, which masks q - k >= W.
from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(model_type="mistral", attention_classes=("MistralAttention",)))
