"""``disagg bench placement``: replay the Alibaba GPU trace under each placement policy and world, and write the
report (results.json, results.md, PNG plots) with the control-plane benchmarks' figures beside it.

The trace is read from the shared data directory (``--shared``, ``$DISAGG_SHARED_DIR``, default ``../shared``);
without it the command says what to fetch and exits with 2. Exit codes: 0 written; 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from disagg.errors import InvalidRequestError

DEFAULT_REPORT_DIR = "bench"
DEFAULT_CONTROL_PLANE_DIR = "bench/out"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _seeds(text: str) -> tuple[int, ...]:
    """``10`` is seeds 0 to 9; ``3,7`` are those two."""
    values = _ints(text)
    if "," not in text:
        if values[0] < 1:
            raise argparse.ArgumentTypeError(f"the number of seeds must be at least 1, got {values[0]}")
        return tuple(range(values[0]))
    return values


EMPTY_MEANS = {
    "shared": "leave --shared out for $DISAGG_SHARED_DIR, else ../shared",
    "nodes": "leave --nodes out for the trace's own node list",
    "pods": "leave --pods out for the trace's own pod list",
    "policies": "leave --policies out for every sharing policy",
    "report_dir": f"leave --report-dir out to write into ./{DEFAULT_REPORT_DIR}",
    "control_plane_dir": f"leave --control-plane-dir out to read ./{DEFAULT_CONTROL_PLANE_DIR}",
}
"""What leaving out each option that names a file, a directory or policies does, said when one is given empty."""


def _refuse_empty(args: argparse.Namespace) -> None:
    """Refuse an option given empty, most often ``--report-dir "$DIR"`` with DIR unset: ``--report-dir ""`` ran the
    whole study to write the report into the working folder, and ``--shared ""`` read the default directory."""
    for key, instead in EMPTY_MEANS.items():
        if getattr(args, key) == "":
            flag = "--" + key.replace("_", "-")
            raise InvalidRequestError(
                f"{flag} is empty (was it a variable left unset?): give its value, or {instead}", field=key
            )


def cmd_placement(args: argparse.Namespace) -> int:
    _refuse_empty(args)
    try:
        from disagg.replay.report import write_report
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise
        raise InvalidRequestError(
            "the report's plots need matplotlib, which the report extra installs: pip install 'disagg[report]'",
            field="report",
        ) from e
    from disagg.replay.report_control import collect
    from disagg.replay.study import Study, run_study
    from disagg.replay.trace import missing_trace_reason, shared_origin, trace_dir

    shared = Path(args.shared) if args.shared else None
    directory = trace_dir(shared)
    missing = missing_trace_reason(directory, (args.nodes, args.pods), origin=shared_origin(shared))
    if missing:
        raise InvalidRequestError(missing, field="shared")
    policies = tuple(args.policies.split(","))
    if "" in policies:
        raise InvalidRequestError(
            f"--policies {args.policies!r} names an empty policy (two commas in a row, or one at an end): give "
            "sharing policies by name, separated by single commas",
            field="policies",
        )
    study = Study(
        trace_dir=directory,
        nodes=args.nodes,
        pods=args.pods,
        seeds=args.seeds,
        ks=args.k,
        policies=policies,
        provision=not args.no_provision,
        workers=args.workers,
    )

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    study.check()
    # The benchmarks' files and the report directory are checked before the replay, which takes minutes: either
    # found wrong after it would cost the whole study.
    control_plane_dir = Path(args.control_plane_dir)
    try:
        collect(control_plane_dir)
    except ValueError as e:
        raise InvalidRequestError(str(e), field="control-plane-dir") from e
    report_dir = Path(args.report_dir)
    _check_writable(report_dir)
    placement = run_study(study, progress=progress)
    try:
        files = write_report(placement, report_dir, control_plane_dir=control_plane_dir)
    except OSError as e:
        raise InvalidRequestError(f"cannot write the report into {report_dir}: {e.strerror}", field="report-dir") from e
    if args.json:
        print(json.dumps({"results": str(files.results_json), "markdown": str(files.results_md)}))
    else:
        print(files.results_md.read_text(encoding="utf-8"))
    return 0


def _check_writable(directory: Path) -> None:
    """Make ``directory`` and write a file into it: an existing directory may still refuse files."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as e:
        raise InvalidRequestError(f"cannot write the report into {directory}: {e.strerror}", field="report-dir") from e


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    about = "benchmarks"
    bench = sub.add_parser("bench", help=about, description=about)
    commands = bench.add_subparsers(dest="bench_command", required=True)
    about = (
        "replay the Alibaba GPU trace (fixed servers and composable fabric domains, each placement policy) and "
        "write the performance report"
    )
    p = commands.add_parser("placement", help=about, description=about)
    p.add_argument("--shared", help="the shared data directory (default: $DISAGG_SHARED_DIR, else ../shared)")
    p.add_argument("--nodes", default="openb_node_list_gpu_node.csv", help="the node list in the trace directory")
    p.add_argument("--pods", default="openb_pod_list_default.csv", help="the pod list in the trace directory")
    p.add_argument("--seeds", type=_seeds, default=tuple(range(10)), help="a count (10: seeds 0-9) or a list 3,7")
    p.add_argument("--k", type=_ints, default=(1, 4, 8, 16), help="hosts per fabric domain (1: fixed servers)")
    p.add_argument("--policies", default="best-fit,fgd,frag-balance", help="sharing policies, comma-separated")
    p.add_argument("--no-provision", action="store_true", help="skip the GPUs-needed replay")
    p.add_argument("--workers", type=int, default=0, help="worker processes (default: one per CPU)")
    p.add_argument("--report-dir", default=DEFAULT_REPORT_DIR, help="where results.json, results.md and the PNGs go")
    p.add_argument(
        "--control-plane-dir",
        default=DEFAULT_CONTROL_PLANE_DIR,
        help="where the protocol and state benchmarks wrote their JSON (default: bench/out)",
    )
    p.add_argument("--json", action="store_true", help="print the written files as JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_placement)
