"""Real etcd clusters for the tests: one or three `etcd` processes on free loopback ports, data under tmp_path.

`etcd_binary` finds the executable, or skips the test saying what to install (fails it on CI, where etcd must be
there). `start_etcd_cluster` waits, at most 20 s, until every member answers a linearizable read, so a test
starts with a leader elected. Elections are fast (50 ms heartbeats, 500 ms election timeout) so that a test
which kills a member waits well under a second for the next leader; a test of a slow cluster gives its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import etcd3gw
import pytest
import requests

INSTALL_HINT = "install etcd-server (apt-get install etcd-server)"
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
HEARTBEAT_MS = 50
ELECTION_TIMEOUT_MS = 500


def etcd_binary() -> str:
    """The etcd executable; without it the test is skipped, or failed when CI is "true"."""
    etcd = shutil.which("etcd")
    if etcd is None:
        reason = f"the etcd tests need the etcd server: {INSTALL_HINT}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return etcd


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (held together, so never the same twice)."""
    held = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


@attrs.define
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"


@attrs.define
class EtcdCluster:
    """Running etcd members; `kill` one with SIGKILL, `stop` them all (SIGTERM each, SIGKILL after 10 s)."""

    members: list[EtcdMember]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def kill(self, index: int) -> None:
        proc = self.members[index].process
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        # One at a time: a leader stopping hands the lead to a follower first, and waits seconds for one that is
        # stopping too.
        for m in self.members:
            if m.process is None or m.process.poll() is not None:
                continue
            m.process.terminate()
            try:
                m.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                m.process.kill()
                m.process.wait(STOP_TIMEOUT_S)

    def wait_leader(self) -> None:
        """Wait (at most 20 s) until every running member names one running member as the leader: after `kill`,
        a call proposed to a follower that still forwards to the dead leader would hang until etcd's timeout."""
        deadline = time.monotonic() + START_TIMEOUT_S
        running = [m for m in self.members if m.process is not None and m.process.poll() is None]
        with requests.Session() as session:
            while time.monotonic() < deadline:
                try:
                    status = [
                        session.post(f"http://{m.endpoint}/v3/maintenance/status", json={}, timeout=1.0).json()
                        for m in running
                    ]
                    leaders = {s.get("leader") for s in status}
                    if len(leaders) == 1 and leaders <= {s["header"]["member_id"] for s in status}:
                        return
                except (requests.RequestException, KeyError, ValueError):
                    pass
                time.sleep(0.05)
        raise AssertionError(f"the etcd members agreed on no leader within {START_TIMEOUT_S:g} s:\n{self.logs()}")

    def logs(self) -> str:
        """The tail of every member's log, for a failure message."""
        parts = []
        for m in self.members:
            text = m.log.read_text(errors="replace") if m.log.exists() else ""
            parts.append(f"--- {m.name} ---\n{text[-2000:]}")
        return "\n".join(parts)


def start_etcd_cluster(
    tmp_path: Path,
    members: int = 1,
    *,
    heartbeat_ms: int = HEARTBEAT_MS,
    election_timeout_ms: int = ELECTION_TIMEOUT_MS,
) -> EtcdCluster:
    """Start ``members`` (1 or 3) etcd processes as one new cluster and wait until each one answers."""
    if members not in (1, 3):
        raise ValueError(f"an etcd test cluster has 1 or 3 members, not {members}")
    etcd = etcd_binary()
    ports = free_ports(2 * members)
    root = tmp_path / f"etcd-{uuid.uuid4().hex[:8]}"
    cluster = EtcdCluster(
        [
            EtcdMember(f"m{i}", ports[2 * i], ports[2 * i + 1], root / f"m{i}", root / f"m{i}.log")
            for i in range(members)
        ]
    )
    initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in cluster.members)
    token = f"disagg-test-{uuid.uuid4().hex}"
    try:
        for m in cluster.members:
            m.data_dir.mkdir(parents=True)
            cmd = [
                etcd,
                f"--name={m.name}",
                f"--data-dir={m.data_dir}",
                f"--listen-client-urls=http://127.0.0.1:{m.client_port}",
                f"--advertise-client-urls=http://127.0.0.1:{m.client_port}",
                f"--listen-peer-urls=http://127.0.0.1:{m.peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{m.peer_port}",
                f"--initial-cluster={initial}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token={token}",
                f"--heartbeat-interval={heartbeat_ms}",
                f"--election-timeout={election_timeout_ms}",
                "--logger=zap",
                "--log-level=warn",
            ]
            with m.log.open("wb") as log:
                m.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        _wait_ready(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_ready(cluster: EtcdCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = list(cluster.members)
    with requests.Session() as session:
        while pending:
            m = pending[0]
            assert m.process is not None
            if m.process.poll() is not None:
                raise AssertionError(f"etcd member {m.name} exited with {m.process.returncode}:\n{cluster.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd did not answer within {START_TIMEOUT_S:g} s:\n{cluster.logs()}")
            try:
                # A linearizable read answers only once the cluster has a leader.
                answer = session.post(
                    f"http://{m.endpoint}/v3/kv/range", json={"key": "AA==", "count_only": True}, timeout=1.0
                )
                if answer.status_code == 200:
                    pending.pop(0)
                    continue
            except requests.RequestException:
                pass
            time.sleep(0.05)


def one_etcd_member(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member for a test module's fixture; each test keeps to a prefix of its own (`fresh_prefix`)."""
    cluster = start_etcd_cluster(tmp_path_factory.mktemp("etcd"), members=1)
    yield cluster
    cluster.stop()


def fresh_prefix() -> str:
    """A key prefix no other test uses."""
    return f"/test/{uuid.uuid4().hex}/"


def raw_client(endpoint: str) -> etcd3gw.Etcd3Client:
    """A client of its own for the member at ``endpoint`` (``HOST:PORT``): what etcd holds, read or written past
    the store under test."""
    host, port = endpoint.rsplit(":", 1)
    return etcd3gw.client(host=host, port=int(port), timeout=5.0, api_path="/v3/")


def take_lead(endpoint: str, key: str) -> int:
    """Take the leader key as a new leader would (a create revision above every earlier one); its create revision,
    the fencing epoch."""
    client = raw_client(endpoint)
    client.delete(key)
    client.put(key, uuid.uuid4().hex)
    ((_, meta),) = client.get(key, metadata=True)
    return int(meta["create_revision"])
