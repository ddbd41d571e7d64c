"""hfcp's training step at sizes no machine here can run: the dry run (hfcp.planning.dry_run: the real patched step
on the meta device, one rank of a fake world) of a model's shapes at long lengths and large CP groups, each run
reporting whether it completed, how long it took, the rank's device and host peaks, the bytes it sent and its
collectives; a failure is reported by name.

    python scripts/tools/dry_run.py                         # Llama-3.1-8B shapes: 128K @ cp 8, 1M @ cp 64, 4M @ cp 256
    python scripts/tools/dry_run.py --runs 1048576:64:usp:8 --layers 1

Each run: LoRA r16 on the attention projections, gradient checkpointing, tiled_mlp, bf16; --layers of the model's
layers (a layer's step is every layer's: the layout, the masks and the collectives are per layer).
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

DEFAULT_RUNS = ["131072:8:ring", "1048576:64:ring", "4194304:256:ring", "131072:8:usp:8", "1048576:64:usp:8"]


def one(config: str, spec: str, layers: int) -> dict:
    from hfcp.planning import dry_run

    parts = spec.split(":")
    seq_len, cp, strategy = int(parts[0]), int(parts[1]), parts[2]
    u = int(parts[3]) if len(parts) > 3 else None
    row = dict(config=config, seq_len=seq_len, cp_size=cp, strategy=strategy, ulysses_size=u, layers=layers)
    started = time.perf_counter()
    try:
        t = dry_run(config, seq_len, cp, strategy, u, layers=layers, lora_rank=16,
                    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"], tiled_mlp=True)
    except Exception as e:  # noqa: BLE001 - a failure is the report
        return dict(row, ok=False, seconds=round(time.perf_counter() - started, 1),
                    error=f"{type(e).__name__}: {str(e)[:400]}", where=traceback.format_exc().splitlines()[-3:])
    return dict(row, ok=True, seconds=round(t.seconds, 1), peak_gib=round(t.peak / 2**30, 2),
                host_gib=round(t.host_peak / 2**30, 2), sent_gib=round(t.sent / 2**30, 2),
                collectives=t.collectives)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="Llama-3.1-8B")
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="SEQ_LEN:CP:STRATEGY[:ULYSSES_SIZE]")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    for spec in args.runs:
        print(json.dumps(one(args.config, spec, args.layers)), flush=True)


if __name__ == "__main__":
    main()
