# q/k RMSNorm runs per head before attention, on local tokens: nothing for hfcp to change.
from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(model_type="qwen3", attention_classes=("Qwen3Attention",)))
