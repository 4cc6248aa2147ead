"""The Alibaba GPU cluster trace of 2023 (the "openb" set): its node and pod lists, read and checked.

The data is not part of this repository: it lives in the shared data directory, ``$DISAGG_SHARED_DIR`` or
``../shared`` from the working directory, under ``traces/alibaba-gpu-v2023``. A row that does not parse is an
error naming the file and line, never a row silently dropped, since one lost pod changes every figure.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from disagg.errors import InvalidRequestError

SHARED_DIR_ENV = "DISAGG_SHARED_DIR"
DEFAULT_SHARED_DIR = "../shared"
TRACE_SUBDIR = "traces/alibaba-gpu-v2023"
DEFAULT_NODES = "openb_node_list_gpu_node.csv"
DEFAULT_PODS = "openb_pod_list_default.csv"
FETCH_HINT = (
    "fetch the trace's CSV files (the csv/ folder of github.com/alibaba/clusterdata cluster-trace-gpu-v2023, "
    "or data/csv of github.com/hkust-adsl/kubernetes-scheduler-simulator) into {where}"
)
WHOLE_GPU_MILLI = 1000

_NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
_POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


@attrs.frozen
class Node:
    """One server: its CPUs (milli), memory (MiB) and GPUs, all of one model (empty for a CPU-only server)."""

    sn: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@attrs.frozen
class Pod:
    """One task's request. ``gpu_milli`` is the share of each of its ``num_gpu`` GPUs (1000 is a whole GPU);
    ``gpu_spec`` is the set of GPU models it may run on, empty for any."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: frozenset[str] = frozenset()

    @property
    def gpu_demand_milli(self) -> int:
        return self.num_gpu * self.gpu_milli


def shared_dir() -> Path:
    """The shared data directory: ``$DISAGG_SHARED_DIR``, else ``../shared`` from the working directory."""
    return Path(os.environ.get(SHARED_DIR_ENV) or DEFAULT_SHARED_DIR)


def trace_dir(shared: Path | None = None) -> Path:
    return (shared if shared is not None else shared_dir()) / TRACE_SUBDIR


def missing_trace_reason(directory: Path, names: tuple[str, ...] = (DEFAULT_NODES, DEFAULT_PODS)) -> str | None:
    """Why the trace cannot be read from ``directory`` (with what to fetch), or None when it is all there."""
    absent = [n for n in names if not (directory / n).is_file()]
    if not absent:
        return None
    return f"{', '.join(absent)} not found in {directory} (set ${SHARED_DIR_ENV}); " + FETCH_HINT.format(
        where=directory
    )


def _rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """The rows of ``path`` by line number. "utf-8-sig" drops the byte order mark a spreadsheet's "CSV UTF-8" puts
    first, which would otherwise be part of the first column's name; text that is not UTF-8 or not CSV is an error
    naming the file and line, like a bad row."""
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as e:
        raise InvalidRequestError(f"cannot read {path}: {e.strerror}", field=str(path)) from e
    with handle:
        reader = csv.DictReader(handle)
        try:
            missing = [c for c in columns if c not in (reader.fieldnames or ())]
            if missing:
                raise InvalidRequestError(f"{path}: no column {', '.join(missing)}", field=str(path))
            for row in reader:
                yield reader.line_num, row
        except UnicodeDecodeError as e:
            line = _undecodable_line(path)
            raise InvalidRequestError(
                f"{path.name}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x})", field=f"{path.name}:{line}"
            ) from None
        except csv.Error as e:
            line = reader.reader.line_num  # the DictReader's own count stops at the last good row
            raise InvalidRequestError(f"{path.name}:{line}: not a CSV row ({e})", field=f"{path.name}:{line}") from None


def _undecodable_line(path: Path) -> int:
    """The line of the first byte that is not UTF-8: the text layer decodes ahead of the CSV reader by blocks, so
    the reader's line number does not say where the bad byte is."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data.count(b"\n", 0, e.start) + 1
    return 0


def _int(path: Path, line: int, row: dict[str, str], column: str, *, least: int = 0) -> int:
    text = (row.get(column) or "").strip()
    try:
        value = int(text)
    except ValueError:
        raise InvalidRequestError(
            f"{path.name}:{line}: {column} must be a whole number, got {text!r}", field=f"{path.name}:{line}"
        ) from None
    if value < least:
        raise InvalidRequestError(
            f"{path.name}:{line}: {column} must be at least {least}, got {value}", field=f"{path.name}:{line}"
        )
    return value


def load_nodes(path: Path) -> list[Node]:
    nodes: list[Node] = []
    for line, row in _rows(path, _NODE_COLUMNS):
        gpus = _int(path, line, row, "gpu")
        model = (row.get("model") or "").strip()
        if gpus and not model:
            raise InvalidRequestError(f"{path.name}:{line}: a node with GPUs needs a model", field=f"{path.name}")
        nodes.append(
            Node(
                row["sn"],
                _int(path, line, row, "cpu_milli", least=1),
                _int(path, line, row, "memory_mib", least=1),
                gpus,
                model if gpus else "",
            )
        )
    if not nodes:
        raise InvalidRequestError(f"{path} lists no node", field=str(path))
    return nodes


def load_pods(path: Path) -> list[Pod]:
    pods: list[Pod] = []
    for line, row in _rows(path, _POD_COLUMNS):
        num_gpu = _int(path, line, row, "num_gpu")
        gpu_milli = _int(path, line, row, "gpu_milli")
        if num_gpu and not 0 < gpu_milli <= WHOLE_GPU_MILLI:
            raise InvalidRequestError(
                f"{path.name}:{line}: gpu_milli must be 1..1000 for a GPU pod, got {gpu_milli}",
                field=f"{path.name}:{line}",
            )
        if num_gpu > 1 and gpu_milli != WHOLE_GPU_MILLI:
            raise InvalidRequestError(
                f"{path.name}:{line}: a pod of {num_gpu} GPUs must take them whole (gpu_milli 1000), got {gpu_milli}",
                field=f"{path.name}:{line}",
            )
        spec = frozenset(s.strip() for s in (row.get("gpu_spec") or "").split("|") if s.strip())
        pods.append(
            Pod(
                row["name"],
                _int(path, line, row, "cpu_milli"),
                _int(path, line, row, "memory_mib"),
                num_gpu,
                gpu_milli if num_gpu else 0,
                spec if num_gpu else frozenset(),
            )
        )
    if not pods:
        raise InvalidRequestError(f"{path} lists no pod", field=str(path))
    return pods
