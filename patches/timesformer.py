from hfcp.families.registry import Patcher, register_patcher

register_patcher(Patcher(
    model_type="timesformer", attention_classes=(),
    unsupported_reason="TimeSformer's divided space-time attention attends within frames and within patch "
    "positions separately (reshaped sequences), which a sequence split cannot express exactly yet",
))
