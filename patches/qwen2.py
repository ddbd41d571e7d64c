# Per-layer sliding window (config.layer_types) arrives as the `sliding_window` argument of each call.
from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(model_type="qwen2", attention_classes=("Qwen2Attention",)))
