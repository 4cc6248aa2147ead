"""The benchmark report (disagg.replay.report) from a replay fixture and the benchmarks' files."""

from __future__ import annotations

import copy
import json
import os
import runpy
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from disagg.replay import report_plots
from disagg.replay.report import ReportFiles, write_report
from disagg.replay.report_control import BENCHMARKS
from disagg.replay.report_input import parse_placement
from matplotlib.figure import Figure
from matplotlib.image import imread

ROOT = Path(__file__).parent.parent
SEEDS = list(range(10))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORLDS = [("fixed", 1), ("composable", 4), ("composable", 8), ("composable", 16)]
POLICIES = {"best-fit": 0.073, "fgd": 0.049, "domain-pack": 0.045}
"""Policy -> its unallocated share at 100% demand on fixed servers; a composable domain of K hosts halves the
gap to zero as K doubles, roughly as pooling should."""


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": min(values),
        "max": max(values),
        "per_seed": values,
    }


def run(world: str, k: int, policy: str) -> dict[str, Any]:
    level = POLICIES[policy] / (1 if world == "fixed" else max(1.0, k / 2))
    per_seed = [level + (s - 4.5) * 0.0004 for s in SEEDS]
    arrived = [round(i / 100, 2) for i in range(131)]
    mean = [0.0 if a < 0.6 else level * (a - 0.6) / 0.4 for a in arrived]
    needed = [6212 + int(6212 * level) + 3 * s for s in SEEDS]
    return {
        "world": world,
        "k": k,
        "policy": policy,
        "unallocated": spread(per_seed),
        "curve": {"arrived": arrived, "mean": mean, "std": [0.1 * m for m in mean]},
        "gpus_needed": {
            **spread([float(n) for n in needed]),
            "min": min(needed),
            "max": max(needed),
            "per_seed": needed,
        },
        "seconds_per_seed": 2.5,
    }


def placement_fixture() -> dict[str, Any]:
    runs = [run(world, k, policy) for world, k in WORLDS for policy in POLICIES]
    runs[-1]["gpus_needed"] = None  # the replay may not have searched every world's cluster size
    return {
        "trace": {
            "dir": "/work/shared/traces/alibaba-gpu-2023",
            "nodes": "openb_node_list_gpu_node.csv",
            "pods": "openb_pod_list_default.csv",
            "gpus": 6212,
            "nodes_count": 1213,
            "pods_count": 8152,
        },
        "protocol": {"seeds": SEEDS, "inflation": 1.3, "report_at": 1.0},
        "published": {"fgd": 0.0477, "best-fit": 0.0714, "gpu-packing": 0.0822, "random": 0.1370},
        "runs": runs,
        "floor": spread([0.025 + s * 0.0001 for s in SEEDS]),
    }


def compose_bench_module() -> dict[str, Any]:
    """bench/grpc_compose.py's names, loaded as a module (not run as a script)."""
    return runpy.run_path(str(ROOT / "bench" / "grpc_compose.py"), run_name="bench")


def compose_bench(ledger: str, noop_us: float, compose_us: float, *, cpu: bool = False) -> dict[str, Any]:
    """grpc_compose.json as bench/grpc_compose.py --devices 1000,100000 writes it (the keys the report reads);
    without ``cpu``, as it wrote it before it measured CPU. The 1,000-device size is as it wrote it before it
    measured the server's busiest thread."""

    def size(devices: int, slower: float) -> dict[str, Any]:
        rows = []
        for r in range(3):
            for clients, rate in ((1, 1_400.0), (32, 3_200.0)):
                point = {"clients": clients, "round": r}
                noop: dict[str, Any] = {"rpc": "noop", **point, "calls_per_s": rate, "p50_us": noop_us}
                compose: dict[str, Any] = {
                    "rpc": "compose",
                    **point,
                    "calls_per_s": rate * 0.6 / slower,
                    "p50_us": compose_us * slower + r,
                }
                if cpu:
                    noop.update(busy_cores=1.8, machine_cpu_us_per_call=400.0 + 10 * r)
                    compose.update(busy_cores=1.5 - 0.1 * r, machine_cpu_us_per_call=800.0 * slower + 10 * r)
                    if devices > 1000:
                        noop.update(server_busiest_thread_busy=0.6, server_busiest_thread_waiting_for_cpu=0.3)
                        compose.update(
                            server_busiest_thread_busy=0.9 - 0.05 * r,
                            server_busiest_thread_waiting_for_cpu=0.1 + 0.01 * r,
                        )
                rows += [noop, compose]
        return {
            "devices": devices,
            "rows": rows,
            "compose_p50_over_noop_p50_at_1_client": compose_us * slower / noop_us,
            "compose_throughput_over_noop_at_32_clients": 0.6 / slower,
            "targets_met": compose_us * slower / noop_us <= 1.5,
        }

    sizes = {"1000": size(1000, 1.0), "100000": size(100_000, 1.1)}
    return {"settings": {"devices": 100_000, "ledger": ledger}, **sizes["100000"], "sizes": sizes}


def placement_bench() -> dict[str, Any]:
    shapes = {"named-host": 33.7, "chosen-host": 55.4}
    return {
        "runs": {
            "1000": {"devices": 1026, "shapes": {s: {"median_us": m} for s, m in shapes.items()}},
            "100000": {"devices": 99_978, "shapes": {s: {"median_us": m * 0.7} for s, m in shapes.items()}},
        },
        "median_ratio_to_base": {"100000": dict.fromkeys(shapes, 0.7)},
        "worst_ratio": 0.7,
        "target_met": True,
    }


def write_bench_out(out: Path) -> Path:
    """bench/out with the compose (both ledgers) and placement figures, and no grpc_models.json."""
    out.mkdir()
    (out / "grpc_compose.json").write_text(json.dumps(compose_bench("memory", 650.0, 900.0)))
    (out / "grpc_compose_sqlite.json").write_text(json.dumps(compose_bench("sqlite", 700.0, 2_100.0, cpu=True)))
    (out / "placement.json").write_text(json.dumps(placement_bench()))
    return out


@pytest.fixture
def bench_out(tmp_path: Path) -> Path:
    return write_bench_out(tmp_path / "bench-out")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> ReportFiles:
    """One report for the tests that only read it (drawing the plots takes a second or two)."""
    tmp = tmp_path_factory.mktemp("report")
    return write_report(placement_fixture(), tmp / "report", control_plane_dir=write_bench_out(tmp / "bench-out"))


class TestResultsJson:
    """results.json holds the placement dict as given and the collected control-plane figures."""

    def test_round_trip(self, report: ReportFiles) -> None:
        results = json.loads(report.results_json.read_text())
        assert results["placement"] == placement_fixture()
        memory = results["control_plane"]["grpc_compose"]
        assert memory["missing"] is False
        assert memory["ledger"] == "memory"
        assert [s["devices"] for s in memory["sizes"]] == [1000, 100_000]
        assert memory["sizes"][1]["compose_p50_us_at_1_client"] == pytest.approx(990.0 + 1)
        assert memory["sizes"][0]["compose_calls_per_s_at_32_clients"] == pytest.approx(1_920.0)
        assert results["control_plane"]["placement"]["sizes"][1]["shapes"]["chosen-host"]["ratio_to_base"] == 0.7
        assert set(results["machine"]) == {"platform", "python", "cpu_count"}
        assert results["generated"].endswith("+00:00")

    def test_every_file_written(self, report: ReportFiles) -> None:
        assert [p.name for p in report.all] == [
            "results.json",
            "results.md",
            "unallocated.png",
            "gpus_needed.png",
            "control_plane.png",
        ]
        assert all(p.is_file() for p in report.all)


class TestMarkdown:
    """results.md tabulates the fixture's figures as percentages, beside the published ones."""

    def test_unallocated_row(self, report: ReportFiles) -> None:
        text = report.results_md.read_text()
        fgd = next(r for r in placement_fixture()["runs"] if r["world"] == "fixed" and r["policy"] == "fgd")
        u = fgd["unallocated"]
        row = f"| fixed (K=1) | fgd | {u['mean']:.2%} | ± {u['std']:.2%} | {u['min']:.2%}-{u['max']:.2%} | 4.77% |"
        assert row == "| fixed (K=1) | fgd | 4.90% | ± 0.11% | 4.72%-5.08% | 4.77% |"
        assert row in text.splitlines()

    def test_published_only_on_fixed_servers(self, report: ReportFiles) -> None:
        rows = [line for line in report.results_md.read_text().splitlines() if line.startswith("| composable K=4 |")]
        assert rows[0] == "| composable K=4 | best-fit | 3.65% | ± 0.11% | 3.47%-3.83% | - |"
        assert "| fixed (K=1) | domain-pack | 4.50% |" in report.results_md.read_text()

    def test_no_published_figures_no_column(self, tmp_path: Path) -> None:
        """A replay of another trace or protocol has no published reference, and the table claims none."""
        placement = placement_fixture()
        del placement["published"]
        text = write_report(placement, tmp_path, control_plane_dir=tmp_path / "none").results_md.read_text()
        assert "published" not in text.split("## Control plane")[0]
        assert "| world | policy | mean | std | min-max |" in text.splitlines()
        assert "| fixed (K=1) | fgd | 4.90% | ± 0.11% | 4.72%-5.08% |" in text.splitlines()

    def test_floor(self, report: ReportFiles) -> None:
        lines = report.results_md.read_text().splitlines()
        floor = [line for line in lines if line.startswith("Floor: ")]
        assert len(floor) == 1 and floor[0].startswith("Floor: 2.54% (± 0.03%) of the GPUs stay unallocated at 100%")

    def test_no_floor_no_line(self, tmp_path: Path) -> None:
        placement = placement_fixture()
        del placement["floor"]
        files = write_report(placement, tmp_path, control_plane_dir=tmp_path / "none")
        assert not [line for line in files.results_md.read_text().splitlines() if line.startswith("Floor: ")]

    def test_gpus_needed(self, report: ReportFiles) -> None:
        lines = report.results_md.read_text().splitlines()
        needed = lines[lines.index("### GPUs needed to place the whole trace") :]
        assert "| fixed (K=1) | best-fit | 6,678.5 | ± 8.6 | 6,665-6,692 |" in needed
        assert "| composable K=16 | domain-pack | not measured | - | - |" in needed

    def test_control_plane(self, report: ReportFiles) -> None:
        lines = report.results_md.read_text().splitlines()
        assert "| in-memory | 1,000 | 650 | 901 | 1.38 | 3,200 | 1,920 | 0.60 |" in lines
        assert "| SQLite | 100,000 | 700 | 2,311 | 3.30 | 3,200 | 1,745 | 0.55 |" in lines
        assert "| 99,978 | chosen-host | 38.8 | 0.70 |" in lines

    def test_cpu_at_32_clients(self, report: ReportFiles) -> None:
        """Medians over the rounds; a file without CPU figures (the in-memory one here) has no row."""
        lines = report.results_md.read_text().splitlines()
        header = "| ledger | devices | no-op CPU µs per call | Compose CPU µs per call | CPU ratio |"
        table = lines[next(i for i, line in enumerate(lines) if line.startswith(header)) :]
        assert table[2] == "| SQLite | 1,000 | 410 | 810 | 0.51 | 1.80 | 1.40 | - | - |"
        assert table[3] == "| SQLite | 100,000 | 410 | 890 | 0.46 | 1.80 | 1.40 | 60% / 85% | 30% / 11% |"
        assert not table[4].startswith("|")
        results = json.loads(report.results_json.read_text())["control_plane"]
        assert results["grpc_compose"]["sizes"][0]["cpu_at_32_clients"] is None
        before = results["grpc_compose_sqlite"]["sizes"][0]["cpu_at_32_clients"]["noop"]
        assert "server_busiest_thread_busy" not in before
        assert "server_busiest_thread_waiting_for_cpu" not in before
        cpu = results["grpc_compose_sqlite"]["sizes"][1]["cpu_at_32_clients"]
        assert cpu["compose"] == {
            "machine_cpu_us_per_call": pytest.approx(890.0),
            "busy_cores": pytest.approx(1.4),
            "server_busiest_thread_busy": pytest.approx(0.85),
            "server_busiest_thread_waiting_for_cpu": pytest.approx(0.11),
        }

    def test_links_the_plots(self, report: ReportFiles) -> None:
        text = report.results_md.read_text()
        for png in (report.unallocated_png, report.gpus_needed_png, report.control_plane_png):
            assert f"]({png.name})" in text


class TestPlots:
    """Each plot is a PNG of the expected size with something drawn on it."""

    @pytest.mark.parametrize(
        ("name", "size"),
        [("unallocated_png", (800, 1500)), ("gpus_needed_png", (450, 960)), ("control_plane_png", (450, 1200))],
    )
    def test_png(self, report: ReportFiles, name: str, size: tuple[int, int]) -> None:
        path: Path = getattr(report, name)
        assert path.read_bytes()[:8] == PNG_MAGIC
        image = imread(path)
        assert image.shape[:2] == size
        colours = {tuple(px) for px in image.reshape(-1, image.shape[2])[::7].tolist()}
        assert len(colours) > 50

    @pytest.mark.parametrize("published", [True, False])
    def test_published_line_only_with_published_figures(self, published: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        """The dashed FGD line is drawn on the fixed-server panel only when the replay has the published figures."""
        placement = placement_fixture()
        if not published:
            del placement["published"]
        legends: list[list[str]] = []

        def capture(figure: Figure, path: Path, **kwargs: object) -> None:
            legends.extend(
                [t.get_text() for t in ax.get_legend().get_texts()] for ax in figure.axes if ax.get_visible()
            )

        monkeypatch.setattr(Figure, "savefig", capture)
        report_plots.unallocated(parse_placement(placement), Path("unused.png"))
        marked = [labels for labels in legends if any(label.startswith("FGD published") for label in labels)]
        assert marked == ([legends[0]] if published else [])
        assert "FGD published 4.77%" in legends[0] or not published


class TestControlPlaneFiles:
    """The benchmarks' files: each absent one is an entry naming its command; a malformed one is an error."""

    def test_missing_files_name_their_commands(self, tmp_path: Path) -> None:
        empty = tmp_path / "nothing-here"
        files = write_report(placement_fixture(), tmp_path / "report", control_plane_dir=empty)
        control = json.loads(files.results_json.read_text())["control_plane"]
        assert set(control) == set(BENCHMARKS)
        assert all(entry["missing"] is True for entry in control.values())
        assert control["grpc_compose_sqlite"]["command"] == (
            "python bench/grpc_compose.py --ledger sqlite --devices 1000,10000,100000 "
            f"--out {empty / 'grpc_compose_sqlite.json'}"
        )
        text = files.results_md.read_text()
        assert f"`{control['grpc_compose']['command']}` writes it" in text
        assert f"`{control['placement']['command']}` writes it" in text

    def test_only_absent_files_are_missing(self, report: ReportFiles) -> None:
        control = json.loads(report.results_json.read_text())["control_plane"]
        assert {name for name, entry in control.items() if entry["missing"]} == {"grpc_models"}
        absent = report.results_json.parent.parent / "bench-out" / "grpc_models.json"
        assert control["grpc_models"]["command"] == f"python bench/grpc_models.py --out {absent}"

    def test_commands_are_those_tox_runs(self) -> None:
        tox = (ROOT / "tox.ini").read_text()
        bench = tox.split("[testenv:bench]", 1)[1].split("\n[", 1)[0]
        for name, (file_name, cmd) in BENCHMARKS.items():
            assert f"{cmd} --out bench/out/{file_name}" in bench, name

    def test_file_from_before_devices(self, tmp_path: Path, bench_out: Path) -> None:
        """A grpc_compose.json without ``sizes`` is read as the one size in its settings."""
        old = compose_bench("memory", 650.0, 900.0)["sizes"]["100000"]
        (bench_out / "grpc_compose.json").write_text(
            json.dumps({"settings": {"devices": 100_000, "ledger": "memory"}, **old})
        )
        files = write_report(placement_fixture(), tmp_path / "report", control_plane_dir=bench_out)
        sizes = json.loads(files.results_json.read_text())["control_plane"]["grpc_compose"]["sizes"]
        assert [s["devices"] for s in sizes] == [100_000]

    def test_grpc_models(self, tmp_path: Path, bench_out: Path) -> None:
        rows = [
            {"server": server, "handler": "noop", "concurrency": c, "calls_per_s": rate * c}
            for server, rate in (("sync", 1_000.0), ("aio", 1_100.0))
            for c in (1, 32)
        ]
        (bench_out / "grpc_models.json").write_text(json.dumps({"rows": rows}))
        files = write_report(placement_fixture(), tmp_path / "report", control_plane_dir=bench_out)
        models = json.loads(files.results_json.read_text())["control_plane"]["grpc_models"]
        assert models["calls_per_s"] == {
            "noop": {"1": {"sync": 1_000.0, "aio": 1_100.0}, "32": {"sync": 32_000.0, "aio": 35_200.0}}
        }

    @pytest.mark.parametrize(
        ("file_name", "content", "message"),
        [
            ("placement.json", '{"runs": {}}', "no key 'median_ratio_to_base'"),
            ("grpc_compose.json", '{"settings": {"ledger": "memory"}}', "no key 'devices'"),
            ("grpc_compose_sqlite.json", "not json", "JSONDecodeError"),
        ],
    )
    def test_malformed_file(self, tmp_path: Path, bench_out: Path, file_name: str, content: str, message: str) -> None:
        (bench_out / file_name).write_text(content)
        with pytest.raises(ValueError, match=rf"{file_name}: not the figures .*{message}"):
            write_report(placement_fixture(), tmp_path / "report", control_plane_dir=bench_out)
        assert not (tmp_path / "report").exists()


def mutate(path: list[str | int], value: object) -> dict[str, Any]:
    """The fixture with the key at ``path`` set to ``value``, or deleted when ``value`` is DELETE."""
    placement = copy.deepcopy(placement_fixture())
    target: Any = placement
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return placement


DELETE = object()


class TestValidation:
    """A replay dict with a missing key or a wrong shape is refused, naming the key, and nothing is written."""

    @pytest.mark.parametrize(
        ("path", "value", "message"),
        [
            (["trace"], DELETE, r"placement\.trace: missing"),
            (["trace", "gpus"], "6212", r"placement\.trace\.gpus: expected an integer, got str"),
            (["trace", "pods"], DELETE, r"placement\.trace\.pods: missing"),
            (["protocol", "seeds"], [], r"placement\.protocol\.seeds: at least one seed"),
            (["protocol", "seeds"], "0123", r"placement\.protocol\.seeds: expected a list, got str"),
            (["protocol", "inflation"], True, r"placement\.protocol\.inflation: expected a number, got bool"),
            (["published"], [0.0477], r"placement\.published: expected a mapping, got list"),
            (["published", "fgd"], None, r"placement\.published\.fgd: expected a number, got NoneType"),
            (["runs"], [], r"placement\.runs: at least one run"),
            (["runs", 0], "fixed", r"placement\.runs\[0\]: expected a mapping, got str"),
            (["runs", 2, "world"], "rack", r"placement\.runs\[2\]\.world: expected one of fixed, composable"),
            (["runs", 3, "k"], 0, r"placement\.runs\[3\]\.k: .* at least 1, got 0"),
            (["runs", 1, "policy"], DELETE, r"placement\.runs\[1\]\.policy: missing"),
            (["runs", 4, "unallocated", "std"], DELETE, r"placement\.runs\[4\]\.unallocated\.std: missing"),
            (
                ["runs", 4, "unallocated", "per_seed"],
                [0.05] * 9,
                r"placement\.runs\[4\]\.unallocated\.per_seed: expected one value per seed \(10\), got 9",
            ),
            (["runs", 5, "curve", "std"], [0.0], r"placement\.runs\[5\]\.curve\.std: 1 points against 131"),
            (["runs", 5, "curve", "arrived"], [], r"placement\.runs\[5\]\.curve\.arrived: the curve has no points"),
            (["runs", 6, "curve", "mean", 7], "x", r"placement\.runs\[6\]\.curve\.mean\[7\]: expected a number"),
            (["runs", 7, "gpus_needed", "max"], DELETE, r"placement\.runs\[7\]\.gpus_needed\.max: missing"),
            (["runs", 8, "seconds_per_seed"], DELETE, r"placement\.runs\[8\]\.seconds_per_seed: missing"),
        ],
    )
    def test_refused(self, tmp_path: Path, bench_out: Path, path: list[str | int], value: object, message: str) -> None:
        out = tmp_path / "report"
        with pytest.raises(ValueError, match=message):
            write_report(mutate(path, value), out, control_plane_dir=bench_out)
        assert not out.exists()

    def test_not_a_mapping(self, tmp_path: Path, bench_out: Path) -> None:
        with pytest.raises(ValueError, match=r"^placement: expected a mapping, got list$"):
            write_report([], tmp_path / "report", control_plane_dir=bench_out)  # type: ignore[arg-type]


class TestComposeBenchSizes:
    """bench/grpc_compose.py --devices measures each size in one run and keeps the largest size's figures on top."""

    def test_two_sizes(self, tmp_path: Path) -> None:
        out = tmp_path / "bench-out" / "grpc_compose.json"
        argv = sys.argv
        sys.argv = ["grpc_compose.py", "--devices", "400,200", "--seconds", "0.2", "--rounds", "1", "--out", str(out)]
        try:
            with pytest.raises(SystemExit) as exit_info:
                runpy.run_path(str(ROOT / "bench" / "grpc_compose.py"), run_name="__main__")
        finally:
            sys.argv = argv
        assert exit_info.value.code == 0
        figures = json.loads(out.read_text())
        assert figures["settings"]["sizes"] == [200, 400]
        assert figures["settings"]["devices"] == 400
        assert figures["settings"]["front_end_asked"] == "auto"
        assert figures["settings"]["front_end"] == "inline"  # auto keeps the in-memory ledger on one process
        assert {size["front_end"] for size in figures["sizes"].values()} == {"inline"}
        assert set(figures["sizes"]) == {"200", "400"}
        assert figures["rows"] == figures["sizes"]["400"]["rows"]
        for size in figures["sizes"].values():
            cpu_keys = {
                "busy_cores",
                "machine_cpu_us_per_call",
                "server_cpu_us_per_call",
                "client_cpu_us_per_call",
                "server_busiest_thread_cpu_us_per_call",
                "server_busiest_thread_busy",
            }
            for row in size["rows"]:
                measured = cpu_keys & row.keys()
                assert measured in (set(), cpu_keys), row
                assert all(row[key] > 0 for key in measured), row
                waited = row.get("server_busiest_thread_waiting_for_cpu")
                assert (waited is not None) == bool(measured), row
                if measured:  # one process: the composer's runs gRPC too
                    assert row["server_busiest_thread_process"] == "composer", row
                else:
                    assert "server_busiest_thread_process" not in row, row
                assert waited is None or 0.0 <= waited <= 1.0, row
            ratio = size["machine_cpu_ratio_at_32_clients"]
            assert (ratio is not None) == (len(size["machine_cpu_us_per_call_at_32_clients"]) == 2)
            assert ratio is None or ratio > 0
        hosts_at_200 = figures["sizes"]["200"]["max_calls_per_point"]
        assert all(row["calls"] <= hosts_at_200 for row in figures["sizes"]["200"]["rows"])
        files = write_report(placement_fixture(), tmp_path / "report", control_plane_dir=out.parent)
        sizes = json.loads(files.results_json.read_text())["control_plane"]["grpc_compose"]["sizes"]
        assert [s["devices"] for s in sizes] == [200, 400]

    def test_the_cpu_clock_counts_this_process_busy(self) -> None:
        """The clock reads real CPU from /proc: a thread that burns 0.3 s of CPU shows in the machine's count,
        the 'server' (this pid), its busiest thread and the client alike, each to within a few clock ticks."""
        bench = compose_bench_module()
        clock = bench["CpuClock"](os.getpid())

        def stolen() -> float:
            """CPU time the hypervisor took: the machine's busy count leaves it out, this process's does not."""
            return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8]) * clock.TICK_S

        burnt, read = threading.Event(), threading.Event()

        def burn() -> None:
            start = time.thread_time()
            while time.thread_time() - start < 0.3:
                sum(range(1000))
            burnt.set()
            read.wait(30)  # a thread that has ended is no longer in /proc: stay until the second reading

        before, stolen_before = clock.read(), stolen()
        burner = threading.Thread(target=burn)
        burner.start()
        assert burnt.wait(30)
        after, steal = clock.read(), stolen() - stolen_before
        read.set()
        burner.join()
        assert before is not None and after is not None
        wall, machine, server, client, busiest, waited, process = clock.spent(before, after)
        assert waited is not None and 0.0 <= waited <= wall
        assert process == "composer"
        slack = 3 * clock.TICK_S
        assert client >= 0.3
        assert server >= 0.3 - slack
        assert 0.3 - slack <= busiest <= server + slack
        assert machine + steal >= server - slack
        assert wall >= server - slack
        figures = bench["cpu_figures"]([(wall, machine, server, client, busiest, waited, process)], 100)
        assert figures["server_cpu_us_per_call"] == pytest.approx(server / 100 * 1e6)
        assert figures["busy_cores"] == pytest.approx(machine / wall)
        assert figures["server_busiest_thread_cpu_us_per_call"] == pytest.approx(busiest / 100 * 1e6)
        assert figures["server_busiest_thread_busy"] == pytest.approx(busiest / wall)
        assert figures["server_busiest_thread_waiting_for_cpu"] == pytest.approx(waited / wall)

    def test_the_clock_counts_the_server_children(self) -> None:
        """`disagg serve` runs gRPC in a child process (``--front-end process``): a child that burns 0.3 s of CPU
        counts in the server's CPU, its thread is the busiest, and the clock names it the front end's, which it
        knows by the module on its command line. Both ways of finding the children find it."""
        bench = compose_bench_module()
        burn = (
            "import os, time\nstart = time.thread_time()\n"
            "while time.thread_time() - start < 0.3: sum(range(1000))\n"
            "print(os.getpid(), flush=True)\ntime.sleep(30)"
        )
        child = [sys.executable, "-c", burn, bench["FRONT_END_MODULE"]]
        parent = subprocess.Popen(
            [sys.executable, "-c", f"import subprocess\nsubprocess.run({child!r})"], stdout=subprocess.PIPE, text=True
        )
        clock = bench["CpuClock"](parent.pid)
        child_pid = None
        try:
            before = clock.read()
            assert parent.stdout is not None
            child_pid = int(parent.stdout.readline())
            after = clock.read()
            front_end = clock.front_end()
            assert clock._descendants() == clock._descendants_by_parent() == [child_pid]
        finally:
            if child_pid is not None:
                os.kill(child_pid, signal.SIGKILL)
            parent.kill()
            parent.wait()
        assert front_end == "process"
        assert before is not None and after is not None
        sample = clock.spent(before, after)
        slack = 3 * clock.TICK_S
        assert sample[2] >= 0.3 - slack, sample
        assert 0.3 - slack <= sample[4] <= sample[2] + slack, sample
        assert sample[6] == "front end", sample
        assert bench["CpuClock"](os.getpid()).front_end() == "inline"

    def test_the_clock_sees_a_thread_wait_for_a_core(self) -> None:
        """A real wait: a process that computes on a core it shares with two others that compute too runs about a
        third of the time and waits for the core about two thirds; the clock finds both in Linux's accounts."""
        bench = compose_bench_module()
        burn = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: sum(range(1000))"
        procs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(3)]
        try:
            core = min(os.sched_getaffinity(0))
            for proc in procs:
                os.sched_setaffinity(proc.pid, {core})
            clock = bench["CpuClock"](procs[0].pid)
            time.sleep(0.3)
            before = clock.read()
            time.sleep(1.5)
            after = clock.read()
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        assert before is not None and after is not None
        wall, _, _, _, ran, waited, _ = clock.spent(before, after)
        assert waited is not None
        assert waited / wall >= 0.45, (ran, waited, wall)
        assert ran / wall <= 0.55, (ran, waited, wall)

    def test_the_busiest_thread_is_the_one_that_ran_most_in_between(self) -> None:
        """Threads that began before the first reading count only what they ran since, and what they waited for a
        core since; a thread that began in between counts all it ran and waited. The busiest thread is named by its
        process."""
        spent = compose_bench_module()["CpuClock"].spent
        owners = {"1": "composer", "2": "composer", "3": "front end"}
        before = (10.0, 100.0, 50.0, 5.0, {"1": 40.0, "2": 9.0}, {"1": 3.0, "2": 1.0}, owners)
        after = (11.0, 101.5, 51.0, 5.2, {"1": 40.7, "2": 9.1, "3": 0.2}, {"1": 3.2, "2": 1.0, "3": 0.05}, owners)
        assert spent(before, after)[:6] == pytest.approx((1.0, 1.5, 1.0, 0.2, 0.7, 0.2))
        assert spent(before, after)[6] == "composer"
        new_thread = (11.0, 101.5, 51.0, 5.2, {"3": 0.9}, {"3": 0.05}, owners)
        assert spent(before, new_thread)[:6] == pytest.approx((1.0, 1.5, 1.0, 0.2, 0.9, 0.05))
        assert spent(before, new_thread)[6] == "front end"
        assert spent(before, (11.0, 101.5, 51.0, 5.2, {}, {}, {}))[4:] == (0.0, None, None)

    def test_a_row_names_the_process_whose_busiest_threads_ran_longest(self) -> None:
        """Over a row's blocks, the busiest thread's process is the one whose busiest threads ran longest in all, not
        the one that was busiest in most blocks; the figures at 32 clients take the most frequent over the rounds."""
        bench = compose_bench_module()
        tick, least = bench["CpuClock"].TICK_S, bench["TICKS_PER_BLOCK_MIN"]
        block = (0.5, least * tick, least * tick / 2, 0.01)
        spent = [(*block, 0.1, None, "composer")] * 2 + [(*block, 0.3, None, "front end")]
        row = bench["cpu_figures"](spent, 50)
        assert row["server_busiest_thread_process"] == "front end"
        assert "server_busiest_thread_process" not in bench["cpu_figures"]([(*block, 0.0, None, None)], 50)
        rows = [
            {"rpc": rpc, "clients": clients, "round": r, "block_ratios": [1.0]}
            for r in range(3)
            for rpc in ("noop", "compose")
            for clients in (1, 32)
        ]
        names = ("front end", "composer", "front end", "composer", "composer", "front end")
        for row, name in zip(rows[1::2], names, strict=True):
            row.update(bench["cpu_figures"]([(*block, 0.3, None, name)], 50))
        processes = bench["figures"](rows, 3)["server_busiest_thread_process_at_32_clients"]
        assert processes == {"noop": "front end", "compose": "composer"}

    def test_a_wait_the_kernel_did_not_give_is_left_out(self) -> None:
        """Without the busiest thread's run-queue wait in both readings (a kernel without schedstats), its wait is
        None and the rows leave the figure out instead of counting zero."""
        bench = compose_bench_module()
        spent, cpu_figures = bench["CpuClock"].spent, bench["cpu_figures"]
        before = (10.0, 100.0, 50.0, 5.0, {"1": 40.0}, {}, {"1": "composer"})
        after = (11.0, 101.5, 51.0, 5.2, {"1": 40.7}, {"1": 3.2}, {"1": "composer"})
        assert spent(before, after)[5] is None
        assert spent(after, before)[5] is None
        tick, least = bench["CpuClock"].TICK_S, bench["TICKS_PER_BLOCK_MIN"]
        measured = (0.5, least * tick, least * tick / 2, 0.01, least * tick / 4, 0.1, "composer")
        assert cpu_figures([measured] * 2, 50)["server_busiest_thread_waiting_for_cpu"] == pytest.approx(0.2)
        lacking = (*measured[:5], None, "composer")
        assert "server_busiest_thread_waiting_for_cpu" not in cpu_figures([measured, lacking], 50)

    def test_cpu_figures_too_few_ticks_are_left_out(self) -> None:
        """A block shorter than the clock can count gives no CPU figures, never a zero that a ratio divides by."""
        bench = compose_bench_module()
        tick, least = bench["CpuClock"].TICK_S, bench["TICKS_PER_BLOCK_MIN"]
        cpu_figures = bench["cpu_figures"]
        assert cpu_figures([(0.04, 0.0, 0.0, 0.01, 0.0, 0.0, "composer")] * 5, 25) == {}
        assert cpu_figures([(0.04, (least - 1) * tick, tick, 0.01, tick, 0.0, "composer")] * 5, 25) == {}
        assert cpu_figures([], 25) == {} and cpu_figures([(1.0, 1.0, 0.5, 0.1, 0.4, 0.1, "composer")], 0) == {}
        enough = cpu_figures([(0.5, least * tick, least * tick / 2, 0.01, least * tick / 4, None, "composer")] * 5, 50)
        assert enough["machine_cpu_us_per_call"] == pytest.approx(5 * least * tick / 50 * 1e6)
        assert enough["busy_cores"] == pytest.approx(least * tick / 0.5)
        assert enough["server_busiest_thread_busy"] == pytest.approx(least * tick / 4 / 0.5)
        rows = [
            {"rpc": rpc, "clients": clients, "round": 0, "block_ratios": [1.0]}
            for rpc in ("noop", "compose")
            for clients in (1, 32)
        ]
        rows[1].update(enough)
        unmeasured = bench["figures"](rows, 1)
        assert unmeasured["machine_cpu_ratio_at_32_clients"] is None
        assert unmeasured["machine_cpu_us_per_call_at_32_clients"].keys() == {"noop"}
        assert unmeasured["server_busiest_thread_waiting_for_cpu_at_32_clients"] == {}

    def test_the_front_end_asked_for(self, tmp_path: Path, capsys: pytest.CaptureFixture[str], front_end: str) -> None:
        """--front-end goes to disagg serve; the file and the summary say which ran, and with a front end in a
        process the clock reads the threads of both processes, each named by its process."""
        bench = compose_bench_module()
        proc, _ = bench["start_server"](200, tmp_path, "sqlite", front_end)
        try:
            clock = bench["CpuClock"](proc.pid)
            reading = clock.read()
            assert clock.front_end() == front_end
        finally:
            bench["stop_server"](proc)
        assert reading is not None
        expected = {"front end", "composer"} if front_end == "process" else {"composer"}
        assert set(reading[6].values()) == expected
        assert set(reading[6]) == set(reading[4])
        out = tmp_path / "grpc_compose.json"
        argv = ["--ledger", "sqlite", "--front-end", front_end, "--devices", "200", "--seconds", "0.2", "--rounds", "1"]
        assert bench["main"]([*argv, "--out", str(out)]) == 0
        settings = json.loads(out.read_text())["settings"]
        assert (settings["front_end"], settings["front_end_asked"]) == (front_end, front_end)
        assert f"200 devices, front end {front_end}: " in capsys.readouterr().out

    def test_bad_device_counts(self, capsys: pytest.CaptureFixture[str]) -> None:
        main = compose_bench_module()["main"]
        for bad in ("1000,lots", "0,1000"):
            with pytest.raises(SystemExit) as exit_info:
                main(["--devices", bad])
            assert exit_info.value.code == 2
            assert "--devices" in capsys.readouterr().err
