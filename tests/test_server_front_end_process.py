"""The gRPC front end's process (`disagg.server.front`) from start to end, with real processes: which ``disagg serve``
runs one, that it never outlives the server (a crashed server's address is free for the next one at once), that
the server stops when it dies, that signals stop both gracefully, what a failed start leaves behind, and that the
link between them closes at a frame no link sends."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from composer_helpers import rack
from crash_helpers import ServeProcess
from disagg.cli.serve import EXIT_FAILED
from disagg.composer import FabricComposer
from disagg.errors import ConfigError, DisaggError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.lockfile import try_lock
from disagg.server import SERVICE_NAME, FabricManagerServer
from disagg.server.front import FRONT_END_GONE, ComposerLink
from disagg.server.link import CALL, HEADER, MAX_FRAME
from disagg.server.runtime import ServerStoppedError
from disagg.store import MemoryStore
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_helpers import SERVE_CONFIG, WAIT_S, serving, socket_path, wait_until

START_S = 30.0
"""The longest a ``disagg serve`` child may take to import everything and listen."""
GONE_S = 5.0
"""The longest a front end may outlive the process that started it."""
FRONT_END = "disagg.server.front_end"

# ------------------------------------------------------------------------------------------ processes


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state, parent, ...); None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status is left)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def front_ends(parent: int) -> list[int]:
    """The running front ends whose parent is ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = _stat(int(entry.name))
        if FRONT_END.encode() in cmdline and fields is not None and int(fields[1]) == parent and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def the_front_end(parent: int) -> int:
    found = front_ends(parent)
    assert len(found) == 1, f"front ends of {parent}: {found}"
    return found[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_config(tmp_path: Path, ledger: str) -> Path:
    """The demo rack (two memory pools, as `composer_helpers.rack`), its ledger in ``ledger.db`` or in memory."""
    config = tmp_path / "disagg.toml"
    text = SERVE_CONFIG.format(delay=0, socket=socket_path(tmp_path))
    if ledger == "sqlite":
        text = text.replace('ledger = "memory"', f'ledger = "sqlite"\npath = "{tmp_path / "ledger.db"}"')
    config.write_text(text)
    return config


def spawn(tmp_path: Path, address: str, *extra: str, ledger: str = "sqlite") -> ServeProcess:
    """``disagg serve --listen ADDRESS EXTRA...`` in a process group of its own (a Ctrl-C to it reaches no test),
    its output merged."""
    command = [sys.executable, "-m", "disagg.cli.main", "serve", "--config", str(write_config(tmp_path, ledger))]
    proc = subprocess.Popen(
        [*command, "--listen", address, *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "DISAGG_STATE_DIR": str(tmp_path / "state")},
        process_group=0,
    )
    return ServeProcess(proc, address)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[list[ServeProcess]]:
    """Start ``disagg serve`` children (`started`); each is killed at the end if it still runs."""
    children: list[ServeProcess] = []
    yield children
    for child in children:
        child.kill()


def started(
    children: list[ServeProcess], tmp_path: Path, address: str, *extra: str, ledger: str = "sqlite"
) -> ServeProcess:
    child = spawn(tmp_path, address, *extra, ledger=ledger)
    children.append(child)
    child.wait_ready(START_S)
    return child


def list_pools(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = fm_grpc.FabricManagerServiceStub(channel).ListPools(fm.ListPoolsRequest(), timeout=WAIT_S)
    return len(reply.pools)


def embedded(address: str | list[str], **options: Any) -> FabricManagerServer:
    """A server over the demo rack in memory, with its front end in a process of its own."""
    addresses = [address] if isinstance(address, str) else address
    return FabricManagerServer(
        FabricComposer(rack(), store=MemoryStore()),
        addresses,
        front_end="process",
        **options,
    )


def health(server: FabricManagerServer, service: str = "") -> int:
    """The status the composer's process holds (and mirrors to its front end) for ``service``."""
    reply = asyncio.run(server.health.Check(health_pb2.HealthCheckRequest(service=service), None))  # type: ignore[arg-type]
    return int(reply.status)


# ------------------------------------------------------------------------------------------ tests


class TestWhichFrontEnd:
    """``--front-end auto`` runs gRPC in a process of its own for a durable ledger and beside the composer for
    one in memory; ``process`` and ``inline`` say which."""

    @pytest.mark.parametrize(
        ("ledger", "extra", "processes"),
        [
            ("sqlite", (), 1),
            ("sqlite", ("--front-end", "inline"), 0),
            ("memory", (), 0),
            ("memory", ("--front-end", "process"), 1),
        ],
        ids=["sqlite-auto", "sqlite-inline", "memory-auto", "memory-process"],
    )
    def test_front_end_processes(
        self, tmp_path: Path, serve: list[ServeProcess], ledger: str, extra: tuple[str, ...], processes: int
    ) -> None:
        address = f"unix:{socket_path(tmp_path)}"
        child = started(serve, tmp_path, address, *extra, ledger=ledger)
        assert list_pools(address) == 2
        assert len(front_ends(child.proc.pid)) == processes
        child.stop_cleanly("the front end test")

    def test_an_unknown_front_end_is_refused(self, tmp_path: Path) -> None:
        child = spawn(tmp_path, f"unix:{socket_path(tmp_path)}", "--front-end", "bogus")
        code = child.wait_exit(START_S)
        assert code == 2, child.output
        assert "argument --front-end: invalid choice: 'bogus'" in child.output
        assert "auto" in child.output and "inline" in child.output and "process" in child.output
        assert not socket_path(tmp_path).exists()

    def test_an_embedder_s_unknown_front_end_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError) as info:
            FabricManagerServer(
                FabricComposer(rack(), store=MemoryStore()), [f"unix:{socket_path(tmp_path)}"], front_end="bogus"
            )
        assert info.value.message == "front_end is 'bogus': give one of inline, process"
        assert info.value.field == "front_end"
        assert not socket_path(tmp_path).exists()


class TestParentKilled:
    """A ``disagg serve`` killed (the crash tests SIGKILL it) takes its front end with it: no orphan keeps its
    address, and the next server on that address starts and serves at once."""

    @pytest.mark.parametrize("kind", ["unix", "tcp"])
    def test_the_next_server_serves_at_once(self, tmp_path: Path, serve: list[ServeProcess], kind: str) -> None:
        address = f"unix:{socket_path(tmp_path)}" if kind == "unix" else f"127.0.0.1:{free_port()}"
        first = started(serve, tmp_path, address)
        front = the_front_end(first.proc.pid)
        first.proc.kill()
        first.proc.wait(WAIT_S)
        wait_until(lambda: not alive(front), "the front end to end with its server", timeout=GONE_S)
        second = started(serve, tmp_path, address)
        assert list_pools(address) == 2
        assert the_front_end(second.proc.pid) != front
        second.stop_cleanly("the second server")


class TestFrontEndKilled:
    """A front end that dies leaves a server no client can reach: it stops serving and says why."""

    def test_disagg_serve_exits_failed(self, tmp_path: Path, serve: list[ServeProcess]) -> None:
        path = socket_path(tmp_path)
        child = started(serve, tmp_path, f"unix:{path}")
        os.kill(the_front_end(child.proc.pid), signal.SIGKILL)
        code = child.wait_exit(WAIT_S)
        assert code == EXIT_FAILED, child.output
        assert f"disagg: error: {FRONT_END_GONE}, so no client could reach this server" in child.output
        assert "restart it" in child.output
        assert not path.exists(), "the dead front end's socket was left behind"

    def test_an_embedded_server_fails(self, tmp_path: Path) -> None:
        failures: list[str] = []
        failed = threading.Event()

        def on_failed(why: str) -> None:
            failures.append(why)
            failed.set()

        server = embedded(f"unix:{socket_path(tmp_path)}", on_failed=on_failed)
        try:
            server.start()
            assert health(server) == health_pb2.HealthCheckResponse.SERVING
            os.kill(the_front_end(os.getpid()), signal.SIGKILL)
            assert failed.wait(WAIT_S), "on_failed was not called"
            assert failures == [FRONT_END_GONE]
            wait_until(
                lambda: health(server) == health(server, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING,
                "health to say NOT_SERVING",
            )
        finally:
            server.stop(0)
        assert front_ends(os.getpid()) == []

    def test_dying_while_the_composer_is_built(self, tmp_path: Path) -> None:
        """A front end that dies before the server serves fails the start: the server never says SERVING, nor
        calls ``on_serving``, and ``start`` says why."""
        building = threading.Event()
        go_on = threading.Event()
        served: list[list[str]] = []
        failures: list[str] = []

        def build() -> FabricComposer:
            building.set()
            assert go_on.wait(WAIT_S), "the test did not let the build go on"
            return FabricComposer(rack(), store=MemoryStore())

        server = FabricManagerServer(
            build,
            [f"unix:{socket_path(tmp_path)}"],
            front_end="process",
            on_serving=served.append,
            on_failed=failures.append,
        )
        starting = threading.Thread(target=lambda: _start_failure(server, failures))
        try:
            starting.start()
            assert building.wait(WAIT_S), "the composer's build never began"
            os.kill(the_front_end(os.getpid()), signal.SIGKILL)
            wait_until(lambda: FRONT_END_GONE in failures, "on_failed to be told the front end ended")
            go_on.set()
            starting.join(WAIT_S)
            assert not starting.is_alive(), "start did not return"
        finally:
            go_on.set()
            server.stop(0)
        assert f"{FRONT_END_GONE} while the server started: nothing was served" in failures
        assert served == []
        assert health(server) == health_pb2.HealthCheckResponse.NOT_SERVING


def _start_failure(server: FabricManagerServer, failures: list[str]) -> None:
    """Start ``server``, adding what its start raised to ``failures``."""
    try:
        server.start()
    except DisaggError as exc:
        failures.append(exc.message)


class TestComposerPaused:
    """A composer's process that stops answering (SIGSTOP, a hung loop) while its front end runs on: the front end
    still answers a client's pings, so its health must say so, or the client's round robin kept sending every
    other call there to wait out its deadline (`test_client_replicas`)."""

    def test_health_says_not_serving_until_it_answers_again(self, tmp_path: Path, serve: list[ServeProcess]) -> None:
        address = f"unix:{socket_path(tmp_path)}"
        child = started(serve, tmp_path, address)

        def status() -> int:
            with grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                return int(stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S).status)

        assert status() == health_pb2.HealthCheckResponse.SERVING
        child.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING", timeout=6.0)
        finally:
            child.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, "SERVING again")
        assert list_pools(address) == 2
        child.stop_cleanly("the server paused a while")


class TestSignals:
    """SIGTERM and SIGINT stop ``disagg serve`` gracefully, its front end with it; the front end ignores a Ctrl-C
    sent to the whole process group and is stopped by its parent."""

    @pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGINT-to-the-group"])
    def test_graceful_stop(self, tmp_path: Path, serve: list[ServeProcess], how: str) -> None:
        path = socket_path(tmp_path)
        child = started(serve, tmp_path, f"unix:{path}")
        front = the_front_end(child.proc.pid)
        if how == "SIGINT-to-the-group":
            os.killpg(child.proc.pid, signal.SIGINT)
        else:
            child.proc.send_signal(signal.Signals[how])
        code = child.wait_exit(WAIT_S)
        assert code == 0, child.output
        assert "Traceback" not in child.output, child.output
        assert not alive(front), "the front end outlived its server"
        assert not path.exists(), "the unix socket was left behind"
        claim = try_lock(path.with_name(path.name + ".lock"))
        assert claim is not None, "the socket's claim was kept"
        claim.close()

    def test_signals_while_the_front_end_starts(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A Ctrl-C (or SIGTERM) sent to the process group as the front end starts is its parent's to act on, as
        once it serves: it killed the front end, in the middle of its imports, with a traceback."""
        slow = SlowStart(tmp_path, monkeypatch)
        address = f"unix:{socket_path(tmp_path)}"
        server = embedded(address)
        try:
            starter, outcome = start_in_thread(server)
            front = slow.started()
            os.kill(front, signal.SIGINT)
            os.kill(front, signal.SIGTERM)
            slow.go()
            starter.join(START_S)
            assert outcome == [[address]]
            assert list_pools(address) == 2
            assert alive(front)
        finally:
            server.stop(0)
        assert not alive(front)


class TestBindFailures:
    """A front end that cannot listen fails the start as one process would, and leaves nothing behind."""

    def test_a_port_in_use(self, tmp_path: Path) -> None:
        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = taken.getsockname()[1]
            server = embedded(f"127.0.0.1:{port}")
            with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: the address is already in use"):
                server.start()
        assert front_ends(os.getpid()) == []

    def test_the_second_listener_fails(self, tmp_path: Path) -> None:
        path = socket_path(tmp_path)
        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = taken.getsockname()[1]
            server = embedded([f"unix:{path}", f"127.0.0.1:{port}"])
            with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: .*already in use"):
                server.start()
        assert not path.exists(), "the unix socket was left behind"
        assert front_ends(os.getpid()) == []
        with serving(path) as served:  # the path is free again
            assert served.server.addresses == [f"unix:{path}"]

    def test_a_unix_socket_another_server_serves(self, tmp_path: Path) -> None:
        path = socket_path(tmp_path)
        with serving(path), pytest.raises(ConfigError, match=f"another server is already listening on {path}"):
            embedded(f"unix:{path}").start()
        assert front_ends(os.getpid()) == []

    def test_a_unix_socket_another_program_listens_on(self, tmp_path: Path) -> None:
        path = socket_path(tmp_path)
        with socket.socket(socket.AF_UNIX) as other:
            other.bind(str(path))
            other.listen()
            with pytest.raises(ConfigError, match=f"another server is already listening on {path}"):
                embedded(f"unix:{path}").start()
        assert front_ends(os.getpid()) == []


SLOW_START = """#!{python}
import os, sys, time
with open({mark!r}, "w") as mark:
    mark.write(str(os.getpid()))
for _ in range(3000):
    if os.path.exists({go!r}):
        break
    time.sleep(0.01)
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""
"""A Python that starts once the file ``go`` exists (30 s at most), having written its pid to ``mark``."""


class SlowStart:
    """The front end of the servers made meanwhile starts when the test says (`go`), not at once."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mark = tmp_path / "front-end.pid"
        self._go = tmp_path / "go"
        slow = tmp_path / "slow-python"
        slow.write_text(SLOW_START.format(python=sys.executable, mark=str(self.mark), go=str(self._go)))
        slow.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(slow))

    def started(self) -> int:
        """Wait for the front end's process to be started: its pid."""
        wait_until(lambda: self.mark.exists() and self.mark.read_text() != "", "the front end's process to start")
        return int(self.mark.read_text())

    def go(self) -> None:
        self._go.write_text("")


def start_in_thread(server: FabricManagerServer) -> tuple[threading.Thread, list[BaseException | list[str]]]:
    """``server.start()`` on a thread of its own: the thread, and what the start returned or raised once it ends."""
    outcome: list[BaseException | list[str]] = []

    def start() -> None:
        try:
            outcome.append(server.start())
        except BaseException as exc:
            outcome.append(exc)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    return starter, outcome


class TestStoppedWhileStarting:
    def test_stop_before_the_front_end_listens(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The stop ends the front end's process, and the start, at once: not after `START_S` (60 s)."""
        slow = SlowStart(tmp_path, monkeypatch)
        server = embedded(f"unix:{socket_path(tmp_path)}")
        starter, outcome = start_in_thread(server)
        pid = slow.started()
        began = time.monotonic()
        server.stop(0)
        assert time.monotonic() - began < 20, "the stop waited for the front end to listen"
        starter.join(WAIT_S)
        assert not starter.is_alive(), "the start went on after the stop"
        assert len(outcome) == 1 and isinstance(outcome[0], ServerStoppedError), outcome
        assert not alive(pid), "the front end's process outlived the stop"
        assert not socket_path(tmp_path).exists()


class TestFrontEndFailsToStart:
    def test_said_as_such(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A front end that ends before it listens fails the start saying so, with its exit code: it was told as
        a server stopped while it started, which no one had stopped."""
        broken = tmp_path / "broken-python"
        broken.write_text("#!/bin/sh\nexit 3\n")
        broken.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(broken))
        server = embedded(f"unix:{socket_path(tmp_path)}")
        with pytest.raises(ConfigError, match=r"the gRPC front end did not start \(exit code 3\)"):
            server.start()
        assert not socket_path(tmp_path).exists()


class TestStartedFromAThread:
    def test_the_front_end_outlives_the_thread_that_started_the_server(self, tmp_path: Path) -> None:
        """``PR_SET_PDEATHSIG`` fires when the thread that spawned the front end ends, not its process: the front
        end is spawned on the server's loop thread, which lives until the stop, not on the caller's."""
        address = f"unix:{socket_path(tmp_path)}"
        server = embedded(address)
        try:
            starter = threading.Thread(target=server.start)
            starter.start()
            starter.join(START_S)
            assert not starter.is_alive()
            front = the_front_end(os.getpid())
            for _ in range(5):  # a while after the thread ended
                assert list_pools(address) == 2
                time.sleep(0.1)
            assert alive(front)
        finally:
            server.stop(0)
        assert front_ends(os.getpid()) == []

    def test_the_front_end_ends_with_the_thread_that_spawned_it(self) -> None:
        """What the test above guards against, and that ``PR_SET_PDEATHSIG`` is set: a front end spawned on a
        thread that ends once it listens (it set the signal by then) is killed, its link still open (so not
        by the link's end)."""
        ours, theirs = socket.socketpair()
        spawned: list[subprocess.Popen[bytes]] = []

        def spawn() -> None:
            spec = {"fd": theirs.fileno(), "parent": os.getpid(), "listeners": [], "options": []}
            command = [sys.executable, "-m", FRONT_END, json.dumps(spec)]
            spawned.append(subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL))
            assert ours.recv(HEADER.size)  # it listens (on nothing)

        with ours, theirs:
            ours.settimeout(START_S)
            spawner = threading.Thread(target=spawn)
            spawner.start()
            spawner.join(START_S)
            assert spawned[0].wait(WAIT_S) == -signal.SIGKILL


# ------------------------------------------------------------------------------------------ the link


class Link:
    """A `ComposerLink` on one end of a socket pair, on an asyncio loop; the test writes to the other end."""

    def __init__(self) -> None:
        self.lost: list[str] = []

    async def garbage(self, data: bytes) -> tuple[list[str], bool, bytes]:
        """Send ``data`` to the link: why it was lost, whether it is closed, and what the other end read then."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        done = asyncio.Event()

        def on_lost(why: str) -> None:
            self.lost.append(why)
            done.set()

        _, link = await loop.connect_accepted_socket(lambda: ComposerLink(loop, [], on_lost), ours)
        with theirs:
            theirs.sendall(data)
            await asyncio.wait_for(done.wait(), WAIT_S)
            theirs.settimeout(WAIT_S)
            left = await loop.run_in_executor(None, theirs.recv, 16)
        return self.lost, link.closed, left


class TestLinkGarbage:
    """A frame no link sends closes the link, saying why, and the other process reads its end."""

    def test_an_unknown_kind(self) -> None:
        lost, closed, left = asyncio.run(Link().garbage(HEADER.pack(3, 7, 99) + b"abc"))
        assert closed and left == b""
        assert len(lost) == 1 and "frame kind 99 from the front end" in lost[0], lost

    def test_a_frame_larger_than_any(self) -> None:
        lost, closed, left = asyncio.run(Link().garbage(HEADER.pack(MAX_FRAME + 1, 1, CALL)))
        assert closed and left == b""
        assert len(lost) == 1 and f"a frame of {MAX_FRAME + 1} bytes" in lost[0], lost

    def test_the_front_end_ends_at_garbage(self, tmp_path: Path) -> None:
        """The front end's process ends at once at a frame the composer's process never sends."""
        ours, theirs = socket.socketpair()
        spec = {"fd": theirs.fileno(), "parent": os.getpid(), "listeners": [], "options": []}
        with ours:
            front = subprocess.Popen(
                [sys.executable, "-m", FRONT_END, json.dumps(spec)],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
            theirs.close()
            try:
                ours.settimeout(START_S)
                assert ours.recv(HEADER.size)  # it listens (on nothing)
                ours.sendall(HEADER.pack(0, 0, 99))
                assert front.wait(WAIT_S) == 0
            finally:
                if front.poll() is None:
                    front.kill()
                    front.wait(WAIT_S)
