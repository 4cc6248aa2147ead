"""High availability on etcd, end to end: a 3-member etcd cluster on loopback, one sim driver served out of
process, and two `disagg serve` replicas sharing them. Killing the active replica mid-load hands the lead to
the standby within 10 seconds; every acknowledged composition is still there; the old replica's epoch is
refused by the driver; a client given both addresses follows the lead on its own. A replica whose start fails
after it won the lead says why and exits as a replica without etcd does; one whose write no etcd member answers
exits as a lost lead; one on an etcd whose election timeout is more than a third of its lease says so as it
starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import etcd3gw
import pytest
from conformance_helpers import ServedDriver
from disagg.client import NO_RETRY, FabricManagerClient
from disagg.errors import FabricUnavailableError, StaleEpochError
from disagg.interfaces import CallContext, epoch_announcement
from disagg.remote import RemoteFabric
from disagg.requestlang import parse_request
from disagg_sim import create_fabric
from etcd_helpers import etcd_binary, free_ports, start_etcd_cluster
from process_helpers import ChildOutput

TAKEOVER_S = 10.0
START_S = 60.0
ADVISED = "^test: etcd's election timeout was read$"
ADVICE_HOOK = (
    "import sys\n"
    "from disagg.ha import timeouts\n"
    "advise = timeouts.advise\n\n"
    "def advised(*args, **kwargs):\n"
    "    try:\n"
    "        advise(*args, **kwargs)\n"
    "    finally:\n"
    '        sys.stderr.write("test: etcd\'s election timeout was read\\n")  # one write: no log line between\n'
    "        sys.stderr.flush()\n\n"
    "timeouts.advise = advised\n"
)
"""A replica's ``sitecustomize``: says `ADVISED` once `disagg.ha.timeouts.advise` has returned, after what it logged
(on the same stream), so that a test knows whether it warned."""
MAX_JOBS = 70
"""Compositions the load may make at most: the fabric has 80 hosts, and each takes one."""


class Replica:
    """One `disagg serve` process, whose output is read as it comes (`ChildOutput`)."""

    def __init__(self, config: Path, port: int, state: Path, path: Path | None = None) -> None:
        """``path``, when given, goes before the PYTHONPATH (a ``sitecustomize`` there runs as the process starts)."""
        self.address = f"127.0.0.1:{port}"
        env = {**os.environ, "DISAGG_STATE_DIR": str(state)}
        if path is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.cli.main", "serve", "--config", str(config), "--listen", self.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.output = ChildOutput(self.proc)

    def epoch(self) -> int:
        m = self.output.wait_for(r"leading with fencing epoch (\d+)", 0)
        assert m is not None, self.output.text
        return int(m.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ServedDriver, list[Replica], str]]:
    etcd_binary()
    etcd = start_etcd_cluster(tmp_path / "etcd", members=3)
    options = ("generate.devices=600", "generate.hosts_per_domain=16", f"state_file={tmp_path / 'sim.json'}")
    driver = ServedDriver("sim", "sim0", f"unix:{tmp_path / 'sim0.sock'}", options, {})
    driver.start()
    config = tmp_path / "disagg.toml"
    endpoints = ", ".join(f'"{e}"' for e in etcd.endpoints)
    config.write_text(
        f'[state]\nledger = "etcd"\nendpoints = [{endpoints}]\nprefix = "/ha-test/"\nlease_ttl_s = 4\n\n'
        f'[[fabric]]\nname = "sim0"\ndriver = "remote"\noptions = {{ address = "{driver.address}" }}\n'
    )
    replicas = [Replica(config, port, tmp_path / f"state{n}") for n, port in enumerate(free_ports(2))]
    try:
        yield driver, replicas, driver.address
    finally:
        for r in replicas:
            r.stop()
        driver.stop()
        etcd.stop()


def _replica_alone(
    tmp_path: Path, endpoints: list[str], prefix: str, lease_ttl_s: int = 3, path: Path | None = None
) -> Replica:
    """One `disagg serve` replica on etcd at ``endpoints``, with the demo PCIe rack in its process (no other replica
    shares it); ``path`` as `Replica` takes it."""
    quoted = ", ".join(f'"{e}"' for e in endpoints)
    config = tmp_path / "disagg.toml"
    config.write_text(
        f'[state]\nledger = "etcd"\nendpoints = [{quoted}]\nprefix = "{prefix}"\nlease_ttl_s = {lease_ttl_s}\n\n'
        '[[fabric]]\nname = "pcie0"\ndriver = "sim"\noptions = { topology = "demo-pcie" }\n'
    )
    return Replica(config, free_ports(1)[0], tmp_path / "state", path)


def _leader(replicas: list[Replica], timeout: float) -> Replica:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in replicas:
            if r.output.wait_for(r"^serving on ", 0):
                return r
        time.sleep(0.1)
    raise AssertionError("no replica leads:\n" + "\n---\n".join(r.output.text for r in replicas))


class TestFailover:
    """The standby takes over within 10 s of the active replica's death, loses nothing acknowledged, and the
    dead replica's epoch can no longer change the hardware."""

    def test_kill_the_active_replica_mid_load(self, cluster: tuple[ServedDriver, list[Replica], str]) -> None:
        _, replicas, driver_address = cluster
        first = _leader(replicas, START_S)
        standby = next(r for r in replicas if r is not first)
        assert standby.output.wait_for(r"^standby on ", START_S), standby.output.text
        # The client as a user makes it: its calls ride through the takeover on their own (a call waits for a
        # serving replica; one cut off by the kill is retried with its request id), within their deadline.
        client = FabricManagerClient(",".join(r.address for r in replicas), timeout_s=TAKEOVER_S + 10)
        acknowledged: dict[str, str] = {}
        killed_at: list[float] = []

        def compose(n: int) -> None:
            comp = client.compose(parse_request(f"job-{n}", ["gpu x1"])).composition
            assert comp is not None
            acknowledged[comp.name] = comp.id

        for n in range(5):
            compose(n)
        only_the_standby = FabricManagerClient(standby.address, timeout_s=5, retries=NO_RETRY)
        with only_the_standby, pytest.raises(FabricUnavailableError, match="this replica is a standby"):
            only_the_standby.compositions()
        old_epoch = first.epoch()
        loader_error: list[BaseException] = []
        calls: list[tuple[float, float]] = []
        served = threading.Event()

        def load() -> None:
            """Compose one job after another through the kill and the takeover, and three more after it."""
            try:
                more = 3
                for n in range(5, MAX_JOBS):
                    start = time.monotonic()
                    compose(n)
                    calls.append((start, time.monotonic()))
                    more -= served.is_set()
                    if not more:
                        return
            except BaseException as exc:
                loader_error.append(exc)

        loader = threading.Thread(target=load)
        loader.start()
        time.sleep(0.3)
        first.proc.send_signal(signal.SIGKILL)
        killed_at.append(time.monotonic())
        assert standby.output.wait_for(r"^serving on ", TAKEOVER_S), (
            "the standby did not take over:\n" + standby.output.text
        )
        took = time.monotonic() - killed_at[0]
        served.set()
        loader.join(60)
        logs = "\n---\n".join(r.output.text for r in replicas)
        assert not loader_error, f"{loader_error}\n{logs}"
        assert took <= TAKEOVER_S
        killed = killed_at[0]
        assert any(start < killed + took and end > killed for start, end in calls), "no call rode the takeover"

        listed = {c.name: c.id for c in client.compositions()}
        assert listed == acknowledged, "an acknowledged composition was lost or duplicated"
        new_epoch = standby.epoch()
        assert new_epoch > old_epoch

        hardware = RemoteFabric("sim0", driver_address)
        try:
            held = {b.device for b in hardware.bindings()}
            assert held == {d for c in client.compositions() for d in c.device_ids}
            free = next(d.id for d in hardware.discover().devices if d.id not in held and "-g" in d.id)
            host = client.get("job-0").host
            with pytest.raises(StaleEpochError):
                hardware.bind(free, host, CallContext(epoch=old_epoch))
            assert free not in {b.device for b in hardware.bindings()}
        finally:
            hardware.close()
            client.close()


class TestStartFailure:
    """A start that fails after the replica won the lead is reported as a start without etcd reports it: the
    error's message and exit code, no traceback, and no lost lead."""

    def test_a_ledger_record_that_does_not_decode(self, tmp_path: Path) -> None:
        """It exited 3, "this replica lost the lead", the ledger's message buried in a traceback."""
        etcd_binary()
        etcd = start_etcd_cluster(tmp_path / "etcd")
        try:
            host, port = etcd.endpoints[0].rsplit(":", 1)
            etcd3gw.client(host=host, port=int(port)).put("/damaged/compositions/x", "{not json")
            replica = _replica_alone(tmp_path, etcd.endpoints[:1], "/damaged/")
            try:
                assert replica.output.wait_ended(START_S), replica.output.text
                code = replica.proc.wait(10)
            finally:
                replica.stop()
        finally:
            etcd.stop()
        said = replica.output.text
        assert code == 2, said  # a ledger to restore from a backup, as SQLite's route exits
        assert "disagg: error: the ledger at etcd" in said and "restore it from a backup" in said, said
        assert "lost the lead" not in said and "Traceback" not in said, said


class TestANewEtcdCluster:
    """The move to a new etcd cluster as docs/ha.md writes it: its leader's epoch is below the highest a driver saw,
    so a replica exits 1 naming that epoch and `epoch_base`; with `epoch_base` set to it, a replica leads above it."""

    def test_epoch_base_lets_a_replica_lead_again(self, tmp_path: Path) -> None:
        etcd_binary()
        state = tmp_path / "pcie0.json"
        seen = 1 << 20  # the old cluster's last epoch, far above the new one's revisions
        hardware = create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(state)})
        hardware.unbind(epoch_announcement("pcie0"), CallContext(epoch=seen))
        hardware.close()
        etcd = start_etcd_cluster(tmp_path / "etcd")
        try:
            config = tmp_path / "disagg.toml"
            refused = self._replica(config, etcd.endpoints, state, "")
            try:
                assert refused.output.wait_ended(START_S), refused.output.text
                code = refused.proc.wait(10)
            finally:
                refused.stop()
            said = refused.output.text
            assert code == 1, said
            assert f"is older than {seen}, the highest seen" in said and "set [state] epoch_base" in said, said
            replica = self._replica(config, etcd.endpoints, state, f"epoch_base = {seen}\n")
            try:
                assert _leader([replica], START_S) is replica
                assert replica.epoch() > seen
            finally:
                replica.stop()
        finally:
            etcd.stop()

    @staticmethod
    def _replica(config: Path, endpoints: list[str], state: Path, extra: str) -> Replica:
        config.write_text(
            f'[state]\nledger = "etcd"\nendpoints = ["{endpoints[0]}"]\nprefix = "/moved/"\nlease_ttl_s = 3\n{extra}\n'
            f'[[fabric]]\nname = "pcie0"\ndriver = "sim"\n'
            f'options = {{ topology = "demo-pcie", state_file = "{state}" }}\n'
        )
        return Replica(config, free_ports(1)[0], config.parent / "state")


class TestLeaseEndsMidWrite:
    """A ledger write that no etcd member answers until the leader's lease may have run out ends as a lost lead:
    exit 3, saying so. It failed the ledger instead (exit 1, "restart it once the ledger can be written") when the
    server's timer saw the write give up before the step-down saw the lease run out."""

    def test_no_etcd_member_answers_a_write(self, tmp_path: Path) -> None:
        etcd_binary()
        etcd = start_etcd_cluster(tmp_path / "etcd", members=3)
        members = [m.process for m in etcd.members if m.process is not None]
        try:
            replica = _replica_alone(tmp_path, etcd.endpoints, "/mid-write/", lease_ttl_s=2)
            try:
                assert replica.output.wait_for(r"^serving on ", START_S), replica.output.text
                for member in members:  # a partition: no member answers the leader any more
                    member.send_signal(signal.SIGSTOP)
                client = FabricManagerClient(replica.address, timeout_s=TAKEOVER_S, retries=NO_RETRY)
                with client, pytest.raises(FabricUnavailableError):
                    client.compose(parse_request("cut-off", ["gpu x1"]))
                assert replica.output.wait_ended(START_S), replica.output.text
                code = replica.proc.wait(10)
            finally:
                replica.stop()
        finally:
            for member in members:
                member.send_signal(signal.SIGCONT)
            etcd.stop()
        said = replica.output.text
        assert code == 3, said
        assert "lost the lead (epoch" in said and "this replica lost the lead" in said, said
        assert "restart it once the ledger can be written" not in said, said


class TestElectionTimeoutAdvice:
    """An etcd whose election timeout is more than a third of ``lease_ttl_s`` may take longer to elect a leader,
    after its leader's death, than the lease lasts, which costs the fabric manager's leader its lead: `disagg serve`
    says so once as it starts, naming both figures and what to set."""

    def _started(self, tmp_path: Path, election_timeout_ms: int) -> str:
        """What `disagg serve` on a one-member etcd with ``election_timeout_ms`` said until it served and had read
        etcd's election timeout, which it does beside its start (maybe after serving, or saying nothing): a
        ``sitecustomize`` in the replica says when `advise` has returned (`ADVISED`)."""
        etcd_binary()
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(ADVICE_HOOK)
        etcd = start_etcd_cluster(tmp_path / "etcd", heartbeat_ms=100, election_timeout_ms=election_timeout_ms)
        try:
            replica = _replica_alone(tmp_path, etcd.endpoints, "/advice/", lease_ttl_s=4, path=hook)
            try:
                assert replica.output.wait_for(r"^serving on ", START_S), replica.output.text
                read = replica.output.wait_for(ADVISED, START_S)
                assert read, (
                    f"no read of etcd's --election-timeout {START_S:.0f} s after serving: {replica.output.text}"
                )
            finally:
                replica.stop()
        finally:
            etcd.stop()
        return replica.output.text

    def test_an_election_timeout_above_a_third_of_the_lease(self, tmp_path: Path) -> None:
        said = self._started(tmp_path, 2000)
        told = [line for line in said.splitlines() if "--election-timeout" in line and "WARNING" in line]
        assert len(told) == 1, said
        assert "--election-timeout of 2000 ms" in told[0] and "lease_ttl_s of 4 s" in told[0], told
        assert "1333 ms or less" in told[0] and "lease_ttl_s = 6" in told[0], told

    def test_an_election_timeout_within_a_third_of_the_lease(self, tmp_path: Path) -> None:
        said = self._started(tmp_path, 1000)
        assert "--election-timeout" not in said, said
