"""`hfcp plan CONFIG ...`: hfcp.plan from the command line (a table, or --json), and with --gpus the layouts of that
many GPUs ranked (hfcp.planning.search)."""
from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the memory, longest length and time of a training step per rank, before launching")
    p.add_argument("config", nargs="?", help="a config.json, a model directory or a shipped name (--list)")
    p.add_argument("--list", action="store_true", help="the shipped configs")
    p.add_argument("--seq-len", type=int, help="tokens a row (default: the longest that fits)")
    p.add_argument("--gpus", type=int, help="rank the layouts of this many GPUs instead of planning one")
    p.add_argument("--cp-size", type=int, default=2)
    p.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses", "usp"])
    p.add_argument("--ulysses-size", type=int)
    p.add_argument("--dp-shard", type=int, default=1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1, help="hfcp.pipeline's stages")
    p.add_argument("--n-microbatches", type=int, default=1, help="a pipeline's microbatches (they divide the rows)")
    p.add_argument("--schedule", default="1F1B", choices=["1F1B", "GPipe"], help="a pipeline's schedule")
    p.add_argument("--batch-size", type=int, default=1, help="rows per data-parallel rank")
    p.add_argument("--lora-rank", type=int, help="LoRA of this rank (default: a full fine-tune)")
    p.add_argument("--lora-targets", nargs="+",
                   help="LoRA's target modules (default: PEFT's for the model type; else every linear layer)")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--offload-checkpoints", action="store_true")
    p.add_argument("--param-offload", action="store_true")
    p.add_argument("--optimizer-offload", action="store_true")
    p.add_argument("--sharded", choices=["yes", "no"], help="FSDP2 / ZeRO-3 sharding (default: a full fine-tune is)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="h100-80gb", help="cpu, h100-80gb, h200-141gb, a100-80gb, a100-40gb")
    p.add_argument("--device-spec", help="a JSON file of device fields (memory_gib, tflops, ...; see devices.py)")
    p.add_argument("--json", action="store_true", help="the plan (or the ranked plans) as JSON")
    p.add_argument("--step", default="hfcp", choices=["hfcp", "alst"],
                   help="whose training step: hfcp's, or DeepSpeed ALST's to set beside it (needs deepspeed)")


def run(args, error) -> int:
    from hfcp.planning import plan, search, table
    from hfcp.planning.configs import shipped

    if args.list:
        print("\n".join(shipped()))
        return 0
    if args.config is None:
        error("a config is needed: a config.json, a model directory or one of " + ", ".join(shipped()))
    device = args.device
    if args.device_spec:
        with open(args.device_spec) as f:
            device = {"base": args.device, **json.load(f)}
    kwargs = dict(batch_size=args.batch_size, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                  gradient_checkpointing=not args.no_gradient_checkpointing, param_offload=args.param_offload,
                  optimizer_offload=args.optimizer_offload, dtype=args.dtype, device=device,
                  sharded=None if args.sharded is None else args.sharded == "yes")
    try:
        if args.gpus and args.step != "hfcp":
            raise ValueError(f"--gpus ranks hfcp's layouts; --step {args.step} plans one layout (pass --cp-size)")
        if args.gpus:
            plans = search(args.config, args.gpus, seq_len=args.seq_len, n_microbatches=args.n_microbatches,
                           schedule=args.schedule, **kwargs)
            if args.json:
                print(json.dumps([json.loads(p.to_json()) for p in plans]))
                return 0
            if not plans:
                print(f"hfcp plan: no layout of {args.gpus} GPUs fits "
                      + (f"{args.seq_len:,} tokens" if args.seq_len else "(hfcp's layouts need 2 GPUs or more)"))
                return 1
            print(table(plans))
            print(f"\nthe first: what limits the next doubling: {plans[0].limit}")
            return 0
        p = plan(args.config, seq_len=args.seq_len, cp_size=args.cp_size, strategy=args.strategy,
                 ulysses_size=args.ulysses_size, dp_shard=args.dp_shard, dp_replicate=args.dp_replicate,
                 tp_size=args.tp_size, pp_size=args.pp_size, n_microbatches=args.n_microbatches,
                 schedule=args.schedule, tiled_mlp=args.tiled_mlp,
                 offload_checkpoints=args.offload_checkpoints, step=args.step, **kwargs)
    except (ValueError, FileNotFoundError, NotImplementedError, ImportError) as e:
        print(f"hfcp plan: error: {e}", file=sys.stderr)
        return 2
    print(p.to_json() if args.json else p)
    return 0 if p.fits else 1
