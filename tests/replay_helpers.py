"""Synthetic trace data for the replay tests: CSV writers, small node and pod lists, Hypothesis strategies."""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from disagg.replay.trace import DEFAULT_NODES, DEFAULT_PODS, TRACE_SUBDIR, WHOLE_GPU_MILLI, Node, Pod
from disagg.replay.workload import model_mask
from disagg.replay.world import World
from hypothesis import strategies as st

NODE_HEADER = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_HEADER = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec")
MODELS = ("A", "B")
GIB = 1024


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[object]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def node_rows(nodes: Iterable[Node]) -> list[tuple[object, ...]]:
    return [(n.sn, n.cpu_milli, n.memory_mib, n.gpus, n.model) for n in nodes]


def pod_rows(pods: Iterable[Pod]) -> list[tuple[object, ...]]:
    return [(p.name, p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, "|".join(sorted(p.gpu_spec))) for p in pods]


def write_trace(shared: Path, nodes: Sequence[Node], pods: Sequence[Pod]) -> Path:
    """The default node and pod lists of a trace under the shared directory ``shared``; the trace directory."""
    directory = shared / TRACE_SUBDIR
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(directory / DEFAULT_NODES, NODE_HEADER, node_rows(nodes))
    write_csv(directory / DEFAULT_PODS, POD_HEADER, pod_rows(pods))
    return directory


def pod(cpu: int = 1000, mem: int = GIB, num_gpu: int = 0, gpu_milli: int = 0, spec: Iterable[str] = ()) -> Pod:
    return Pod("p", cpu, mem, num_gpu, gpu_milli, frozenset(spec))


def share(gpu_milli: int, cpu: int = 1000, spec: Iterable[str] = ()) -> Pod:
    """A pod taking ``gpu_milli`` of one GPU."""
    return pod(cpu=cpu, num_gpu=1, gpu_milli=gpu_milli, spec=spec)


def whole(num_gpu: int, cpu: int = 1000, spec: Iterable[str] = ()) -> Pod:
    """A pod taking ``num_gpu`` whole GPUs."""
    return pod(cpu=cpu, num_gpu=num_gpu, gpu_milli=WHOLE_GPU_MILLI, spec=spec)


def gpu_node(gpus: int, model: str = "A", cpu: int = 64000, mem: int = 256 * GIB, sn: str = "n") -> Node:
    return Node(sn, cpu, mem, gpus, model)


def cpu_node(cpu: int = 32000, mem: int = 128 * GIB, sn: str = "c") -> Node:
    return Node(sn, cpu, mem, 0, "")


def small_cluster() -> tuple[list[Node], list[Pod]]:
    """20 servers (16 with GPUs of two models, 4 CPU-only, 80 GPUs) and 60 pods of every kind (54 GPUs' worth),
    all of which fit the servers together."""
    nodes = [gpu_node(8 if i % 2 else 2, MODELS[i % 2], cpu=32000 + 8000 * (i % 3), sn=f"g{i}") for i in range(16)]
    nodes += [cpu_node(sn=f"c{i}") for i in range(4)]
    kinds = [
        pod(cpu=4000, mem=8 * GIB),
        share(500, cpu=2000),
        share(250, cpu=1000),
        share(810, cpu=8000),
        whole(1, cpu=6000),
        whole(2, cpu=12000, spec={"B"}),
        share(300, cpu=3000, spec={"A"}),
        whole(4, cpu=16000),
        share(100, cpu=500),
        pod(cpu=2000, mem=4 * GIB),
    ]
    pods = [Pod(f"pod-{i}", *_fields(kinds[i % len(kinds)])) for i in range(60)]
    return nodes, pods


def _fields(p: Pod) -> tuple[int, int, int, int, frozenset[str]]:
    return p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, p.gpu_spec


def fill(world: World, pods: Iterable[Pod], pick: Callable[[int], int]) -> list[Pod]:
    """Place each of ``pods`` that fits at the candidate ``pick(count)`` chooses; the pods placed."""
    placed: list[Pod] = []
    for p in pods:
        candidates = world.candidates(p, model_mask(p.gpu_spec, world.models))
        if len(candidates):
            i = pick(len(candidates))
            world.place(p, int(candidates.host[i]), int(candidates.slot[i]))
            placed.append(p)
    return placed


@st.composite
def nodes_strategy(draw: st.DrawFn, max_size: int = 6) -> list[Node]:
    """A few servers: up to 4 GPUs of model A or B, or none; the first has GPUs."""
    count = draw(st.integers(1, max_size))
    nodes = []
    for i in range(count):
        gpus = draw(st.integers(0 if i else 1, 4))
        nodes.append(
            Node(
                f"n{i}",
                draw(st.integers(1, 8)) * 4000,
                draw(st.integers(1, 8)) * 16 * GIB,
                gpus,
                draw(st.sampled_from(MODELS)) if gpus else "",
            )
        )
    return nodes


SHARES = st.one_of(st.integers(1, WHOLE_GPU_MILLI - 1), st.sampled_from([100, 190, 250, 500, 600, 810, 900]))


@st.composite
def pod_strategy(draw: st.DrawFn) -> Pod:
    """A CPU-only, whole-GPU (1-4 GPUs) or shared-GPU pod, maybe limited to some models."""
    cpu = draw(st.integers(0, 6)) * 2000
    mem = draw(st.integers(0, 4)) * 16 * GIB
    spec = draw(st.frozensets(st.sampled_from(MODELS)))
    kind = draw(st.sampled_from(["cpu", "whole", "shared"]))
    if kind == "cpu":
        return pod(cpu, mem)
    if kind == "whole":
        return pod(cpu, mem, draw(st.integers(1, 4)), WHOLE_GPU_MILLI, spec)
    return pod(cpu, mem, 1, draw(SHARES), spec)
