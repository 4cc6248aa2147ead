"""The interface of a placement policy for GPU-sharing workloads, the kind a trace replay compares.

Where the composer's `PlacementPolicy` orders devices for a host already chosen, this one chooses the host: it
scores every feasible way to place one pod (a host, and for a GPU share the GPU to share) and the lowest score
wins; ties are broken at random by the replay's seed. Policies are plugins: register a factory with
``registry.add_sharing_policy`` from the ``disagg_register_policies`` hook, so numpy is imported only when a
replay runs.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from disagg.replay.trace import Pod
from disagg.replay.workload import TaskType
from disagg.replay.world import Candidates, World

FloatArray = npt.NDArray[np.float64]


class SharingPolicy(abc.ABC):
    """Scores candidate placements of one pod; lower is better. Must be deterministic."""

    name: str = ""
    description: str = ""

    def prepare(self, types: Sequence[TaskType], world: World) -> None:  # noqa: B027
        """Told, before a replay, the task mix to expect and the world it places on (to read, never to change);
        the default ignores them."""

    @abc.abstractmethod
    def score(self, pod: Pod, candidates: Candidates) -> FloatArray:
        """One finite score per candidate, in their order: an array of shape ``(len(candidates),)``. The replay
        refuses anything else (NaN, infinity, too few or too many) with `disagg.errors.PluginError`."""
