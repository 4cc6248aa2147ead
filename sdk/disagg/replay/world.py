"""The cluster a trace is replayed on: hosts in fabric domains, each domain pooling its hosts' GPUs.

A domain of K hosts puts the GPUs of those K servers behind one fabric: a free GPU may be bound to any host of
the domain, and a GPU shared by several pods stays bound to the host that runs them. K = 1 is the fixed server
(a host's GPUs are its own), so one model serves both worlds and K = 1 must give the fixed-server figures.

Domains group servers of one GPU model in the node list's order (a GPU box holds one model), so a pod's
``gpu_spec`` is a property of the domain. CPU-only servers are domains without GPUs.

State is kept in numpy arrays over hosts, so a placement decision looks at every host in a few vector steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from disagg.errors import InvalidRequestError
from disagg.replay.trace import WHOLE_GPU_MILLI, Node, Pod

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NO_MODEL = -1
NOT_INSTALLED = -1
"""The free CPU and memory of a server not installed yet: no request fits it."""


@attrs.define(eq=False)
class Views:
    """What a policy sees of candidate hosts: free CPU (milli), memory (MiB), the domain's free whole GPUs,
    the GPU model (index), and the free share (milli) of each shared GPU bound to the host (0: none)."""

    cpu: IntArray
    mem: IntArray
    full: IntArray
    model: IntArray
    partial: IntArray

    def take(self, rows: IntArray) -> Views:
        return Views(self.cpu[rows], self.mem[rows], self.full[rows], self.model[rows], self.partial[rows])


@attrs.define(eq=False)
class Candidates:
    """Every way to place one pod: on ``host`` (in fabric domain ``domain``), sharing the GPU in ``slot``
    (-1: a GPU from the domain's pool, or none); ``gpu_left`` is the free share of the GPU it shares after it
    (0 for whole GPUs and CPU-only pods)."""

    host: IntArray
    domain: IntArray
    slot: IntArray
    gpu_left: IntArray
    version: IntArray
    before: Views
    after: Views

    def __len__(self) -> int:
        return len(self.host)


@attrs.define(eq=False)
class World:
    """Free resources of every host and domain; ``place`` is the only mutation."""

    k: int
    models: tuple[str, ...]
    domain: IntArray
    cpu: IntArray
    mem: IntArray
    model: IntArray
    partial: IntArray
    pool: IntArray
    capacity_milli: int
    version: IntArray
    """Bumped when a host's own CPU, memory or shared GPUs change (not its domain's pool): caches of per-host
    values key on it."""
    nodes: tuple[Node, ...] = ()
    installed: int = 0
    """Servers installed so far; they are installed in list order."""
    allocated_milli: int = 0
    width: int = 1
    """Slots in use by some host, plus one: views carry only these columns."""

    @property
    def hosts(self) -> int:
        return len(self.cpu)

    @property
    def slots(self) -> int:
        """Shared GPUs a host can hold with free share at once (`shared_slots`)."""
        return int(self.partial.shape[1])

    @property
    def domains(self) -> int:
        return len(self.pool)

    def install(self, host: int) -> None:
        """Power on server ``host``: its CPU and memory become free and its GPUs join its domain's pool."""
        if self.cpu[host] != NOT_INSTALLED:
            raise ValueError(f"host {host} is installed already")
        node = self.nodes[host]
        self.cpu[host] = node.cpu_milli
        self.mem[host] = node.memory_mib
        self.pool[self.domain[host]] += node.gpus
        self.capacity_milli += node.gpus * WHOLE_GPU_MILLI
        self.version[host] += 1
        self.installed += 1

    def unallocated(self) -> float:
        """The share of GPU capacity no pod holds."""
        return 1.0 - self.allocated_milli / self.capacity_milli

    def views(self, hosts: IntArray) -> Views:
        return Views(
            self.cpu[hosts].copy(),
            self.mem[hosts].copy(),
            self.pool[self.domain[hosts]].copy(),
            self.model[hosts].copy(),
            self.partial[hosts, : self.width].copy(),
        )

    def candidates(self, pod: Pod, allowed: BoolArray | None) -> Candidates:
        """Every feasible placement of ``pod``; ``allowed`` is a mask over model indices (None: any model)."""
        fits = (self.cpu >= pod.cpu_milli) & (self.mem >= pod.memory_mib)
        if pod.num_gpu:
            fits &= self.model >= 0
            if allowed is not None:
                fits &= np.append(allowed, False)[self.model]  # NO_MODEL (-1) reads the appended False
        if not pod.num_gpu or pod.gpu_milli == WHOLE_GPU_MILLI:
            if pod.num_gpu:
                fits &= self.pool[self.domain] >= pod.num_gpu
            host = np.flatnonzero(fits)
            slot = np.full(len(host), -1, dtype=np.int64)
        else:
            partial = self.partial[:, : self.width]
            share = fits[:, None] & (partial >= pod.gpu_milli)
            new = fits & (self.pool[self.domain] >= 1) & (partial == 0).any(axis=1)
            shared_host, shared_slot = np.nonzero(share)
            new_host = np.flatnonzero(new)
            host = np.concatenate([shared_host, new_host])
            slot = np.concatenate([shared_slot, np.full(len(new_host), -1, dtype=np.int64)])
        before = self.views(host)
        after = self.views(host)
        after.cpu -= pod.cpu_milli
        after.mem -= pod.memory_mib
        gpu_left = np.zeros(len(host), dtype=np.int64)
        if pod.num_gpu:
            rows = np.arange(len(host))
            shared = slot >= 0
            after.partial[rows[shared], slot[shared]] -= pod.gpu_milli
            gpu_left[shared] = after.partial[rows[shared], slot[shared]]
            taken = ~shared
            if pod.gpu_milli == WHOLE_GPU_MILLI:
                after.full[taken] -= pod.num_gpu
            else:
                after.full[taken] -= 1
                empty = np.argmax(after.partial[taken] == 0, axis=1)
                after.partial[rows[taken], empty] = WHOLE_GPU_MILLI - pod.gpu_milli
                gpu_left[taken] = WHOLE_GPU_MILLI - pod.gpu_milli
        return Candidates(host, self.domain[host], slot, gpu_left, self.version[host], before, after)

    def domain_free(self) -> IntArray:
        """Free GPU share (milli) of each domain: its pool and the free share of GPUs bound to its hosts."""
        shared = np.bincount(self.domain, weights=self.partial.sum(axis=1), minlength=self.domains)
        free: IntArray = self.pool * WHOLE_GPU_MILLI + shared.astype(np.int64)
        return free

    def place(self, pod: Pod, host: int, slot: int) -> None:
        self.cpu[host] -= pod.cpu_milli
        self.mem[host] -= pod.memory_mib
        self.version[host] += 1
        if not pod.num_gpu:
            return
        domain = self.domain[host]
        if slot >= 0:
            self.partial[host, slot] -= pod.gpu_milli
        else:
            self.pool[domain] -= 1 if pod.gpu_milli < WHOLE_GPU_MILLI else pod.num_gpu
            if pod.gpu_milli < WHOLE_GPU_MILLI:
                empty = int(np.argmax(self.partial[host] == 0))
                if empty + 1 >= self.width:
                    self.width = min(empty + 2, self.slots)
                self.partial[host, empty] = WHOLE_GPU_MILLI - pod.gpu_milli
        self.allocated_milli += pod.gpu_demand_milli


def _domains(nodes: Sequence[Node], k: int) -> list[list[int]]:
    """Servers of one GPU model in list order, k at a time; each CPU-only server alone."""
    by_model: dict[str, list[int]] = {}
    groups: list[list[int]] = []
    for i, node in enumerate(nodes):
        if not node.gpus:
            groups.append([i])
            continue
        members = by_model.setdefault(node.model, [])
        if not members:
            groups.append(members)
        members.append(i)
        if len(members) == k:
            del by_model[node.model]
    return groups


def shared_slots(nodes: Sequence[Node]) -> int:
    """Shared GPUs a host can hold with free share at once: the most GPUs of any server of the list (at least one).

    On a fixed server (K = 1) the bound is the server's own GPU count, which its pool of GPUs sets by itself, so
    the columns need only be as many as the largest server's (16 on a DGX-2 class server). In a domain the same
    bound keeps a host from collecting half-used GPUs that no other host can use (the policies fill shared GPUs
    before they open new ones, so it is rarely reached: a few hosts out of 1,213 at K = 8 on the Alibaba trace,
    whose servers have at most 8 GPUs)."""
    return max(1, max((n.gpus for n in nodes), default=0))


def build_world(nodes: Sequence[Node], k: int, *, installed: bool = True) -> World:
    """The cluster of ``nodes`` with GPUs pooled by fabric domains of ``k`` hosts (1: fixed servers).

    With ``installed`` False every server is still to be installed (`World.install`), in list order, so that a
    replay can add hardware only when a pod finds no room.
    """
    if k < 1:
        raise InvalidRequestError(f"a fabric domain holds at least one host, got k={k}", field="k")
    models = tuple(sorted({n.model for n in nodes if n.gpus}))
    index = {m: i for i, m in enumerate(models)}
    groups = _domains(nodes, k)
    domain = np.zeros(len(nodes), dtype=np.int64)
    for d, members in enumerate(groups):
        domain[members] = d
    world = World(
        k=k,
        models=models,
        domain=domain,
        cpu=np.full(len(nodes), NOT_INSTALLED, dtype=np.int64),
        mem=np.full(len(nodes), NOT_INSTALLED, dtype=np.int64),
        model=np.array([index[n.model] if n.gpus else NO_MODEL for n in nodes], dtype=np.int64),
        partial=np.zeros((len(nodes), shared_slots(nodes)), dtype=np.int64),
        pool=np.zeros(len(groups), dtype=np.int64),
        capacity_milli=0,
        version=np.zeros(len(nodes), dtype=np.int64),
        nodes=tuple(nodes),
    )
    if installed:
        for host in range(len(nodes)):
            world.install(host)
    return world
