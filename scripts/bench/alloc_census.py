"""What is alive at a step's memory peak: bench/reach.py --census.

The step runs under torch's profiler with memory events. Its allocation events, in time order, carry the total
allocated after each; the census takes the event with the highest total, pairs the allocations and frees before it by
address, and groups the tensors still alive by the operator that allocated them (the profiler's chain of enclosing
operators, innermost first: "aten::mul < MulBackward0 < ..."). Tensors allocated before the step (the weights) are
not counted. Sizes are reported in hidden vectors per local token by the caller.
"""
from __future__ import annotations

import collections

import torch

ALLOCATION = torch._C._profiler._EventType.Allocation


def _walk(roots):
    stack = list(roots)
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def _chain(event, depth: int = 4) -> str:
    names, parent = [], event.parent
    while parent is not None and len(names) < depth:
        names.append(parent.name)
        parent = parent.parent
    return " < ".join(names) or "(outside any operator)"


def peak_census(step, min_bytes: int = 1 << 16) -> tuple[int, str, list[tuple[int, int, str]]]:
    """Runs step() under the profiler. Returns (the peak's bytes above the step's start, the operator allocating at
    the peak, [(bytes, tensors, allocating operator)] of what is alive there, largest first; tensors under
    min_bytes together as one row)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in _walk(prof.profiler.kineto_results.experimental_event_tree()) if e.tag == ALLOCATION),
                    key=lambda e: e.start_time_ns)
    if not events:
        raise RuntimeError("the profiler recorded no allocation")
    top = max(range(len(events)), key=lambda i: events[i].extra_fields.total_allocated)
    alive = {}
    for event in events[: top + 1]:
        fields = event.extra_fields
        if fields.alloc_size > 0:
            alive[fields.ptr] = (fields.alloc_size, event)
        else:
            alive.pop(fields.ptr, None)
    sizes, counts = collections.Counter(), collections.Counter()
    for size, event in alive.values():
        key = _chain(event) if size >= min_bytes else f"(tensors under {min_bytes // 1024} KiB)"
        sizes[key] += size
        counts[key] += 1
    rows = [(size, counts[key], key) for key, size in sizes.most_common()]
    return sum(size for size, _ in alive.values()), _chain(events[top]), rows
