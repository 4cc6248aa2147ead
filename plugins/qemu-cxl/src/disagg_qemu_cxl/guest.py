"""A bootable Linux guest for the qemu-cxl driver's end-to-end tests, and a way to ask it what it sees.

The driver can only be trusted if a real kernel finds the CXL Type-3 devices it hot-adds. This module builds
such a guest from Debian's own packages at test time instead of shipping a disk image: ``apt-get download``
fetches the current ``linux-image-amd64`` kernel, ``busybox-static`` and ``ndctl`` (the ``cxl`` tool) with
the libraries it links, ``dpkg-deb -x`` unpacks them, ``depmod -b`` indexes the modules, and a small
initramfs (cpio ``newc``, gzip) is written whose ``/init`` loads the CXL drivers, prints `READY_MARKER` on
ttyS0 and serves a shell on ttyS1. Everything lands in a cache directory the caller names and is reused when
it matches the kernel apt currently offers, so only the first run pays for the download.

`GuestShell` talks to that ttyS1 shell through the unix socket QEMU exposes it on. `list_memdevs` reads
``/sys/bus/cxl/devices/mem*/serial`` in the guest: ``memN`` names change from boot to boot, the serial
(QEMU's ``sn``) is the only key shared by the host and the guest.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs

__all__ = [
    "CXL_MODULES",
    "DEFAULT_APPEND",
    "READY_MARKER",
    "CommandResult",
    "GuestBuildError",
    "GuestCommandError",
    "GuestImage",
    "GuestShell",
    "GuestTimeoutError",
    "MemDev",
    "MissingToolError",
    "PackageDownloadError",
    "build_guest",
    "list_memdevs",
    "wait_for_marker",
    "wait_for_memdev",
]

KERNEL_METAPACKAGE = "linux-image-amd64"
# busybox for /init and the shell; ndctl ships `cxl`, the other five are the libraries `cxl` links beyond libc.
USERSPACE_PACKAGES = ("busybox-static", "ndctl", "libcxl1", "libdaxctl1", "libndctl6", "libtraceevent1", "libtracefs1")
# Loaded in this order, each after its own dependencies from modules.dep; built-in ones are skipped.
CXL_MODULES = ("libnvdimm", "cxl_acpi", "cxl_pci", "cxl_mem", "cxl_pmem")
READY_MARKER = "DISAGG-GUEST-READY"
# ttyS0 is the console QEMU writes to a file; `quiet` keeps it short so finding the marker stays cheap.
DEFAULT_APPEND = "console=ttyS0 quiet panic=-1"
IMAGE_FORMAT = 4
COMMAND_TIMEOUT_S = 600.0
CPIO_TRAILER = "TRAILER!!!"
SYNC_ATTEMPT_S = 1.0
NUDGE_S = 0.02


class GuestBuildError(RuntimeError):
    """The guest could not be built; the message says what to install or fix."""


class MissingToolError(GuestBuildError):
    """A host tool the build needs is not installed."""


class PackageDownloadError(GuestBuildError):
    """apt could not resolve or download a package (no network, no mirror, stale package lists)."""


class GuestTimeoutError(TimeoutError):
    """A bounded wait on the guest ran out."""


class GuestCommandError(RuntimeError):
    """A command run in the guest shell exited with a non-zero status."""


@attrs.frozen
class GuestImage:
    """What QEMU needs to boot the guest: ``-kernel``, ``-initrd`` and ``-append``."""

    kernel: Path
    initrd: Path
    kernel_release: str
    append: str = DEFAULT_APPEND


@attrs.frozen
class MemDev:
    """One CXL memory device as the guest sees it; sizes are 0 when the guest exposes none."""

    name: str
    serial: int
    pmem_bytes: int
    ram_bytes: int


# --- building -------------------------------------------------------------------------------------------------

_TOOLS = {
    "apt-get": "apt (a Debian or Ubuntu host)",
    "apt-cache": "apt (a Debian or Ubuntu host)",
    "dpkg-deb": "dpkg (a Debian or Ubuntu host)",
    "depmod": "kmod (apt-get install kmod)",
    "ldd": "libc-bin (apt-get install libc-bin)",
}


def require_tools(tools: Iterable[str] = _TOOLS) -> None:
    """Fail before any download when a tool is missing, naming the package that provides it."""
    missing = [t for t in tools if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if missing:
        hints = sorted({_TOOLS.get(t, t) for t in missing})
        raise MissingToolError(f"building the test guest needs {', '.join(missing)}: install {'; '.join(hints)}")


def _tool(name: str) -> str:
    """The tool's path; depmod lives in /usr/sbin, which a non-root PATH often lacks."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        require_tools([name])
    assert found is not None
    return found


def _run(args: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None) -> str:
    """Run a build step, bounded; its stderr goes into the error so a failure explains itself."""
    try:
        done = subprocess.run(
            [_tool(args[0]), *args[1:]],
            cwd=cwd,
            env=None if env is None else {**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise GuestBuildError(f"{' '.join(args)} took more than {COMMAND_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise GuestBuildError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def resolve_kernel_package() -> str:
    """The versioned kernel package ``linux-image-amd64`` depends on now, e.g. ``linux-image-6.1.0-57-amd64``.

    Resolved from the local package lists rather than pinned, so the guest follows the distribution's
    security updates and a pinned version that left the mirror can never break the build.
    """
    try:
        out = _run(["apt-cache", "depends", KERNEL_METAPACKAGE])
    except GuestBuildError as exc:
        raise PackageDownloadError(f"{exc}; run apt-get update") from None
    found = re.search(r"Depends:\s*(linux-image-\S+)", out)
    if found is None:
        raise PackageDownloadError(f"apt-cache knows no kernel behind {KERNEL_METAPACKAGE}: run apt-get update")
    return found.group(1)


def _download(packages: Sequence[str], debs: Path) -> list[Path]:
    """The .deb of each package, downloaded into ``debs`` only when no file for it is there yet."""
    debs.mkdir(parents=True, exist_ok=True)
    wanted = [p for p in packages if not _deb_of(p, debs)]
    if wanted:
        try:
            _run(["apt-get", "download", *wanted], cwd=debs)
        except GuestBuildError as exc:
            raise PackageDownloadError(
                f"apt-get download {' '.join(wanted)} failed; the test guest needs network access to the Debian "
                f"mirror and current package lists (apt-get update): {exc}"
            ) from None
    return [_only_deb(p, debs) for p in packages]


def _deb_of(package: str, debs: Path) -> list[Path]:
    return sorted(debs.glob(f"{package}_*.deb"))


def _only_deb(package: str, debs: Path) -> Path:
    found = _deb_of(package, debs)
    if not found:
        raise PackageDownloadError(f"apt-get download left no .deb for {package} in {debs}")
    return found[-1]


def _kernel_release(kernel_package: str) -> str:
    return kernel_package.removeprefix("linux-image-")


def _dependency_order(names: Sequence[str], modules_dir: Path) -> list[str]:
    """Module paths (relative to ``modules_dir``) to insmod in order: each after what modules.dep says it needs.

    busybox's insmod resolves nothing itself, so the order has to be worked out here.
    """
    deps: dict[str, list[str]] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        module, _, rest = line.partition(":")
        deps[module] = rest.split()
    by_name = {_module_name(path): path for path in deps}
    builtin = {_module_name(p) for p in (modules_dir / "modules.builtin").read_text().split()}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in deps[path]:
            visit(dep)
        order.append(path)

    for name in names:
        key = name.replace("-", "_")
        if key in by_name:
            visit(by_name[key])
        elif key not in builtin:
            raise GuestBuildError(f"the guest kernel has no module {name} (neither in modules.dep nor built in)")
    return order


def _module_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    return base.split(".ko", 1)[0].replace("-", "_")


def _init_script(modules_subdir: str, modules: Sequence[str]) -> str:
    """``/init``: mount the pseudo file systems, load the CXL drivers, serve a shell on ttyS1, say ready.

    The ttyS1 shell reads from a pipe, not the tty, so it is not interactive (no prompt, no line editing) and
    the line is raw with echo off: what the host reads back is exactly the commands' output. /init itself
    holds ttyS1 open (fd 3) before saying ready: a UART that nobody has open drops what it receives, and the
    background ``cat`` may not have opened it yet when a host that saw the marker sends its first command.
    """
    loads = "\n".join(f"insmod /{modules_subdir}/{m} || echo 'insmod {m} failed'" for m in modules)
    return f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
{loads}
exec 3<>/dev/ttyS1
stty -F /dev/ttyS1 raw -echo
( while true; do cat /dev/ttyS1 | sh > /dev/ttyS1 2>&1; done ) &
echo "{READY_MARKER} uptime=$(cut -d' ' -f1 /proc/uptime)" > /dev/ttyS0
while true; do sleep 3600; done
"""


def _copy_binary_with_libraries(binary: Path, root: Path, tree: Path) -> None:
    """Copy ``binary`` (inside the unpacked ``root``) into ``tree`` with every library ldd says it loads.

    The unpacked packages' library directories come first on the search path, so the libcxl and friends
    that were downloaded are the ones copied; libc and the rest come from this (Debian) host, the same
    release the guest's packages were built for.
    """
    lib_dirs = [str(root / d) for d in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu")]
    out = _run(["ldd", str(binary)], env={"LD_LIBRARY_PATH": ":".join(lib_dirs)})
    missing = [line.split()[0] for line in out.splitlines() if "not found" in line]
    if missing:
        raise MissingToolError(
            f"{binary.name} needs {', '.join(missing)}, found neither in the packages nor on the host"
        )
    _copy_into(binary, tree / binary.relative_to(root))
    for path in re.findall(r"(/\S+) \(0x", out):
        source = Path(path)
        inside = source.relative_to(root) if source.is_relative_to(root) else source.relative_to("/")
        _copy_into(source, tree / inside)


def _copy_into(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source.resolve(), target)


def _assemble_tree(root: Path, tree: Path, release: str) -> None:
    """The initramfs contents: busybox, ``cxl`` with its libraries, the needed modules and ``/init``."""
    if tree.exists():
        shutil.rmtree(tree)
    for d in ("bin", "sbin", "proc", "sys", "dev", "tmp", "usr/bin", "usr/sbin"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    _copy_into(root / "bin/busybox", tree / "bin/busybox")
    _copy_binary_with_libraries(root / "usr/bin/cxl", root, tree)
    modules_subdir = f"lib/modules/{release}"
    modules = _dependency_order(CXL_MODULES, root / modules_subdir)
    compressed = [m for m in modules if not m.endswith(".ko")]
    if compressed:
        raise GuestBuildError(f"compressed kernel modules are not supported by this guest builder: {compressed}")
    for module in modules:
        _copy_into(root / modules_subdir / module, tree / modules_subdir / module)
    init = tree / "init"
    init.write_text(_init_script(modules_subdir, modules))
    init.chmod(0o755)


def write_cpio_newc(tree: Path, target: Path) -> None:
    """Write ``tree`` as a gzip'd cpio archive in the ``newc`` format the kernel unpacks as its initramfs.

    Written here rather than with cpio(1) so the build needs no cpio package; the format is a fixed
    110-byte ASCII header per entry, name and data each padded to four bytes, and a ``TRAILER!!!`` entry.
    """
    with gzip.open(target, "wb", compresslevel=1) as out:
        for ino, path in enumerate(sorted(tree.rglob("*")), start=1):
            name = str(path.relative_to(tree))
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                data = os.readlink(path).encode()
            elif stat.S_ISREG(info.st_mode):
                data = path.read_bytes()
            else:
                data = b""
            out.write(_cpio_entry(name, info.st_mode, ino, data))
        out.write(_cpio_entry(CPIO_TRAILER, 0, 0, b""))


def _cpio_entry(name: str, mode: int, ino: int, data: bytes) -> bytes:
    encoded = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
    header = b"070701" + b"".join(f"{f:08x}".encode() for f in fields)
    head = header + encoded
    return head + _pad(len(head)) + data + _pad(len(data))


def _pad(length: int) -> bytes:
    return b"\0" * (-length % 4)


def build_guest(cache_dir: Path) -> GuestImage:
    """Build the guest under ``cache_dir``, or return the one built there before for the same kernel.

    Raises `MissingToolError` or `PackageDownloadError` (both `GuestBuildError`) for what a user can fix:
    a missing tool, no network, stale package lists.
    """
    require_tools()
    kernel_package = resolve_kernel_package()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        # Two test runs sharing $DISAGG_GUEST_CACHE would otherwise unpack into the same directories at once.
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(cache_dir, kernel_package)


def _build_locked(cache_dir: Path, kernel_package: str) -> GuestImage:
    release = _kernel_release(kernel_package)
    image_dir = cache_dir / "image"
    manifest = image_dir / "image.json"
    cached = _cached_image(manifest, kernel_package)
    if cached is not None:
        return cached
    packages = (kernel_package, *USERSPACE_PACKAGES)
    root = cache_dir / "root"
    if root.exists():
        shutil.rmtree(root)
    for deb in _download(packages, cache_dir / "debs"):
        _run(["dpkg-deb", "-x", str(deb), str(root)])
    _run(["depmod", "-b", str(root), release])
    _assemble_tree(root, cache_dir / "initramfs", release)
    image_dir.mkdir(parents=True, exist_ok=True)
    image = GuestImage(kernel=image_dir / "vmlinuz", initrd=image_dir / "initrd.cpio.gz", kernel_release=release)
    shutil.copy2(root / f"boot/vmlinuz-{release}", image.kernel)
    write_cpio_newc(cache_dir / "initramfs", image.initrd)
    manifest.write_text(json.dumps({"format": IMAGE_FORMAT, "kernel_package": kernel_package, "release": release}))
    # The unpacked packages are ~400 MB (every kernel module); a cache keeps only the .debs and the image.
    shutil.rmtree(root)
    shutil.rmtree(cache_dir / "initramfs")
    return image


def _cached_image(manifest: Path, kernel_package: str) -> GuestImage | None:
    """The image recorded in ``manifest`` if it was built, in this format, for ``kernel_package``."""
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    if recorded.get("format") != IMAGE_FORMAT or recorded.get("kernel_package") != kernel_package:
        return None
    image = GuestImage(
        kernel=manifest.parent / "vmlinuz",
        initrd=manifest.parent / "initrd.cpio.gz",
        kernel_release=recorded["release"],
    )
    return image if image.kernel.is_file() and image.initrd.is_file() else None


# --- talking to the guest -------------------------------------------------------------------------------------


def wait_for_marker(console_log: Path, marker: str = READY_MARKER, *, timeout_s: float = 60.0) -> str:
    """Wait until ``marker`` appears in the console log QEMU writes; the line that has it.

    Polling the file (rather than a pipe) is what lets the console also be kept for a failed test's report.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = console_log.read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            if marker in line:
                return line.strip()
        if time.monotonic() >= deadline:
            tail = "\n".join(text.splitlines()[-20:])
            raise GuestTimeoutError(f"no {marker!r} on {console_log} within {timeout_s:.0f} s; console ends:\n{tail}")
        time.sleep(0.1)


@attrs.frozen
class CommandResult:
    """What a guest command printed (stdout and stderr together) and its exit status."""

    status: int
    output: str


class GuestShell:
    """A client of the shell ``/init`` serves on ttyS1, which QEMU exposes as a unix socket.

    Each command is followed by a ``printf`` of a marker unique to that call and the command's exit status,
    and output is read up to that marker: the serial line has no framing of its own. Every read is bounded.

    While it waits, the client sends an empty line every `NUDGE_S` (an empty command to the shell). Under
    QEMU 7.2's multi-threaded TCG the guest's ttyS1 output stalled until the UART next received something,
    whatever the guest's CPU count or IRQ affinity (only ``-accel tcg,thread=single`` or ``-smp 1`` avoided
    it, and the driver runs neither); a received byte makes the guest's 8250 driver send what it holds.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    @classmethod
    def connect(cls, path: Path, *, timeout_s: float = 10.0) -> GuestShell:
        """Connect to the socket, retrying while QEMU has not created it yet, and wait for the shell to answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
                break
            except OSError as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise GuestTimeoutError(f"cannot connect to the guest shell at {path}: {exc}") from None
                time.sleep(0.05)
        shell = cls(sock)
        try:
            shell.sync(timeout_s=max(deadline - time.monotonic(), SYNC_ATTEMPT_S))
        except BaseException:
            shell.close()
            raise
        return shell

    def sync(self, *, timeout_s: float = 10.0) -> None:
        """Run ``true`` until it is answered: a command sent before the guest's shell reads its line is lost.

        Output of a lost attempt that arrives late is discarded with the answer that follows it.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.run("true", timeout_s=min(SYNC_ATTEMPT_S, max(deadline - time.monotonic(), 0.1)))
                return
            except GuestTimeoutError:
                if time.monotonic() >= deadline:
                    raise GuestTimeoutError(f"the guest shell did not answer within {timeout_s:.1f} s") from None

    def run(self, command: str, *, timeout_s: float = 10.0) -> CommandResult:
        """Run ``command`` in the guest; its output and status once the end marker arrives."""
        marker = f"END-{uuid.uuid4().hex}"
        # The marker is printed as two printf arguments, so an echo of the input line could never match it.
        line = f"{command}\nprintf '%s%s %s\\n' '{marker[:4]}' '{marker[4:]}' \"$?\"\n"
        self._sock.sendall(line.encode())
        pattern = re.compile(re.escape(marker).encode() + rb" (\d+)\r?\n")
        deadline = time.monotonic() + timeout_s
        while (found := pattern.search(self._buffer)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GuestTimeoutError(f"the guest did not finish {command!r} within {timeout_s:.1f} s")
            self._sock.settimeout(min(remaining, NUDGE_S))
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                self._sock.sendall(b"\n")
                continue
            if not chunk:
                raise ConnectionError("the guest shell socket closed")
            self._buffer += chunk
        output = self._buffer[: found.start()].decode(errors="replace").replace("\r\n", "\n")
        self._buffer = self._buffer[found.end() :]
        return CommandResult(status=int(found.group(1)), output=output)

    def check(self, command: str, *, timeout_s: float = 10.0) -> str:
        """Run ``command`` and return its output; a non-zero status raises `GuestCommandError`."""
        result = self.run(command, timeout_s=timeout_s)
        if result.status != 0:
            raise GuestCommandError(f"{command!r} exited {result.status}: {result.output.strip()}")
        return result.output

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> GuestShell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# One line per memory device: name, serial, pmem size, ram size ("-" when the guest has no such file).
_LIST_MEMDEVS = (
    'for d in /sys/bus/cxl/devices/mem*; do [ -e "$d/serial" ] || continue; '
    'echo "MEMDEV ${d##*/} $(cat $d/serial) $(cat $d/pmem/size 2>/dev/null || echo -) '
    '$(cat $d/ram/size 2>/dev/null || echo -)"; done'
)


def list_memdevs(shell: GuestShell, *, timeout_s: float = 10.0) -> dict[int, MemDev]:
    """The guest's CXL memory devices keyed by serial, read from ``/sys/bus/cxl/devices/mem*``."""
    found: dict[int, MemDev] = {}
    for line in shell.check(_LIST_MEMDEVS, timeout_s=timeout_s).splitlines():
        parts = line.split()
        if len(parts) != 5 or parts[0] != "MEMDEV":
            continue
        _, name, serial, pmem, ram = parts
        found[int(serial, 0)] = MemDev(name=name, serial=int(serial, 0), pmem_bytes=_size(pmem), ram_bytes=_size(ram))
    return found


def _size(text: str) -> int:
    return 0 if text == "-" else int(text, 0)


def wait_for_memdev(shell: GuestShell, serial: int, *, timeout_s: float = 10.0, poll_s: float = 0.1) -> MemDev:
    """Poll the guest until a memory device with ``serial`` is there; raises `GuestTimeoutError` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        devices = list_memdevs(shell, timeout_s=max(remaining, 1.0))
        if serial in devices:
            return devices[serial]
        if time.monotonic() >= deadline:
            seen = ", ".join(f"{d.name}={s:#x}" for s, d in sorted(devices.items())) or "none"
            raise GuestTimeoutError(
                f"no CXL memory device with serial {serial:#x} within {timeout_s:.1f} s (seen: {seen})"
            )
        time.sleep(poll_s)
