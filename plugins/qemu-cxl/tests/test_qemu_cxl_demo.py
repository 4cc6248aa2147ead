"""`disagg demo --fabric qemu-cxl`: composes CXL memory to a QEMU host and shows it, and an independent look over
QMP finds the Type-3 device on that host's switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from disagg.cli.main import main
from qemu_cxl_helpers import MiB, RawQMP, require_qemu


def test_demo_composes_memory_that_qmp_finds_on_the_switch(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_qemu()
    config = tmp_path / "disagg.toml"
    config.write_text(
        "[[fabric]]\n"
        'name = "qemu"\n'
        'driver = "qemu-cxl"\n'
        f'options = {{ state_dir = "{state_dir}", pool_bytes = 2147483648, '
        'hosts = [{ name = "h1", ports = 2, memory = "256M" }] }\n'
    )
    code = main(["demo", "--fabric", "qemu-cxl", "--config", str(config), "--memory", "512MiB", "--keep", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    shown = json.loads(out)
    assert shown["composition"]["host"] == "h1" and shown["driver_view_released"] is None
    ((what, pool, size),) = shown["driver_view_composed"]
    assert (what, size) == ("allocation", "512 MiB") and pool.startswith("qemu/cxl-pool")
    with RawQMP(state_dir, "h1") as qmp:
        (device,) = qmp.type3().values()
    assert device["port"].startswith("dsp") and device["size"] == 512 * MiB
