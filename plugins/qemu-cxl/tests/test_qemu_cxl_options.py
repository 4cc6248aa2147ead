"""Option validation: every mistake is a ConfigError that names the fabric and the option (no QEMU needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from disagg.errors import ConfigError, ConflictError
from disagg_qemu_cxl import create_fabric, parse_options
from disagg_qemu_cxl.command import command_line
from disagg_qemu_cxl.hosts import HostProcess
from disagg_qemu_cxl.options import HostOptions, memory_bytes
from disagg_qemu_cxl.qmp import Loop
from disagg_qemu_cxl.state import Record
from qemu_cxl_helpers import GiB, MiB


def valid(**extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"state_dir": "/tmp/x", "hosts": [{"name": "h1"}]}
    base.update(extra)
    return base


def boot_files(directory: Path, *names: str) -> list[str]:
    """Files for a host to boot (kernel, initrd): they must exist when the options are read."""
    paths = [directory / name for name in names]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0")
    return [str(p) for p in paths]


class TestParseOptions:
    """Valid options parse to their values and defaults; each invalid one names itself and the fabric."""

    def test_defaults(self) -> None:
        opts = parse_options("f", valid())
        assert opts.state_dir == Path("/tmp/x")
        assert opts.pool_bytes == 4 * GiB
        assert opts.qemu == "qemu-system-x86_64"
        assert opts.stop_hosts_on_close is False
        assert opts.hosts == (HostOptions("h1", ports=4, memory="1G"),)

    def test_a_booting_host(self, tmp_path: Path) -> None:
        kernel, initrd = boot_files(tmp_path, "k", "i")
        host = {"name": "g", "kernel": kernel, "initrd": initrd, "append": "console=ttyS0", "serial": ["file:/c.log"]}
        (h,) = parse_options("f", valid(hosts=[host])).hosts
        assert h.boots and h.serial == ("file:/c.log",) and h.append == "console=ttyS0"

    @pytest.mark.parametrize(
        ("memory", "size"),
        [("512M", 512 * MiB), ("512m", 512 * MiB), ("1.5G", 1536 * MiB), ("2g", 2 * GiB), ("64", 64 * MiB)],
    )
    def test_memory_as_qemu_takes_it(self, memory: str, size: int) -> None:
        """As -m reads it: a plain number is MiB; the host reports the bytes."""
        assert parse_options("f", valid(hosts=[{"name": "h1", "memory": memory}])).hosts[0].memory == memory
        assert memory_bytes(memory) == size

    def test_relative_files_are_the_callers(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """QEMU opens them from the host's directory; a relative path means the caller's, as state_dir does."""
        monkeypatch.chdir(tmp_path)
        boot_files(tmp_path, "vmlinuz", "boot/initrd.img")
        host = {"name": "g", "kernel": "vmlinuz", "initrd": "boot/initrd.img", "append": "console=ttyS0"}
        (h,) = parse_options("f", valid(state_dir="state", hosts=[host])).hosts
        assert (h.kernel, h.initrd, h.append) == (
            str(tmp_path / "vmlinuz"),
            str(tmp_path / "boot/initrd.img"),
            host["append"],
        )

    def test_a_relative_qemu_is_the_callers(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """QEMU is run from the host's directory: a relative path is made absolute, a bare name is left to PATH."""
        monkeypatch.chdir(tmp_path)
        assert parse_options("f", valid(qemu="bin/qemu")).qemu == str(tmp_path / "bin/qemu")
        assert parse_options("f", valid(qemu="qemu-system-x86_64")).qemu == "qemu-system-x86_64"

    @pytest.mark.parametrize(
        ("options", "option"),
        [
            ({"hosts": [{"name": "h1"}]}, "state_dir"),
            (valid(state_dir=""), "state_dir"),
            (valid(pool_bytes=100 * MiB), "pool_bytes"),
            (valid(pool_bytes=0), "pool_bytes"),
            (valid(pool_bytes="1G"), "pool_bytes"),
            (valid(pool_bytes=976 * GiB), "pool_bytes"),
            (valid(pool_bytes=1024 * GiB), "pool_bytes"),
            (valid(pool_bytes=64 * 1024**4), "pool_bytes"),
            (valid(pool_bytes=2**60), "pool_bytes"),
            (valid(pool_bytes=2**64 - 256 * MiB), "pool_bytes"),
            (valid(pool_bytes=2**64), "pool_bytes"),
            (valid(pool_bytes=975 * GiB, hosts=[{"name": "h1"}, {"name": "h2", "memory": "4G"}]), "pool_bytes"),
            (valid(qemu=""), "qemu"),
            (valid(stop_hosts_on_close="yes"), "stop_hosts_on_close"),
            (valid(hosts=[]), "hosts"),
            (valid(hosts="h1"), "hosts"),
            (valid(hosts=[{"name": "a/b"}]), "hosts[0].name"),
            (valid(hosts=[{"name": "h1"}, {"name": "h1"}]), "hosts[1].name"),
            (valid(hosts=[{"name": "h1", "ports": 0}]), "hosts[0].ports"),
            (valid(hosts=[{"name": "h1", "ports": 33}]), "hosts[0].ports"),
            (valid(hosts=[{"name": "h1", "memory": "lots"}]), "hosts[0].memory"),
            (valid(hosts=[{"name": "h1", "memory": "0G"}]), "hosts[0].memory"),
            (valid(hosts=[{"name": "h1", "memory": "1.5"}]), "hosts[0].memory"),
            (valid(hosts=[{"name": "h1", "initrd": "/i"}]), "hosts[0].kernel"),
            (valid(hosts=[{"name": "h1", "serial": "file:/x"}]), "hosts[0].serial"),
            (valid(hosts=[{"name": "h1", "cpus": 2}]), "hosts[0].cpus"),
            (valid(pool_byte=GiB), "pool_byte"),
        ],
    )
    def test_invalid(self, options: dict[str, Any], option: str) -> None:
        with pytest.raises(ConfigError) as info:
            parse_options("f", options)
        assert info.value.field == option
        assert "fabric 'f' (driver qemu-cxl)" in info.value.message and repr(option) in info.value.message


class TestBootFiles:
    """A kernel or initrd that QEMU could not open is a ConfigError naming it when the options are read, not a
    host that fails at every start (FabricUnavailableError, which tells a client to retry)."""

    @pytest.mark.parametrize("option", ["kernel", "initrd"])
    def test_a_missing_file(self, tmp_path: Path, option: str) -> None:
        host = dict(zip(("kernel", "initrd"), boot_files(tmp_path, "vmlinuz", "initrd.img"), strict=True))
        host[option] = str(tmp_path / "gone")
        with pytest.raises(ConfigError) as info:
            parse_options("f", valid(hosts=[{"name": "h1"}, {"name": "g", **host}]))
        assert info.value.field == f"hosts[1].{option}"
        assert f"option 'hosts[1].{option}'" in info.value.message
        assert f"{tmp_path / 'gone'}" in info.value.message and "no such file" in info.value.message

    def test_a_directory(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError) as info:
            parse_options("f", valid(hosts=[{"name": "g", "kernel": str(tmp_path)}]))
        assert info.value.field == "hosts[0].kernel" and "is not a file" in info.value.message

    def test_create_fabric_starts_nothing(self, tmp_path: Path) -> None:
        """The fabric is refused before any QEMU is started."""
        state = tmp_path / "state"
        with pytest.raises(ConfigError) as info:
            create_fabric("f", valid(state_dir=str(state), hosts=[{"name": "g", "kernel": str(tmp_path / "k")}]))
        assert info.value.field == "hosts[0].kernel"
        assert not (state / "hosts").exists()

    @pytest.mark.parametrize("option", ["kernel", "initrd"])
    def test_a_file_gone_since_fails_the_start_for_good(self, tmp_path: Path, option: str) -> None:
        """A boot file removed after the options were read (the next start of the host, after a crash or by a
        release): QEMU exited at every start, and the call failed with FabricUnavailableError, UNAVAILABLE, which
        a client retries for ever. The start is refused before QEMU runs, naming the file; not retryable. (The
        QEMU here is a script that notes it was run and exits as QEMU does.)"""
        ran = tmp_path / "qemu-ran"
        qemu = tmp_path / "qemu-system-x86_64"
        qemu.write_text(f"#!/bin/sh\ntouch {ran}\necho 'qemu: could not load kernel' >&2\nexit 1\n")
        qemu.chmod(0o755)
        kernel, initrd = boot_files(tmp_path, "vmlinuz", "initrd.img")
        host = parse_options("f", valid(hosts=[{"name": "g", "kernel": kernel, "initrd": initrd}])).hosts[0]
        gone = Path(kernel if option == "kernel" else initrd)
        gone.unlink()
        loop = Loop("f")
        try:
            process = HostProcess(str(qemu), host, tmp_path / "state", GiB, loop)
            with pytest.raises(ConflictError) as info:
                process.start([])
        finally:
            loop.close()
        assert not info.value.retryable
        assert str(gone) in info.value.message and "no such file" in info.value.message
        assert "host 'g'" in info.value.message and f"{option} option" in info.value.message
        assert not ran.exists(), "QEMU was run with a boot file that is gone"

    def test_a_restart_that_could_not_boot_leaves_the_qemu_running(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A release restarts the host: with its kernel gone, the running QEMU (and its guest) is not stopped."""
        (kernel,) = boot_files(tmp_path, "vmlinuz")
        host = parse_options("f", valid(hosts=[{"name": "g", "kernel": kernel}])).hosts[0]
        Path(kernel).unlink()
        stopped: list[str] = []
        loop = Loop("f")
        try:
            process = HostProcess("qemu-system-x86_64", host, tmp_path / "state", GiB, loop)
            monkeypatch.setattr(process, "stop", lambda: stopped.append("stop"))
            with pytest.raises(ConflictError, match="kernel option names a file it cannot boot"):
                process.restart([])
        finally:
            loop.close()
        assert not stopped


class TestPoolBytesLimit:
    """pool_bytes is every host's CXL window: refused above what QEMU 7.2 was measured to start with."""

    @pytest.mark.parametrize(
        ("memory", "largest"),
        [
            ("1G", int(975.75 * GiB)),
            ("1.5G", int(975.75 * GiB)),
            ("2815M", int(975.75 * GiB)),
            ("2816M", int(974.75 * GiB)),
            ("2817M", int(974.75 * GiB)),
            ("3G", int(974.75 * GiB)),
            ("4G", int(973.75 * GiB)),
            ("5632M", int(971.75 * GiB)),
            ("16G", int(961.75 * GiB)),
        ],
    )
    def test_the_largest_window_qemu_starts_with(self, memory: str, largest: int) -> None:
        """The largest measured to start is accepted and the next 256 MiB, which QEMU refuses, is not."""
        hosts = [{"name": "h1", "memory": memory}]
        assert parse_options("f", valid(pool_bytes=largest, hosts=hosts)).pool_bytes == largest
        with pytest.raises(ConfigError) as info:
            parse_options("f", valid(pool_bytes=largest + 256 * MiB, hosts=hosts))
        assert info.value.field == "pool_bytes" and f"at most {largest}" in info.value.message

    def test_the_message_says_why(self) -> None:
        with pytest.raises(ConfigError) as info:
            parse_options("f", valid(pool_bytes=1024**4))
        message = info.value.message
        assert "fabric 'f' (driver qemu-cxl): option 'pool_bytes'" in message
        assert f"at most {int(975.75 * GiB)} (975.75 GiB), not {1024**4}" in message
        assert "40-bit guest address space" in message

    def test_a_host_with_more_ram_names_itself(self) -> None:
        hosts = [{"name": "small"}, {"name": "big", "memory": "16G"}]
        with pytest.raises(ConfigError) as info:
            parse_options("f", valid(pool_bytes=970 * GiB, hosts=hosts))
        assert info.value.field == "pool_bytes"
        assert f"at most {int(961.75 * GiB)} for host 'big' with 16G of RAM, not {970 * GiB}" in info.value.message


class TestMissingQemu:
    """Without the QEMU binary, building the fabric fails at once with what to install."""

    def test_missing_binary(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError) as info:
            create_fabric("f", valid(state_dir=str(tmp_path), qemu="/nonexistent/qemu-system-x86_64"))
        assert "apt-get install qemu-system-x86" in info.value.message
        assert "fabric 'f'" in info.value.message
        assert not (tmp_path / "hosts").exists(), "nothing was started"


class TestCommandLine:
    """The static CXL topology: a host bridge, one root port, a switch, N downstream ports, a fixed window."""

    def test_paused_topology_with_a_cold_plugged_type3(self) -> None:
        record = Record("a", "h1", 2, 0x1234, 512 * MiB, ((0, 512 * MiB),))
        argv = command_line("qemu", HostOptions("h1", ports=3), 2 * GiB, [record])
        text = " ".join(argv)
        assert "-S" in argv and "-kernel" not in argv
        assert "q35,cxl=on" in text and "-accel tcg" in text
        assert text.count("cxl-downstream,") == 3 and "cxl-rp," in text and "cxl-upstream," in text
        assert "cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=2147483648" in text
        assert "cxl-type3,id=cxl-t3-1234,bus=dsp2,addr=0,sn=4660,memdev=cxl-mem-1234,lsa=cxl-lsa-1234" in text
        assert "memory-backend-file,id=cxl-mem-1234,mem-path=mem-1234.img,size=536870912,share=on" in text

    def test_a_booting_host_runs(self) -> None:
        host = HostOptions("g", kernel="/k", initrd="/i", append="quiet", serial=("file:/c", "unix:/s,server=on"))
        argv = command_line("qemu", host, GiB, [])
        assert "-S" not in argv
        text = " ".join(argv)
        assert "-kernel /k -initrd /i -append quiet" in text and "-smp 2" in text
        assert "-serial file:/c -serial unix:/s,server=on" in text

    def test_volatile_type3_has_no_lsa(self) -> None:
        record = Record("a", "h1", 0, 0x10, 256 * MiB, (), volatile=True)
        text = " ".join(command_line("qemu", HostOptions("h1"), GiB, [record]))
        assert "volatile-memdev=cxl-mem-10" in text and "cxl-lsa-10" not in text
