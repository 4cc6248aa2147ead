"""The Alibaba GPU cluster trace of 2023 (the "openb" set): its node and pod lists, read and checked.

The data is not part of this repository: it lives in the shared data directory, ``$DISAGG_SHARED_DIR`` or
``../shared`` from the working directory, under ``traces/alibaba-gpu-v2023``. A row that does not parse is an
error naming the file and line, never a row silently dropped, since one lost pod changes every figure; so is a
header or row whose shape would change the input without a word (a column the format does not have, one named
twice, a row with more or fewer fields than the header, a server listed twice).
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
TRACE_FILES = (
    DEFAULT_NODES,
    "openb_node_list_all_node.csv",
    DEFAULT_PODS,
    "openb_pod_list_multigpu50.csv",
    "openb_pod_list_gpuspec33.csv",
)
"""The lists of the set, the names the fetch hint is for (a missing file of another name is the user's own)."""
WHOLE_GPU_MILLI = 1000
MAX_AMOUNT = 2**40
"""The most CPU (milli) or memory (MiB) a row may give: far above any server (a thousand cores, a thousand TiB),
and low enough that sums over hosts stay within the 64-bit integers the replay counts in."""
MAX_GPUS = 2**16
"""The most GPUs a row may give, likewise."""
NO_GPU_SPEC = "nan"
"""How the trace writes "no GPU model constraint" in ``gpu_spec`` (its README: "`nan` means no GPU type
constraints"), as pandas writes an empty cell; the published lists leave the cell empty instead."""

_NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
_POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
_NODE_FORMAT = _NODE_COLUMNS
"""Every column of the trace's node lists."""
_POD_FORMAT = (*_POD_COLUMNS, "gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")
"""Every column of the trace's pod lists (the trace's README); the replay reads the first six. Another name is
refused: a misspelt optional column (``gpu_specs``) would otherwise drop every constraint without a word."""


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


def shared_origin(shared: Path | None = None) -> str:
    """Where the shared data directory came from, for a message about files missing in it: the ``--shared``
    option (``shared``), ``$DISAGG_SHARED_DIR``, or the default, so the user knows which setting to change."""
    if shared is not None:
        return f"the shared data directory given by --shared {shared}"
    if os.environ.get(SHARED_DIR_ENV):
        return f"the shared data directory ${SHARED_DIR_ENV}={os.environ[SHARED_DIR_ENV]}"
    return f"the default shared data directory {DEFAULT_SHARED_DIR}; --shared or ${SHARED_DIR_ENV} choose another"


def missing_trace_reason(
    directory: Path, names: tuple[str, ...] = (DEFAULT_NODES, DEFAULT_PODS), *, origin: str | None = None
) -> str | None:
    """Why the trace cannot be read from ``directory`` (with what to fetch), or None when it is all there.
    ``origin`` says where the shared data directory came from (`shared_origin`; by default from the environment).
    The fetch hint is given only when a file of the published set is missing: the user's own lists are not there."""
    absent = [n for n in names if not (directory / n).is_file()]
    if not absent:
        return None
    reason = f"{', '.join(absent)} not found in {directory} ({origin or shared_origin()})"
    if any(n in TRACE_FILES for n in absent):
        reason += "; " + FETCH_HINT.format(where=directory)
    return reason


def _rows(path: Path, columns: tuple[str, ...], known: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """The rows of ``path`` by line number. "utf-8-sig" drops the byte order mark a spreadsheet's "CSV UTF-8" puts
    first, which would otherwise be part of the first column's name; text that is not UTF-8 or not CSV is an error
    naming the file and line, like a bad row. ``columns`` must be in the header and every column of it in
    ``known``; each row must have as many fields as the header (a ``gpu_spec`` written with a comma has one more)."""
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as e:
        raise InvalidRequestError(f"cannot read {path}: {e.strerror}", field=str(path)) from e
    with handle:
        reader = csv.reader(handle)
        try:
            header = next(reader, [])
            _check_header(path, header, columns, known)
            for fields in reader:
                if not fields:
                    continue  # a blank line
                if len(fields) != len(header):
                    where = f"{path.name}:{reader.line_num}"
                    hint = " (a comma inside a field needs quotes; gpu_spec separates models with |)"
                    raise InvalidRequestError(
                        f"{where}: {len(fields)} fields, the header has {len(header)}"
                        + (hint if len(fields) > len(header) else ""),
                        field=where,
                    )
                yield reader.line_num, dict(zip(header, fields, strict=True))
        except UnicodeDecodeError as e:
            line = _undecodable_line(path)
            raise InvalidRequestError(
                f"{path.name}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x})", field=f"{path.name}:{line}"
            ) from None
        except csv.Error as e:
            line = reader.line_num
            raise InvalidRequestError(f"{path.name}:{line}: not a CSV row ({e})", field=f"{path.name}:{line}") from None


def _check_header(path: Path, header: list[str], columns: tuple[str, ...], known: tuple[str, ...]) -> None:
    """Refuse a header the rows would be misread under: a column missing, one named twice (the last would win),
    or one the trace's format does not have (a misspelt optional column would be ignored)."""
    missing = [c for c in columns if c not in header]
    if missing:
        raise InvalidRequestError(f"{path}: no column {', '.join(missing)}", field=str(path))
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        raise InvalidRequestError(f"{path.name}: header: column {', '.join(twice)} given twice", field=str(path))
    unknown = [c for c in header if c not in known]
    if unknown:
        raise InvalidRequestError(
            f"{path.name}: header: no column {', '.join(repr(c) for c in unknown)} in the trace's format "
            f"(its columns: {', '.join(known)})",
            field=str(path),
        )


def _undecodable_line(path: Path) -> int:
    """The line of the first byte that is not UTF-8: the text layer decodes ahead of the CSV reader by blocks, so
    the reader's line number does not say where the bad byte is."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data.count(b"\n", 0, e.start) + 1
    return 0


def _int(path: Path, line: int, row: dict[str, str], column: str, *, least: int, most: int) -> int:
    """The whole number in ``column``, refused outside ``least``..``most``: a count past the bounds would
    overflow the replay's 64-bit arrays instead of naming the row."""
    text = (row.get(column) or "").strip()
    try:
        if not (text.isascii() and text.removeprefix("-").isdigit()):  # int() also reads 1_000, +5 and ²
            raise ValueError(text)
        value = int(text)
    except ValueError:
        raise InvalidRequestError(
            f"{path.name}:{line}: {column} must be a whole number, got {text!r}", field=f"{path.name}:{line}"
        ) from None
    if value < least:
        raise InvalidRequestError(
            f"{path.name}:{line}: {column} must be at least {least}, got {value}", field=f"{path.name}:{line}"
        )
    if value > most:
        raise InvalidRequestError(
            f"{path.name}:{line}: {column} must be at most {most}, got {value}", field=f"{path.name}:{line}"
        )
    return value


def load_nodes(path: Path) -> list[Node]:
    nodes: list[Node] = []
    first_line: dict[str, int] = {}
    for line, row in _rows(path, _NODE_COLUMNS, _NODE_FORMAT):
        gpus = _int(path, line, row, "gpu", least=0, most=MAX_GPUS)
        model = (row.get("model") or "").strip()
        if not row["sn"].strip():
            raise InvalidRequestError(f"{path.name}:{line}: a node needs its sn", field=f"{path.name}:{line}")
        if gpus and not model:
            raise InvalidRequestError(f"{path.name}:{line}: a node with GPUs needs a model", field=f"{path.name}")
        node = Node(
            row["sn"],
            _int(path, line, row, "cpu_milli", least=1, most=MAX_AMOUNT),
            _int(path, line, row, "memory_mib", least=1, most=MAX_AMOUNT),
            gpus,
            model if gpus else "",
        )
        if node.sn in first_line:
            raise InvalidRequestError(
                f"{path.name}:{line}: sn {node.sn!r} is listed already on line {first_line[node.sn]}: a server "
                "listed twice would count its GPUs twice",
                field=f"{path.name}:{line}",
            )
        first_line[node.sn] = line
        nodes.append(node)
    if not nodes:
        raise InvalidRequestError(f"{path} lists no node", field=str(path))
    return nodes


def load_pods(path: Path) -> list[Pod]:
    pods: list[Pod] = []
    for line, row in _rows(path, _POD_COLUMNS, _POD_FORMAT):
        num_gpu = _int(path, line, row, "num_gpu", least=0, most=MAX_GPUS)
        gpu_milli = _int(path, line, row, "gpu_milli", least=0, most=MAX_AMOUNT)
        if num_gpu and not 0 < gpu_milli <= WHOLE_GPU_MILLI:
            raise InvalidRequestError(
                f"{path.name}:{line}: gpu_milli must be 1..1000 for a GPU pod, got {gpu_milli}",
                field=f"{path.name}:{line}",
            )
        if gpu_milli > WHOLE_GPU_MILLI:
            raise InvalidRequestError(
                f"{path.name}:{line}: gpu_milli must be 0..1000, got {gpu_milli}", field=f"{path.name}:{line}"
            )
        if num_gpu > 1 and gpu_milli != WHOLE_GPU_MILLI:
            raise InvalidRequestError(
                f"{path.name}:{line}: a pod of {num_gpu} GPUs must take them whole (gpu_milli 1000), got {gpu_milli}",
                field=f"{path.name}:{line}",
            )
        pods.append(
            Pod(
                row["name"],
                _int(path, line, row, "cpu_milli", least=0, most=MAX_AMOUNT),
                _int(path, line, row, "memory_mib", least=0, most=MAX_AMOUNT),
                num_gpu,
                gpu_milli if num_gpu else 0,
                _gpu_spec(row.get("gpu_spec") or "") if num_gpu else frozenset(),
            )
        )
    if not pods:
        raise InvalidRequestError(f"{path} lists no pod", field=str(path))
    return pods


def _gpu_spec(text: str) -> frozenset[str]:
    """The GPU models of a ``gpu_spec`` cell (``V100M16|V100M32``); none for an empty cell or `NO_GPU_SPEC`."""
    if text.strip() == NO_GPU_SPEC:
        return frozenset()
    return frozenset(s.strip() for s in text.split("|") if s.strip())
