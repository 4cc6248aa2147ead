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
            (("n0", "64_000", "262144", "2", "A"), "nodes.csv:3: cpu_milli must be a whole number, got '64_000'"),
            (("", "64000", "262144", "2", "A"), "nodes.csv:3: a node needs its sn"),
            (("n0", "64000", "262144", "-1", "A"), "nodes.csv:3: gpu must be at least 0, got -1"),
            (("n0", "0", "262144", "2", "A"), "nodes.csv:3: cpu_milli must be at least 1, got 0"),
            (("n0", "64000", "", "2", "A"), "nodes.csv:3: memory_mib must be a whole number, got ''"),
            (("n0", "64000", "262144", "2", " "), "nodes.csv:3: a node with GPUs needs a model"),
            (
                ("n1", "99999999999999999999999", "262144", "2", "A"),
                "nodes.csv:3: cpu_milli must be at most 1099511627776, got 99999999999999999999999",
            ),
            (
                ("n1", "64000", str(2**40 + 1), "2", "A"),
                f"nodes.csv:3: memory_mib must be at most 1099511627776, got {2**40 + 1}",
            ),
            (("n1", "64000", "262144", "65537", "A"), "nodes.csv:3: gpu must be at most 65536, got 65537"),
            (
                ("n0", "64000", "262144", "2", "A"),
                "nodes.csv:3: sn 'n0' is listed already on line 2: a server listed twice would count its GPUs twice",
            ),
        ],
    )
    def test_bad_row_names_file_and_line(self, tmp_path: Path, row: tuple[str, ...], message: str) -> None:
        path = nodes_file(tmp_path, GOOD_NODE, row)
        with pytest.raises(InvalidRequestError) as caught:
            load_nodes(path)
        assert caught.value.message == message

    def test_largest_counts(self, tmp_path: Path) -> None:
        path = nodes_file(tmp_path, ("n0", str(2**40), str(2**40), str(2**16), "A"))
        assert load_nodes(path) == [Node("n0", 2**40, 2**40, 2**16, "A")]

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
        [
            ("", set()),
            ("nan", set()),  # the trace's README: "`nan` means no GPU type constraints"
            ("G3", {"G3"}),
            ("V100M16|V100M32", {"V100M16", "V100M32"}),
            (" A | B |", {"A", "B"}),
        ],
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
            (
                ("p1", "99999999999999999999999", "1", "1", "1000", ""),
                "pods.csv:3: cpu_milli must be at most 1099511627776, got 99999999999999999999999",
            ),
            (
                ("p1", "1000", str(2**40 + 1), "0", "0", ""),
                f"pods.csv:3: memory_mib must be at most {2**40}, got {2**40 + 1}",
            ),
            (("p1", "1000", "1", str(10**30), "1000", ""), f"pods.csv:3: num_gpu must be at most 65536, got {10**30}"),
            (("p1", "1000", "1", "0", "5000", ""), "pods.csv:3: gpu_milli must be 0..1000, got 5000"),
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


class TestShape:
    """A header or row whose shape would change the input without a word is refused, naming the file and line (or
    the header): the trace's own columns load, others do not."""

    def test_row_with_more_fields_than_the_header(self, tmp_path: Path) -> None:
        """A gpu_spec written with a comma: the second model would be dropped."""
        path = pods_file(tmp_path, GOOD_POD, ("p1", "1000", "1024", "1", "1000", "V100M16", "V100M32"))
        with pytest.raises(InvalidRequestError) as caught:
            load_pods(path)
        assert caught.value.message == (
            "pods.csv:3: 7 fields, the header has 6 (a comma inside a field needs quotes; gpu_spec separates models "
            "with |)"
        )

    def test_row_with_fewer_fields_than_the_header(self, tmp_path: Path) -> None:
        with pytest.raises(InvalidRequestError) as caught:
            load_nodes(nodes_file(tmp_path, GOOD_NODE, ("n1", "64000", "262144", "2")))
        assert caught.value.message == "nodes.csv:3: 4 fields, the header has 5"

    def test_misspelt_optional_column(self, tmp_path: Path) -> None:
        """``gpu_specs`` for ``gpu_spec``: every constraint would be dropped."""
        path = pods_file(tmp_path, GOOD_POD, header=(*POD_HEADER[:5], "gpu_specs"))
        with pytest.raises(InvalidRequestError) as caught:
            load_pods(path)
        assert caught.value.message == (
            "pods.csv: header: no column 'gpu_specs' in the trace's format (its columns: name, cpu_milli, memory_mib, "
            "num_gpu, gpu_milli, gpu_spec, qos, pod_phase, creation_time, deletion_time, scheduled_time)"
        )

    def test_column_named_twice(self, tmp_path: Path) -> None:
        """The last ``gpu`` would win: a GPU server read as CPU-only."""
        path = nodes_file(tmp_path, (*GOOD_NODE, "0"), header=(*NODE_HEADER, "gpu"))
        with pytest.raises(InvalidRequestError) as caught:
            load_nodes(path)
        assert caught.value.message == "nodes.csv: header: column gpu given twice"

    def test_every_column_of_the_trace(self, tmp_path: Path) -> None:
        """The published pod lists' header, with the columns the replay does not read (qos, phase, times)."""
        header = (*POD_HEADER, "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")
        path = pods_file(tmp_path, (*GOOD_POD, "LS", "Running", "0", "12537496", "0"), header=header)
        assert load_pods(path) == [Pod("p0", 4000, 8192, 1, 500)]

    def test_blank_lines_are_no_rows(self, tmp_path: Path) -> None:
        path = nodes_file(tmp_path, GOOD_NODE)
        path.write_text(path.read_text(encoding="utf-8") + "\n\n", encoding="utf-8")
        assert load_nodes(path) == [Node("n0", 64000, 262144, 2, "A")]


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

    def test_no_fetch_hint_for_the_users_own_files(self, tmp_path: Path) -> None:
        """The Alibaba trace holds no file of the user's own name: fetching it would not help."""
        reason = missing_trace_reason(tmp_path, ("mine.csv",))
        assert reason is not None
        assert "clusterdata" not in reason and "kubernetes-scheduler-simulator" not in reason

    @pytest.mark.parametrize("name", ["openb_node_list_all_node.csv", "openb_pod_list_gpuspec33.csv"])
    def test_fetch_hint_for_any_file_of_the_set(self, tmp_path: Path, name: str) -> None:
        reason = missing_trace_reason(tmp_path, (name, "mine.csv"))
        assert reason is not None
        assert reason.endswith(f"into {tmp_path}") and "github.com/alibaba/clusterdata" in reason

    def test_missing_reason_names_the_variable_that_chose_the_directory(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path))
        reason = missing_trace_reason(trace_dir(), ("mine.csv",))
        assert reason == (
            f"mine.csv not found in {tmp_path / TRACE_SUBDIR} (the shared data directory ${SHARED_DIR_ENV}={tmp_path})"
        )

    def test_missing_reason_names_the_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
        reason = missing_trace_reason(trace_dir(), ("mine.csv",))
        assert reason == (
            f"mine.csv not found in {Path('../shared') / TRACE_SUBDIR} (the default shared data directory "
            f"../shared; --shared or ${SHARED_DIR_ENV} choose another)"
        )

    def test_nothing_missing(self, tmp_path: Path) -> None:
        for name in (DEFAULT_NODES, DEFAULT_PODS):
            (tmp_path / name).write_text("x\n", encoding="utf-8")
        assert missing_trace_reason(tmp_path) is None
