"""Adapters to the training stacks people use. They call the engine; the engine never imports them.

`HfcpTrainer` (transformers.Trainer) is imported here; the TRL trainers only when asked for, since trl is the
optional extra `hfcp[trl]`.
"""
import importlib

from .trainer import HfcpTrainer, HfcpTrainerMixin

# the TRL trainers: {name: the module of this package that defines it}
_TRL_TRAINERS = {"HfcpSFTTrainer": "sft", "HfcpRewardTrainer": "reward", "HfcpDPOTrainer": "dpo",
                 "HfcpGRPOTrainer": "grpo"}

__all__ = ["HfcpTrainer", "HfcpTrainerMixin", *_TRL_TRAINERS]


def __getattr__(name):
    if name in _TRL_TRAINERS:
        return getattr(importlib.import_module(f".{_TRL_TRAINERS[name]}", __name__), name)
    raise AttributeError(f"module 'hfcp.integrations' has no attribute {name!r}")
