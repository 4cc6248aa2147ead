"""The trace loader (disagg.replay.trace): rows parsed into nodes and pods, every bad row refused by file and line."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from disagg.errors import InvalidRequestError
from disagg.replay.trace import (
    DEFAULT_NODES,
    DEFAULT_PODS,
    SHARED_DIR_ENV,
    TRACE_SUBDIR,
    Node,
    Pod,
    load_nodes,
    load_pods,
    missing_trace_reason,
    shared_dir,
    trace_dir,
)
from replay_helpers import NODE_HEADER, POD_HEADER, write_csv

Loader = Callable[[Path], Sequence[object]]
Writer = Callable[[Path], Path]

GOOD_NODE = ("n0", "64000", "262144", "2", "A")
GOOD_POD = ("p0", "4000", "8192", "1", "500", "")


def nodes_file(tmp_path: Path, *rows: Sequence[object], header: Sequence[str] = NODE_HEADER) -> Path:
    return write_csv(tmp_path / "nodes.csv", header, rows)


def pods_file(tmp_path: Path, *rows: Sequence[object], header: Sequence[str] = POD_HEADER) -> Path:
    return write_csv(tmp_path / "pods.csv", header, rows)


class TestLoadNodes:
    """Node rows become servers; a CPU-only server has no model."""

    def test_rows_in_order(self, tmp_path: Path) -> None:
        path = nodes_file(tmp_path, GOOD_NODE, ("n1", "32000", "131072", "0", ""), ("n2", "96000", "1", "8", " B "))
        assert load_nodes(path) == [
            Node("n0", 64000, 262144, 2, "A"),
            Node("n1", 32000, 131072, 0, ""),
            Node("n2", 96000, 1, 8, "B"),
        ]

    def test_cpu_only_server_drops_its_model(self, tmp_path: Path) -> None:
        assert load_nodes(nodes_file(tmp_path, ("n0", "1000", "1", "0", "A")))[0].model == ""

    @pytest.mark.parametrize(
        ("row", "message"),
        [
            (("n0", "64000", "262144", "two", "A"), "nodes.csv:3: gpu must be a whole number, got 'two'"),
            (("n0", "64000", "262144", "1.5", "A"), "nodes.csv:3: gpu must be a whole number, got '1.5'"),
            (("n0", "64000", "262144", "-1", "A"), "nodes.csv:3: gpu must be at least 0, got -1"),
            (("n0", "0", "262144", "2", "A"), "nodes.csv:3: cpu_milli must be at least 1, got 0"),
            (("n0", "64000", "", "2", "A"), "nodes.csv:3: memory_mib must be a whole number, got ''"),
            (("n0", "64000", "262144", "2", " "), "nodes.csv:3: a node with GPUs needs a model"),
        ],
    )
    def test_bad_row_names_file_and_line(self, tmp_path: Path, row: tuple[str, ...], message: str) -> None:
        path = nodes_file(tmp_path, GOOD_NODE, row)
        with pytest.raises(InvalidRequestError) as caught:
            load_nodes(path)
        assert caught.value.message == message

    def test_missing_column(self, tmp_path: Path) -> None:
        path = nodes_file(tmp_path, GOOD_NODE[:4], header=NODE_HEADER[:4])
        with pytest.raises(InvalidRequestError, match=r"nodes\.csv: no column model$"):
            load_nodes(path)


class TestLoadPods:
    """Pod rows become requests: a share of one GPU, whole GPUs, or none, maybe limited to some GPU models."""

    def test_kinds_of_pod(self, tmp_path: Path) -> None:
        path = pods_file(
            tmp_path,
            GOOD_POD,
            ("p1", "88000", "327680", "8", "1000", ""),
            ("p2", "2000", "4096", "0", "0", "A"),
            ("p3", "0", "0", "1", "1000", "A|B"),
        )
        assert load_pods(path) == [
            Pod("p0", 4000, 8192, 1, 500),
            Pod("p1", 88000, 327680, 8, 1000),
            Pod("p2", 2000, 4096, 0, 0),
            Pod("p3", 0, 0, 1, 1000, frozenset({"A", "B"})),
        ]

    @pytest.mark.parametrize(
        ("text", "spec"),
        [("", set()), ("G3", {"G3"}), ("V100M16|V100M32", {"V100M16", "V100M32"}), (" A | B |", {"A", "B"})],
    )
    def test_gpu_spec(self, tmp_path: Path, text: str, spec: set[str]) -> None:
        assert load_pods(pods_file(tmp_path, (*GOOD_POD[:5], text)))[0].gpu_spec == frozenset(spec)

    def test_cpu_only_pod_drops_share_and_spec(self, tmp_path: Path) -> None:
        loaded = load_pods(pods_file(tmp_path, ("p0", "1000", "1", "0", "700", "A")))[0]
        assert (loaded.gpu_milli, loaded.gpu_spec, loaded.gpu_demand_milli) == (0, frozenset(), 0)

    def test_gpu_spec_column_is_optional(self, tmp_path: Path) -> None:
        path = pods_file(tmp_path, GOOD_POD[:5], header=POD_HEADER[:5])
        assert load_pods(path) == [Pod("p0", 4000, 8192, 1, 500)]

    @pytest.mark.parametrize(
        ("row", "message"),
        [
            (("p1", "x", "1", "0", "0", ""), "pods.csv:3: cpu_milli must be a whole number, got 'x'"),
            (("p1", "1000", "-5", "0", "0", ""), "pods.csv:3: memory_mib must be at least 0, got -5"),
            (("p1", "1000", "1", "-1", "0", ""), "pods.csv:3: num_gpu must be at least 0, got -1"),
            (("p1", "1000", "1", "1", "0", ""), "pods.csv:3: gpu_milli must be 1..1000 for a GPU pod, got 0"),
            (("p1", "1000", "1", "1", "1001", ""), "pods.csv:3: gpu_milli must be 1..1000 for a GPU pod, got 1001"),
            (
                ("p1", "1000", "1", "2", "500", ""),
                "pods.csv:3: a pod of 2 GPUs must take them whole (gpu_milli 1000), got 500",
            ),
        ],
    )
    def test_bad_row_names_file_and_line(self, tmp_path: Path, row: tuple[str, ...], message: str) -> None:
        with pytest.raises(InvalidRequestError) as caught:
            load_pods(pods_file(tmp_path, GOOD_POD, row))
        assert caught.value.message == message

    def test_missing_column(self, tmp_path: Path) -> None:
        header = ("name", "cpu_milli", "memory_mib", "gpu_milli")
        with pytest.raises(InvalidRequestError, match=r"pods\.csv: no column num_gpu$"):
            load_pods(pods_file(tmp_path, ("p0", "1", "1", "1"), header=header))


class TestFiles:
    """A list that cannot be read or lists nothing is refused, naming the file."""

    LOADERS = (
        pytest.param(load_nodes, nodes_file, "node", id="nodes"),
        pytest.param(load_pods, pods_file, "pod", id="pods"),
    )

    @pytest.mark.parametrize(("load", "write", "kind"), LOADERS)
    def test_missing_file(self, tmp_path: Path, load: Loader, write: Writer, kind: str) -> None:
        with pytest.raises(InvalidRequestError, match=r"cannot read .*absent\.csv"):
            load(tmp_path / "absent.csv")

    @pytest.mark.parametrize(("load", "write", "kind"), LOADERS)
    def test_empty_list(self, tmp_path: Path, load: Loader, write: Writer, kind: str) -> None:
        with pytest.raises(InvalidRequestError, match=rf"{kind}s\.csv lists no {kind}$"):
            load(write(tmp_path))

    def test_utf8_byte_order_mark(self, tmp_path: Path) -> None:
        """A spreadsheet's "CSV UTF-8" starts with a byte order mark, which is not part of the first column's name."""
        path = nodes_file(tmp_path, GOOD_NODE)
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        assert load_nodes(path) == [Node("n0", 64000, 262144, 2, "A")]

    def test_not_utf8_names_file_and_line(self, tmp_path: Path) -> None:
        path = nodes_file(tmp_path, GOOD_NODE, ("n1", "64000", "262144", "2", "Tesla\xe9"))
        path.write_bytes(path.read_bytes().replace("\xe9".encode(), b"\xe9"))  # Latin-1, not UTF-8
        with pytest.raises(InvalidRequestError) as caught:
            load_nodes(path)
        assert caught.value.message == "nodes.csv:3: not UTF-8 text (byte 0xe9)"

    def test_not_csv_names_file_and_line(self, tmp_path: Path) -> None:
        path = pods_file(tmp_path, GOOD_POD, ("p1", "1", "1", "0", "0", "x" * 200_000))
        with pytest.raises(InvalidRequestError) as caught:
            load_pods(path)
        assert caught.value.message.startswith("pods.csv:3: not a CSV row (field larger than field limit")


class TestSharedDir:
    """The trace lives under ``$DISAGG_SHARED_DIR``, else ``../shared``, and a missing file says what to fetch."""

    def test_environment_variable(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path))
        assert shared_dir() == tmp_path
        assert trace_dir() == tmp_path / TRACE_SUBDIR

    @pytest.mark.parametrize("value", [None, ""])
    def test_default(self, monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
        else:
            monkeypatch.setenv(SHARED_DIR_ENV, value)
        assert shared_dir() == Path("../shared")

    def test_explicit_directory_wins(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setenv(SHARED_DIR_ENV, "/elsewhere")
        assert trace_dir(tmp_path) == tmp_path / TRACE_SUBDIR

    def test_missing_reason_names_absent_files_and_fetch_hint(self, tmp_path: Path) -> None:
        (tmp_path / DEFAULT_PODS).write_text("name\n", encoding="utf-8")
        reason = missing_trace_reason(tmp_path)
        assert reason is not None
        assert reason.startswith(f"{DEFAULT_NODES} not found in {tmp_path} ")
        assert DEFAULT_PODS not in reason
        assert f"${SHARED_DIR_ENV}" in reason
        assert "github.com/alibaba/clusterdata" in reason
        assert f"into {tmp_path}" in reason

    def test_missing_reason_lists_every_absent_file(self, tmp_path: Path) -> None:
        reason = missing_trace_reason(tmp_path, ("a.csv", "b.csv"))
        assert reason is not None
        assert reason.startswith(f"a.csv, b.csv not found in {tmp_path}")

    def test_nothing_missing(self, tmp_path: Path) -> None:
        for name in (DEFAULT_NODES, DEFAULT_PODS):
            (tmp_path / name).write_text("x\n", encoding="utf-8")
        assert missing_trace_reason(tmp_path) is None
