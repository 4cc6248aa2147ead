"""Regenerate the Python code of the wire contract, or check that the committed code is current.

The proto package path equals the Python import path (``disagg.fabric.v1`` lives in
``sdk/disagg/fabric/v1``), so nothing rewrites imports. Generated modules (``*_pb2.py``, ``*_pb2_grpc.py`` and
mypy-protobuf ``.pyi`` stubs) are committed and kept out of lint; ``--check`` regenerates into a temporary
directory and fails on any difference. Run: ``python proto/generate.py [--check]`` (``tox -e proto`` does).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "sdk"
PACKAGES = ("disagg/fabric/v1", "disagg/driver/v1")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _generated(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p for pkg in PACKAGES for p in (root / pkg).glob("*") if p.name.endswith(SUFFIXES)
    }


def generate(out: Path) -> None:
    sources = sorted(str(p.relative_to(PROTO)) for pkg in PACKAGES for p in (PROTO / pkg).glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    scripts = sysconfig.get_path("scripts")
    os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])
    args = [
        "protoc",
        f"-I{PROTO}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *sources,
    ]
    cwd = os.getcwd()
    os.chdir(PROTO)
    try:
        code = protoc.main(args)
    finally:
        os.chdir(cwd)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    for pkg in PACKAGES:
        for level in range(1, len(pkg.split("/")) + 1):
            init = out / "/".join(pkg.split("/")[:level]) / "__init__.py"
            if not init.exists() and init.parent != out / "disagg":
                init.write_text('"""Generated from proto/ by proto/generate.py; do not edit."""\n')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code differs from a fresh run")
    args = parser.parse_args(argv)
    if not args.check:
        for path in _generated(OUT).values():
            path.unlink()
        generate(OUT)
        print(f"generated {len(_generated(OUT))} files under {OUT}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        (fresh_root / "disagg").mkdir()
        generate(fresh_root)
        fresh, committed = _generated(fresh_root), _generated(OUT)
        stale = sorted(set(fresh) ^ set(committed))
        stale += sorted(n for n in set(fresh) & set(committed) if not filecmp.cmp(fresh[n], committed[n], shallow=False))
        if stale:
            print("generated code is not current; run python proto/generate.py:", *stale, sep="\n  ", file=sys.stderr)
            return 1
    print(f"generated code is current ({len(committed)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
