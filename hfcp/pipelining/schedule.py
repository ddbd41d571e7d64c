"""The order in which a pipeline stage runs its microbatches' forwards ("F", m) and backwards ("B", m).

Every stage runs its microbatches in increasing order in both directions, so the activations a stage receives and
the gradients it sends back pair up by microbatch whatever the schedule; sends never block (hfcp's pipeline posts
them and waits at the end of the step), so a stage only ever waits for a tensor its neighbour is bound to produce.
"""
from __future__ import annotations

SCHEDULES = ("GPipe", "1F1B")


def check_schedule(schedule) -> None:
    """Raises ValueError for a schedule other than SCHEDULES'."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {list(SCHEDULES)}")


def actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """This stage's actions for one step.

    GPipe: every forward, then every backward. 1F1B: as many forwards as stages after this one (the pipeline's
    warm-up), then one forward and one backward in turn, then the backwards left; at most `stages - stage`
    microbatches' activations are alive at once on a stage, instead of all of them.

    Raises:
        ValueError: an unknown schedule.
    """
    check_schedule(schedule)
    m = microbatches
    if schedule == "GPipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - 1 - stage, m)  # 1F1B
    steady = [a for i in range(m - warm) for a in (("F", warm + i), ("B", i))]
    return [("F", i) for i in range(warm)] + steady + [("B", i) for i in range(m - warm, m)]
