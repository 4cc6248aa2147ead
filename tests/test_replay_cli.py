"""The placement study (disagg.replay.study) in worker processes, and ``disagg bench placement`` around it."""

from __future__ import annotations

import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import disagg.replay
import disagg.replay.study as study_module
import pytest
from disagg.cli.main import main
from disagg.errors import InvalidRequestError
from disagg.replay.engine import replay
from disagg.replay.policies import BestFitSharing
from disagg.replay.report_input import parse_placement
from disagg.replay.study import DEFAULT_POLICIES, PUBLISHED, Study, check_trace, run_study
from disagg.replay.trace import DEFAULT_NODES, DEFAULT_PODS, TRACE_SUBDIR, Pod, trace_dir
from disagg.replay.workload import arrivals, task_types
from disagg.replay.world import build_world
from replay_helpers import GIB, gpu_node, pod, share, small_cluster, whole, write_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A shared data directory holding the small synthetic trace."""
    write_trace(tmp_path / "shared", *small_cluster())
    return tmp_path / "shared"


class TestRunStudy:
    """Every (K, policy, seed) job runs in a worker process and sums up into the dict the report takes."""

    def test_study(self, shared: Path) -> None:
        lines: list[str] = []
        study = Study(trace_dir=trace_dir(shared), seeds=(0, 1), ks=(1, 4), workers=1)
        placement = run_study(study, progress=lines.append)
        parsed = parse_placement(placement)
        assert [(r.k, r.world, r.policy) for r in parsed.runs] == [
            (k, world, policy) for k, world in ((1, "fixed"), (4, "composable")) for policy in DEFAULT_POLICIES
        ]
        for run in parsed.runs:
            assert len(run.unallocated.per_seed) == 2
            assert all(0.0 <= u <= 1.0 for u in run.unallocated.per_seed)
            assert run.gpus_needed is not None and len(run.gpus_needed.per_seed) == 2
            assert all(0 < g <= 2 * 80 for g in run.gpus_needed.per_seed)
            assert run.curve.arrived[0] == 0.0 and run.curve.arrived[100] == 1.0
        assert parsed.floor is not None and len(parsed.floor.per_seed) == 2
        assert all(
            f <= min(r.unallocated.per_seed[i] for r in parsed.runs) for i, f in enumerate(parsed.floor.per_seed)
        )
        assert parsed.seeds == (0, 1) and parsed.published == {}  # the default names, not the published lists
        assert placement["trace"] | {"dir": ""} == {
            "dir": "",
            "nodes": DEFAULT_NODES,
            "pods": DEFAULT_PODS,
            "gpus": 80,
            "nodes_count": 20,
            "pods_count": 60,
        }
        assert len(lines) == 12 and lines[0].startswith("[1/12] K=4 ")

    def test_fixed_world_always_runs(self, shared: Path) -> None:
        study = Study(trace_dir=trace_dir(shared), seeds=(0,), ks=(2,), policies=("best-fit",), provision=False)
        runs = run_study(study)["runs"]
        assert [(r["k"], r["world"], r["gpus_needed"]) for r in runs] == [(1, "fixed", None), (2, "composable", None)]

    def test_seeds_whose_curves_differ_in_length(self, shared: Path) -> None:
        nodes, pods = small_cluster()
        lengths = set()
        for seed in (0, 1):
            world = build_world(nodes, 1)
            policy = BestFitSharing()
            policy.prepare(task_types(pods), world)
            drawn = arrivals(pods, world.capacity_milli, seed, 1.3)
            lengths.add(len(replay(world, drawn, policy, seed=seed).curve))
        # The last pod drawn may cross more than one 1% step on a small cluster: seed 0 ends at 131%, seed 1 at 130%.
        assert lengths == {131, 132}
        study = Study(trace_dir=trace_dir(shared), seeds=(0, 1), ks=(1,), policies=("best-fit",), provision=False)
        curve = run_study(study)["runs"][0]["curve"]
        assert len(curve["arrived"]) == len(curve["mean"]) == len(curve["std"]) == 131

    def test_the_first_failed_job_stops_the_study(self, shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The jobs still queued are cancelled, rather than run to the end before the error is raised."""
        ran: list[tuple[int, str, int]] = []

        def job(study: Study, k: int, policy: str, seed: int) -> dict[str, object]:
            if seed == 0:
                raise InvalidRequestError("job 0 failed")
            ran.append((k, policy, seed))
            time.sleep(0.2)
            return {}

        class InThreads(ThreadPoolExecutor):
            def __init__(self, max_workers: int, mp_context: object) -> None:
                super().__init__(max_workers)

        monkeypatch.setattr(study_module, "ProcessPoolExecutor", InThreads)
        monkeypatch.setattr(study_module, "run_job", job)
        study = Study(trace_dir=trace_dir(shared), seeds=tuple(range(6)), ks=(1,), policies=("best-fit",), workers=1)
        with pytest.raises(InvalidRequestError, match="job 0 failed"):
            run_study(study)
        assert len(ran) <= 1

    @pytest.mark.parametrize(
        ("change", "published"),
        [
            ({}, PUBLISHED),
            ({"nodes": "other-nodes.csv"}, None),
            ({"pods": DEFAULT_PODS.replace("default", "multigpu50")}, None),
            ({"inflation": 1.2}, None),
            ({"report_at": 0.9}, None),
            ({"seeds": (3, 7), "ks": (1, 2), "policies": ("best-fit",), "provision": False}, PUBLISHED),
        ],
    )
    def test_published_only_for_the_published_protocol(
        self, alibaba_trace: Path, change: dict[str, object], published: dict[str, float] | None
    ) -> None:
        """The paper's figures are the reference for its trace and protocol, and for nothing else."""
        study = Study(trace_dir=alibaba_trace, **change)  # type: ignore[arg-type]
        assert study_module.published_reference(study) == published

    def test_no_published_figures_for_other_lists_under_the_published_names(self, shared: Path) -> None:
        """A team's own trace saved as openb_node_list_gpu_node.csv and openb_pod_list_default.csv is not the
        trace the figures were measured on."""
        assert study_module.published_reference(Study(trace_dir=trace_dir(shared))) is None

    def test_published_figures_for_the_published_lists_under_other_names(
        self, alibaba_trace: Path, tmp_path: Path
    ) -> None:
        shutil.copyfile(alibaba_trace / DEFAULT_NODES, tmp_path / "nodes.csv")
        shutil.copyfile(alibaba_trace / DEFAULT_PODS, tmp_path / "pods.csv")
        study = Study(trace_dir=tmp_path, nodes="nodes.csv", pods="pods.csv")
        assert study_module.published_reference(study) == PUBLISHED

    def test_no_published_figures_for_another_trace(self, shared: Path) -> None:
        directory = trace_dir(shared)
        (directory / "other.csv").write_bytes((directory / DEFAULT_PODS).read_bytes())
        study = Study(trace_dir=directory, pods="other.csv", seeds=(0,), ks=(1,), policies=("fgd",), provision=False)
        placement = run_study(study)
        assert "published" not in placement
        assert parse_placement(placement).published == {}

    def test_gpu_spec_naming_no_model_of_the_node_list(self, tmp_path: Path) -> None:
        """Refused with provisioning or without: the pods would fail everywhere, counted as GPUs unallocated."""
        nodes, pods = small_cluster()
        typos = [Pod(f"typo-{i}", 1000, GIB, 1, 500, frozenset({"A", "C"})) for i in range(5)]
        other = Pod("other", 1000, GIB, 1, 1000, frozenset({"B-32G"}))
        with pytest.raises(InvalidRequestError) as caught:
            check_trace(Study(trace_dir=tmp_path, provision=False), nodes, [*pods, *typos, other])
        assert caught.value.message == (
            f"the gpu_spec of {DEFAULT_PODS} names GPU models no server of {DEFAULT_NODES} has: B-32G (pod other); "
            "C (pods typo-0, typo-1, typo-2 and 2 more); its models are A, B"
        )

    def test_too_many_arrivals(self, tmp_path: Path) -> None:
        """Refused before any job starts, rather than in every job after a million draws."""
        pods = [share(10), *[pod()] * 999]
        with pytest.raises(InvalidRequestError, match=r"the arrivals would take about 1,040,000 pods, over the limit"):
            check_trace(Study(trace_dir=tmp_path, provision=False), [gpu_node(8)], pods)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"seeds": ()}, "at least one seed"),
            ({"ks": (0, 4)}, "at least 1"),
            ({"policies": ()}, "at least one policy"),
            ({"policies": ("fgd", "nope")}, r"no sharing policy nope \(known: best-fit, fgd, frag-balance"),
            ({"report_at": 1.5}, "must lie within the arrivals"),
            ({"workers": -1}, r"worker processes must be 0 \(one per CPU\) or more, got -1"),
            ({"seeds": (3, -1, 2)}, r"a seed must be 0 or more, got -1"),
            ({"seeds": (1, 2, 1)}, r"seed 1 is given twice"),
            ({"policies": ("fgd", "best-fit", "fgd")}, r"policy fgd is given twice"),
        ],
    )
    def test_check(self, tmp_path: Path, change: dict[str, object], message: str) -> None:
        with pytest.raises(InvalidRequestError, match=message):
            Study(trace_dir=tmp_path, **change).check()  # type: ignore[arg-type]


class TestBenchPlacement:
    """``disagg bench placement`` writes the report, and refuses bad input with exit code 2."""

    def args(self, shared: Path, *more: str) -> list[str]:
        out = shared.parent / "out"
        return [
            "bench",
            "placement",
            "--shared",
            str(shared),
            "--report-dir",
            str(out),
            "--control-plane-dir",
            str(shared.parent / "none"),
            "--quiet",
            "--workers",
            "2",
            *more,
        ]

    def test_writes_the_report(self, shared: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main([*self.args(shared, "--seeds", "2", "--k", "1,2"), "--json"]) == 0
        captured = capsys.readouterr()
        out = shared.parent / "out"
        assert json.loads(captured.out) == {"results": str(out / "results.json"), "markdown": str(out / "results.md")}
        assert captured.err == ""
        results = json.loads((out / "results.json").read_text(encoding="utf-8"))
        placement = parse_placement(results["placement"])
        assert placement.seeds == (0, 1)
        assert {(r.k, r.policy) for r in placement.runs} == {(k, p) for k in (1, 2) for p in DEFAULT_POLICIES}
        assert (out / "results.md").read_text(encoding="utf-8").strip()
        pngs = sorted(out.glob("*.png"))
        assert [p.name for p in pngs] == ["control_plane.png", "gpus_needed.png", "unallocated.png"]
        assert all(p.read_bytes().startswith(PNG_MAGIC) for p in pngs)

    def test_missing_trace(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(self.args(tmp_path / "empty")) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"disagg: error: {DEFAULT_NODES}, {DEFAULT_PODS} not found in {tmp_path / 'empty'}")
        assert "github.com/alibaba/clusterdata" in err
        assert not (tmp_path / "out").exists()

    def test_missing_list_of_the_users_own(self, shared: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """The message names --shared, which chose the directory, and gives no hint to fetch the Alibaba trace."""
        assert main(self.args(shared, "--pods", "mine.csv")) == 2
        assert capsys.readouterr().err == (
            f"disagg: error: mine.csv not found in {shared / TRACE_SUBDIR} (the shared data directory given by "
            f"--shared {shared})\n"
        )

    def test_count_out_of_range(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A row error (exit 2), not an overflow in the replay's arrays."""
        directory = write_trace(tmp_path / "shared", *small_cluster())
        pods = directory / DEFAULT_PODS
        with pods.open("a", encoding="utf-8") as handle:
            handle.write("big,99999999999999999999999,1024,1,1000,\n")
        assert main(self.args(tmp_path / "shared", "--no-provision")) == 2
        assert capsys.readouterr().err == (
            f"disagg: error: {DEFAULT_PODS}:62: cpu_milli must be at most 1099511627776, got 99999999999999999999999\n"
        )

    def test_gpu_spec_naming_no_model_without_provisioning(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        nodes, pods = small_cluster()
        write_trace(tmp_path / "shared", nodes, [*pods, whole(1, spec={"V100-32G"})])
        assert main(self.args(tmp_path / "shared", "--no-provision", "--seeds", "1", "--k", "1")) == 2
        assert capsys.readouterr().err.startswith(
            f"disagg: error: the gpu_spec of {DEFAULT_PODS} names GPU models no server of {DEFAULT_NODES} has: "
            "V100-32G (pod p); "
        )

    def test_unknown_policy(self, shared: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(self.args(shared, "--policies", "fgd,nope")) == 2
        assert "no sharing policy nope (known: best-fit, fgd, frag-balance" in capsys.readouterr().err

    def test_report_dir_it_cannot_write(self, shared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        args = self.args(shared)
        args[args.index("--report-dir") + 1] = str(blocker / "out")
        assert main(args) == 2
        assert (
            f"disagg: error: cannot write the report into {blocker / 'out'}: Not a directory" in capsys.readouterr().err
        )

    @pytest.mark.parametrize("option", [["--seeds", "0"], ["--seeds", "x"], ["--k", "x"], ["--k", ","]])
    def test_bad_arguments(self, shared: Path, option: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as caught:
            main(self.args(shared, *option))
        assert caught.value.code == 2
        assert f"argument {option[0]}" in capsys.readouterr().err

    def test_seed_list(self, shared: Path) -> None:
        assert main(self.args(shared, "--seeds", "3,7", "--k", "1", "--policies", "best-fit", "--no-provision")) == 0
        placement = json.loads((shared.parent / "out" / "results.json").read_text(encoding="utf-8"))["placement"]
        assert placement["protocol"]["seeds"] == [3, 7]
        assert [r["gpus_needed"] for r in placement["runs"]] == [None]
        markdown = (shared.parent / "out" / "results.md").read_text(encoding="utf-8")
        assert "Every placement figure is the mean of 2 seeds (3, 7) with" in markdown

    @pytest.fixture
    def no_replay(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The replay must not start: input found wrong after it would have cost the whole study."""

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("the replay ran")

        monkeypatch.setattr(study_module, "run_study", refuse)

    @pytest.mark.usefixtures("no_replay")
    def test_malformed_control_plane_file(self, shared: Path, capsys: pytest.CaptureFixture[str]) -> None:
        control_plane = shared.parent / "none"
        control_plane.mkdir()
        (control_plane / "placement.json").write_text('{"runs": {}}\n')
        assert main(self.args(shared)) == 2
        assert capsys.readouterr().err == (
            f"disagg: error: {control_plane / 'placement.json'}: not the figures python bench/placement.py writes "
            "(no key 'median_ratio_to_base')\n"
        )
        assert not (shared.parent / "out" / "results.json").exists()

    @pytest.mark.usefixtures("no_replay")
    def test_report_dir_that_exists_but_takes_no_file(self, shared: Path, capsys: pytest.CaptureFixture[str]) -> None:
        args = self.args(shared)
        args[args.index("--report-dir") + 1] = "/proc"  # even root cannot create a file there
        assert main(args) == 2
        assert capsys.readouterr().err.startswith("disagg: error: cannot write the report into /proc: ")

    @pytest.mark.usefixtures("no_replay")
    @pytest.mark.parametrize(
        "flag", ["--shared", "--report-dir", "--control-plane-dir", "--nodes", "--pods", "--policies"]
    )
    def test_an_empty_value(
        self, shared: Path, flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Most often ``--report-dir "$DIR"`` with DIR unset: ``--report-dir ""`` ran the study to write the report
        into the working folder, ``--control-plane-dir ""`` read it for figures, ``--shared ""`` fell back to the
        default directory, and ``--nodes ""`` said " not found". Refused before the replay, nothing written."""
        work = shared.parent / "work"
        work.mkdir()
        monkeypatch.chdir(work)
        assert main(self.args(shared, flag, "")) == 2
        said = capsys.readouterr().err
        assert said.startswith(f"disagg: error: {flag} is empty (was it a variable left unset?)"), said
        assert list(work.iterdir()) == [] and not (shared.parent / "out").exists()

    @pytest.mark.parametrize("policies", ["best-fit,,fgd", "fgd,", ",fgd"])
    def test_an_empty_policy_name(self, shared: Path, policies: str, capsys: pytest.CaptureFixture[str]) -> None:
        """It said "no sharing policy  (known: ...)", naming nothing."""
        assert main(self.args(shared, f"--policies={policies}")) == 2
        said = capsys.readouterr().err
        assert said.startswith(f"disagg: error: --policies {policies!r} names an empty policy"), said

    def test_negative_seed(self, shared: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(self.args(shared, "--seeds=-1,2")) == 2
        assert capsys.readouterr().err == "disagg: error: a seed must be 0 or more, got -1\n"

    def test_pod_list_without_gpu_pods(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        nodes, pods = small_cluster()
        write_trace(tmp_path / "shared", nodes, [p for p in pods if not p.num_gpu])
        assert main(self.args(tmp_path / "shared")) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"disagg: error: {DEFAULT_PODS} has no GPU pod, so ")
        assert "Traceback" not in err

    def test_pod_no_server_can_hold(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        nodes, pods = small_cluster()
        big = Pod("too-big", 1000, 1024, 16, 1000)
        write_trace(tmp_path / "shared", nodes, [*pods, big])
        assert main(self.args(tmp_path / "shared")) == 2
        assert capsys.readouterr().err == (
            f"disagg: error: no server of {DEFAULT_NODES} can hold pod too-big (16 whole GPUs, 1000 mCPU, "
            "1024 MiB), so the provisioning replay on fixed servers could never place it: take it out of the pod "
            "list, or skip that replay with --no-provision\n"
        )

    def test_without_the_report_extra(
        self, shared: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
            monkeypatch.setitem(sys.modules, name, None)  # as if matplotlib were not installed
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        for name in ("report", "report_plots"):  # imported by another test: both the module and its name go
            monkeypatch.delitem(sys.modules, f"disagg.replay.{name}", raising=False)
            monkeypatch.delattr(disagg.replay, name, raising=False)
        assert main(self.args(shared)) == 2
        assert capsys.readouterr().err == (
            "disagg: error: the report's plots need matplotlib, which the report extra installs: "
            "pip install 'disagg[report]'\n"
        )
