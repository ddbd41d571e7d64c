"""Adapters to the training stacks people use. They call the engine; the engine never imports them.

`HfcpTrainer` (transformers.Trainer) is imported here; `HfcpSFTTrainer` (TRL) only when asked for, since trl is
the optional extra `hfcp[trl]`.
"""
from .trainer import HfcpTrainer, HfcpTrainerMixin

__all__ = ["HfcpTrainer", "HfcpTrainerMixin", "HfcpSFTTrainer", "HfcpDPOTrainer"]


def __getattr__(name):
    if name == "HfcpSFTTrainer":
        from .sft import HfcpSFTTrainer

        return HfcpSFTTrainer
    if name == "HfcpDPOTrainer":
        from .dpo import HfcpDPOTrainer

        return HfcpDPOTrainer
    raise AttributeError(f"module 'hfcp.integrations' has no attribute {name!r}")
