"""A lower bound on unallocated GPU share that no policy and no fabric can beat, for a given set of arrivals.

A pod taking more than half a GPU (share d > 500) never shares its GPU with another such pod, so placed, it
leaves a slack of 1000 - d that only pods of share at most 1000 - d can fill. For a threshold t, let T be the
slack of the big pods whose slack is at most t, less all the share the pods of share at most t could pour into
it. A policy may also leave big pods out: each one it leaves takes its slack s out of T but adds its share
d >= s (1000 - t) / t to the demand that failed, and with arrived demand at capacity plus an overshoot e,
unallocated = failed - e. Balancing the two gives, for every t,

    unallocated >= ((1000 - t) T - t e) / 1000,

and the floor is the best t. It holds whatever the domains, since a GPU share is always served by one GPU.
On the Alibaba trace it is set by the many 810-milli pods, whose 190-milli slack only rare small pods fit.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.replay.trace import WHOLE_GPU_MILLI, Pod

HALF = WHOLE_GPU_MILLI // 2


def share_floor_milli(pods: Sequence[Pod], overshoot_milli: int = 0) -> float:
    """The GPU share (milli) that stays unallocated after ``pods`` arrive, whatever places them; the arrived
    demand is the capacity plus ``overshoot_milli``."""
    if overshoot_milli < 0:
        raise ValueError(f"the arrived demand must reach the capacity: overshoot {overshoot_milli} is negative")
    slack: list[int] = []
    small: list[int] = []
    for pod in pods:
        if pod.num_gpu != 1 or pod.gpu_milli >= WHOLE_GPU_MILLI:
            continue
        if pod.gpu_milli > HALF:
            slack.append(WHOLE_GPU_MILLI - pod.gpu_milli)
        else:
            small.append(pod.gpu_milli)
    best = 0.0
    for t in sorted(set(slack)):
        unfilled = sum(s for s in slack if s <= t) - sum(s for s in small if s <= t)
        best = max(best, ((WHOLE_GPU_MILLI - t) * unfilled - t * overshoot_milli) / WHOLE_GPU_MILLI)
    return best
