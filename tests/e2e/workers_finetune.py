"""Workers that run scripts/finetune_lora.py's main() in a pool of gloo workers (its process group already started:
accelerate takes it), instead of a process start of its own under accelerate launch."""
from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = str(Path(__file__).resolve().parents[2] / "scripts")


def finetune_main(argv: list) -> None:
    """finetune_lora.main(argv) on this rank, on a fresh accelerate state (a previous task's Trainer may have set
    another one)."""
    from workers_trainer import _reset_accelerate

    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    import finetune_lora

    _reset_accelerate()
    finetune_lora.main(argv)
