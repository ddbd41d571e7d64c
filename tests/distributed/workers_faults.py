"""Workers for fault tests: each runs in its own short-lived pool (a timed-out group is not reused)."""
from __future__ import annotations

import time

import hfcp
from workers_model import make_batch, tiny_model


def one_rank_skips_forward(timeout_s: float):
    """Rank 1 never calls forward: rank 0 must raise within about the timeout instead of hanging."""
    import torch.distributed as dist

    model = tiny_model("llama")
    hfcp.patch(model, strategy="ring", timeout=timeout_s)
    if dist.get_rank() == 1:
        time.sleep(timeout_s * 20)  # stay alive but silent (the test waits for rank 0 only, then kills the pool)
        return {"skipped": True}
    t = time.perf_counter()
    try:
        model(**make_batch(dict(B=1, L=16))).loss.backward()
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "after_s": time.perf_counter() - t, "message": str(e)[:200]}
    return {"raised": None, "after_s": time.perf_counter() - t}


def one_rank_dies_mid_step(timeout_s: float):
    """Rank 1 exits between the forward and the backward: rank 0 must raise within about the timeout."""
    import os

    import torch.distributed as dist

    model = tiny_model("llama")
    hfcp.patch(model, strategy="ring", timeout=timeout_s)
    loss = model(**make_batch(dict(B=1, L=16))).loss
    if dist.get_rank() == 1:
        os._exit(1)
    t = time.perf_counter()
    try:
        loss.backward()
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "after_s": time.perf_counter() - t, "message": str(e)}
    return {"raised": None, "after_s": time.perf_counter() - t}
