"""The dry runs and plans of test_plan.py that take seconds each, made in processes of their own
(hfcp.testing.dist_pool.map_in_processes: two at a time, on the two cores) before its tests read them."""
from __future__ import annotations

import transformers

SMALL = dict(model_type="llama", hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=4,
             vocab_size=2048, max_position_embeddings=1 << 20)


def small(layers: int = 2, **fields):
    return transformers.AutoConfig.for_model(**{**SMALL, "num_hidden_layers": layers, **fields})


def world_64() -> dict:
    """cp 64, 3 layers, 4,096 tokens a rank, LoRA, checkpointing and tiled_mlp: the dry run and the plan (fitted
    from traces on a ring of 4)."""
    import hfcp
    from hfcp.planning import dry_run

    config, seq_len = small(3), 64 * 4096
    options = dict(lora_rank=8, lora_targets=["q_proj", "v_proj"], tiled_mlp=True, dtype="bf16")
    t = dry_run(config, seq_len, 64, layers=None, **options)
    p = hfcp.plan(config, seq_len=seq_len, cp_size=64, device={"base": "cpu", "name": "cpu"}, **options)
    return dict(peak=t.peak, sent=t.sent, sends=t.collectives["send"], seconds=t.seconds, step_bytes=p.step_bytes,
                planned_sent=p.comm_bytes_per_step)


def extrapolated() -> dict:
    """A plan at 8 layers and 4x the traced tokens, and the dry run of that very step."""
    import hfcp
    from hfcp.planning import dry_run

    config = small(8, num_key_value_heads=2)
    t = dry_run(config, 2 * 16384, 2, layers=None, lora_rank=8, lora_targets=["q_proj"], dtype="fp32")
    p = hfcp.plan(config, seq_len=2 * 16384, cp_size=2, lora_rank=8, lora_targets=["q_proj"], device="cpu")
    return dict(peak=t.peak, step_bytes=p.step_bytes)


def searched() -> dict:
    """The layouts of 4 GPUs, and the search of 2 (tiles of 1,024 tokens), ranked."""
    from hfcp.planning import layouts, search

    config = small(2, num_key_value_heads=2, hidden_size=1024, intermediate_size=2048)
    plans = search(config, 2, lora_rank=8, device={"base": "cpu", "memory_gib": 8})
    return dict(layouts=[(x["cp_size"], x["strategy"], x.get("ulysses_size")) for x in layouts(config, 4)],
                plans=[(p.max_seq_len, p.layout["strategy"], p.layout["tiled_mlp"], p.layout["offload_checkpoints"])
                       for p in plans])


def pipelined() -> dict:
    """Plans of pipeline stages (4 layers, pp 2 x cp 2): three microbatches under 1F1B and GPipe at 16,384 tokens,
    the dry run of the 1F1B plan's worst stage at that size, and a short sequence of wider layers on the CPU."""
    import hfcp
    from hfcp.planning.trace import Setup, trace

    config, n = small(4, hidden_size=512, intermediate_size=1024, vocab_size=8192), 16384
    piped = {schedule: hfcp.plan(config, seq_len=n, cp_size=2, pp_size=2, n_microbatches=3, batch_size=3,
                                 schedule=schedule) for schedule in ("1F1B", "GPipe")}
    traced = trace(config, Setup(2, batch=3, pp=2, microbatches=3, stage=piped["1F1B"].stage), 2, n // 2)
    wide = small(4, hidden_size=1024, intermediate_size=4096, vocab_size=8192)
    return dict(piped=piped, traced_peak=traced.peak,
                short=hfcp.plan(wide, seq_len=1024, cp_size=2, pp_size=2, device="cpu"))


def make(name: str):
    """What this module's function `name` makes."""
    return globals()[name]()
