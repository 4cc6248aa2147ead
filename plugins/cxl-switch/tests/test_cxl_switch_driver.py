"""The cxl-switch driver's own behaviour beyond the conformance suite: options, an emulator given by address,
adoption of a running emulator by a restarted driver, and the emulator's lifetime."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from cxl_switch_client import Client, SocketTransport, emulator_process
from disagg.errors import (
    CapacityExhaustedError,
    ConfigError,
    DeadlineExceededError,
    DeviceBusyError,
    FabricUnavailableError,
    StaleEpochError,
    UnsupportedError,
)
from disagg.interfaces import CallContext
from disagg.model import Binding, FabricEvent, FabricEventKind, Health, PoolKind
from disagg_cxl_switch.driver import CxlSwitchFabric, create_fabric, process
from disagg_cxl_switch.emulator.vendor import InjectLinkDownRequest, InjectSurpriseRemovalRequest, VendorOpcode
from disagg_cxl_switch.returncodes import ReturnCode


def fresh_ctx() -> CallContext:
    """A context with 30 s to go from now (one made at import would expire in a long, randomly ordered run)."""
    return CallContext.with_timeout(30.0, epoch=1)


class TestOptions:
    """Bad options are ConfigErrors that name the fabric and the field, before any process starts."""

    @pytest.mark.parametrize(
        ("options", "field"),
        [
            ({}, "address"),
            ({"address": "10.0.0.1:9000"}, "address"),
            ({"state_dir": "/tmp/x", "hosts": 0}, "hosts"),
            ({"state_dir": "/tmp/x", "hosts": ["a", "a"]}, "hosts"),
            # Names bind and unbind refuse as ids: the switch reported the host, and nothing could be bound to it.
            ({"state_dir": "/tmp/x", "hosts": ["rack 1"]}, "hosts"),
            ({"state_dir": "/tmp/x", "hosts": ["h\t1"]}, "hosts"),
            ({"state_dir": "/tmp/x", "hosts": ["h" * 257]}, "hosts"),
            ({"state_dir": "/tmp/x", "gpus": -1}, "gpus"),
            ({"state_dir": "/tmp/x", "stop_emulator": "never"}, "stop_emulator"),
            ({"state_dir": "/tmp/x", "bind_delay_ms": float("nan")}, "bind_delay_ms"),
            ({"state_dir": "/tmp/x", "bind_delay_ms": float("inf")}, "bind_delay_ms"),
            ({"state_dir": "/tmp/x", "bind_delay_ms": -1}, "bind_delay_ms"),
            ({"state_dir": "/tmp/x", "ld_count": 3, "mld_capacity_gib": 1}, "mld_capacity_gib"),
            ({"state_dir": "/tmp/x", "dc_regions": 9}, "dc_regions"),
            ({"state_dir": "/tmp/x", "dc_capacity_gib": 1, "dc_regions": 3}, "dc_capacity_gib"),
            ({"state_dir": "/tmp/x", "gpus": 300}, "gpus"),
            ({"state_dir": "/tmp/x", "gpus": 254, "ld_count": 0, "dc_capacity_gib": 0}, "gpus"),  # 256 ports
            ({"state_dir": "/tmp/x", "ld_count": 17, "mld_capacity_gib": 17}, "ld_count"),
            ({"state_dir": "/tmp/x", "colour": "blue"}, "colour"),
        ],
    )
    def test_rejected(self, options: dict[str, object], field: str) -> None:
        with pytest.raises(ConfigError, match="fabric 'bad' \\(driver cxl-switch\\)") as raised:
            create_fabric("bad", options)
        assert raised.value.field == field

    @pytest.mark.parametrize(
        "key", ["ld_count", "mld_capacity_gib", "dc_capacity_gib", "dc_regions", "bind_delay_ms", "stop_emulator"]
    )
    @pytest.mark.parametrize("state_dir", [None, "/tmp/x"], ids=["address", "address+state_dir"])
    def test_emulator_settings_refused_beside_address(self, key: str, state_dir: str | None) -> None:
        """The emulator at ``address`` runs with its own settings: one written beside it would be ignored."""
        values = {"bind_delay_ms": 20, "stop_emulator": "always", "dc_regions": 1}
        options = {"address": "unix:/tmp/x.sock", key: values.get(key, 4)}
        if state_dir is not None:
            options["state_dir"] = state_dir
        with pytest.raises(ConfigError, match=f"{key} applies to an emulator the driver starts") as raised:
            create_fabric("bad", options)
        assert raised.value.field == key
        assert "state_dir" in raised.value.message

    def test_unreachable_address(self, tmp_path: Path) -> None:
        with pytest.raises(FabricUnavailableError):
            create_fabric("gone", {"address": f"unix:{tmp_path / 'none.sock'}"})


class TestAddress:
    """A fabric on an emulator it did not start binds through it and leaves it running on close."""

    def test_bind_through_a_given_emulator(self, tmp_path: Path) -> None:
        sock = tmp_path / "e.sock"
        with emulator_process(sock, "--gpus", "2", "--dc-capacity-gib", "0", "--ld-count", "0") as proc:
            fabric = create_fabric("ext", {"address": f"unix:{sock}", "gpus": 2})
            try:
                assert [d.id for d in fabric.discover().devices] == ["ext/port2", "ext/port3"]
                assert fabric.bind("ext/port3", "h1", fresh_ctx()) == Binding("ext/port3", "h1")
                assert fabric.bindings() == [Binding("ext/port3", "h1")]
                fabric.unbind(Binding("ext/port3", "h1"), fresh_ctx())
            finally:
                fabric.close()
            assert proc.poll() is None

    def test_hosts_must_match_the_vcss(self, tmp_path: Path) -> None:
        sock = tmp_path / "e.sock"
        with emulator_process(sock, "--hosts", "2"), pytest.raises(ConfigError, match="2 VCSs but 3 hosts"):
            create_fabric("ext", {"address": f"unix:{sock}", "hosts": 3})


class TestLifetime:
    """A started emulator survives a close that leaves bindings (a restarted driver finds them) and stops on
    an idle close."""

    def test_restart_adopts_the_emulator(self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path) -> None:
        first = make_switch()
        first.bind("sw/port2", "h0", fresh_ctx())
        first.close()
        assert process.running(switch_dir)
        again = make_switch()
        assert again.bindings() == [Binding("sw/port2", "h0")]
        again.unbind(Binding("sw/port2", "h0"), fresh_ctx())
        again.close()
        assert not process.running(switch_dir)

    @pytest.mark.parametrize("revision", [None, "1"], ids=["none", "older"])
    def test_an_emulator_of_another_revision_is_not_adopted(
        self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path, revision: str | None
    ) -> None:
        """An emulator left running by another version of the driver (one that recorded no revision: its pid
        file one line, or an older revision) is refused, naming the state_dir and the pid, and left running with
        its bindings, for the version that started it to release; adopted, its wire was misread."""
        first = make_switch()
        first.bind("sw/port2", "h0", fresh_ctx())
        first.close()
        pid = process.read_pid(switch_dir)
        recorded = switch_dir / "emulator.revision"
        if revision is None:
            recorded.unlink(missing_ok=True)
        else:
            recorded.write_text(f"{pid} {revision}\n")
        with pytest.raises(ConfigError, match=rf"{re.escape(str(switch_dir))} \(pid {pid}\).*kill {pid}") as raised:
            make_switch()
        assert raised.value.field == "state_dir"
        assert process.running(switch_dir) and process.read_pid(switch_dir) == pid
        recorded.write_text(f"{pid} {process.EMULATOR_REVISION}\n")
        again = make_switch()
        assert again.bindings() == [Binding("sw/port2", "h0")]

    def test_an_emulator_started_with_other_options_is_not_adopted(
        self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path
    ) -> None:
        """Adopted, the options configured since were silently not applied: the switch kept its 4 GPUs and 1 NVMe
        drive, and its fourth GPU was listed as an NVMe drive. It is refused naming what differs, and left
        running with its bindings."""
        first = make_switch()
        first.bind("sw/port2", "h0", fresh_ctx())
        first.close()
        pid = process.read_pid(switch_dir)
        with pytest.raises(ConfigError, match=r"fabric 'sw' \(driver cxl-switch\): ") as raised:
            make_switch(gpus=3, nvme=2, bind_delay_ms=5)
        assert raised.value.field == "bind_delay_ms"
        assert (
            f"the CXL switch emulator running in {switch_dir} (pid {pid}) was started with other options than those "
            "configured now (bind_delay_ms 20, not 5; gpus 4, not 3; nvme 1, not 2)"
        ) in raised.value.message
        assert f"kill {pid}" in raised.value.message
        assert process.running(switch_dir) and process.read_pid(switch_dir) == pid
        again = make_switch(bind_delay_ms=20)
        assert again.bindings() == [Binding("sw/port2", "h0")]

    def test_an_emulator_of_a_revision_read_alike_is_adopted(
        self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Revision 3 changed only what spends an injected bind failure: an emulator of revision 2 running after an
        upgrade was refused, its bindings given up or released with the old version, though the driver reads its
        wire alike. It is adopted with a warning that says what differs."""
        first = make_switch()
        first.bind("sw/port2", "h0", fresh_ctx())
        first.close()
        pid = process.read_pid(switch_dir)
        (switch_dir / "emulator.revision").write_text(f"{pid} 2\n")
        with caplog.at_level(logging.WARNING, logger="disagg.cxl_switch"):
            again = make_switch()
        assert again.bindings() == [Binding("sw/port2", "h0")]
        assert any("of revision 2" in r.getMessage() and "stays armed" in r.getMessage() for r in caplog.records)

    def test_one_driver_per_state_dir(self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path) -> None:
        """A second driver on the state_dir is refused: closing it would have stopped the emulator the first
        one uses (a CLI command beside a running server); once the first has closed, the next one gets it."""
        first = make_switch()
        with pytest.raises(FabricUnavailableError, match="another cxl-switch driver holds"):
            make_switch()
        first.bind("sw/port2", "h0", fresh_ctx())
        first.close()
        again = make_switch()
        assert again.bindings() == [Binding("sw/port2", "h0")]
        again.unbind(Binding("sw/port2", "h0"), fresh_ctx())

    def test_a_failed_start_gives_the_state_dir_back(
        self, make_switch: Callable[..., CxlSwitchFabric], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A driver whose emulator would not start lets the state_dir go, so that a retry is not told that
        another driver holds it."""

        def no_start(*args: object) -> None:
            raise FabricUnavailableError("the emulator would not start")

        with monkeypatch.context() as patched:
            patched.setattr(process, "start", no_start)
            with pytest.raises(FabricUnavailableError, match="would not start") as failed:
                make_switch()
        assert failed.value is not None  # the error, and its traceback, are still referenced here
        assert make_switch().bindings() == []

    def test_a_state_dir_that_is_a_file(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("in the way")
        with pytest.raises(ConfigError, match=r"state_dir .* cannot be used") as raised:
            create_fabric("sw", {"state_dir": str(tmp_path / "file")})
        assert raised.value.field == "state_dir"

    def test_stop_always(self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path) -> None:
        fabric = make_switch(stop_emulator="always")
        fabric.bind("sw/port2", "h0", fresh_ctx())
        fabric.close()
        assert not process.running(switch_dir)

    def test_a_switch_that_cannot_say_it_is_idle_keeps_running(
        self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """With the MLD's link down its allocations cannot be read; that is not idle, so the emulator and the
        memory carved in it outlive the close, and the next driver finds the allocation once the link is back."""
        fabric = make_switch(**MLD_ONLY)
        pool_id = pool_of(fabric, PoolKind.MLD)
        fabric.pool(pool_id).allocate("job-a", "h0", 1024**3, fresh_ctx())
        fabric.fail_device(memory_device(fabric, PoolKind.MLD))
        with caplog.at_level(logging.WARNING, logger="disagg.cxl_switch"):
            fabric.close()
        assert process.running(switch_dir)
        assert "left running" in caplog.text
        again = make_switch(**MLD_ONLY)
        again.repair_device(memory_device(again, PoolKind.MLD))
        assert [a.id for a in again.pool(pool_id).allocations()] == ["job-a"]

    @pytest.mark.parametrize("kind", [PoolKind.DCD, PoolKind.MLD], ids=["dcd", "mld"])
    def test_restart_while_a_pool_device_is_down(
        self, make_switch: Callable[..., CxlSwitchFabric], kind: PoolKind
    ) -> None:
        """A driver restarted while a pool's device is failed starts; the pool answers FabricUnavailableError
        until the device is repaired, then reads its capacity and carves."""
        first = make_switch(**POOLS)
        pool_id = pool_of(first, kind)
        first.bind("sw/port2", "h0", fresh_ctx())  # keeps the emulator up across the close
        first.fail_device(memory_device(first, kind))
        first.close()
        again = make_switch(**POOLS)
        device = memory_device(again, kind)
        assert next(d for d in again.discover().devices if d.id == device).health is Health.FAILED
        with pytest.raises(FabricUnavailableError):
            again.pool(pool_id).allocations()
        again.repair_device(device)
        (info,) = [p for p in again.discover().pools if p.id == pool_id]
        assert info.capacity.total_bytes > 0
        allocation = again.pool(pool_id).allocate("m", "h1", 1, fresh_ctx())
        assert again.pool(pool_id).allocations() == [allocation]

    @pytest.mark.parametrize("content", ["{truncated", "[]", '{"epoch": "one"}', '{"tags": 3}'])
    def test_a_corrupt_state_file(self, switch_dir: Path, content: str) -> None:
        """A driver-state.json that cannot be read is a ConfigError naming the file, and no emulator is left
        running for a fabric that was never built."""
        switch_dir.mkdir(parents=True)
        (switch_dir / "driver-state.json").write_text(content)
        with pytest.raises(ConfigError, match=r"driver-state\.json") as raised:
            create_fabric("sw", {"state_dir": str(switch_dir), "gpus": 1})
        assert raised.value.field == "state_dir"
        assert not process.running(switch_dir)


class TestAnEpochThatCannotBeSaved:
    """The highest epoch was raised in memory before it was written: a save that failed (a full or failing disk)
    raised the OSError itself, not an SDK error, and the announcement's retry, finding the epoch in memory, wrote
    nothing, so a restarted driver took a deposed manager's older epoch again."""

    FENCE = Binding("sw/disagg-fence", "disagg-fence")

    def test_it_is_unavailable_and_its_retry_saves_it(
        self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path
    ) -> None:
        first = make_switch()
        first.bind("sw/port2", "h0", fresh_ctx())  # epoch 1, saved; a binding keeps the emulator up
        blocker = switch_dir / "driver-state.json.tmp"  # the save's temporary file cannot be written
        blocker.mkdir()
        with pytest.raises(FabricUnavailableError, match=r"driver-state\.json cannot be written"):
            first.unbind(self.FENCE, CallContext.with_timeout(30.0, epoch=5))
        blocker.rmdir()
        first.unbind(self.FENCE, CallContext.with_timeout(30.0, epoch=5))  # the announcement retried
        first.close()
        again = make_switch()
        with pytest.raises(StaleEpochError):
            again.bind("sw/port3", "h1", CallContext.with_timeout(30.0, epoch=4))
        assert again.bindings() == [Binding("sw/port2", "h0")]

    def test_an_epoch_not_saved_is_not_taken(
        self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path
    ) -> None:
        """Until its save succeeds a newer epoch fences nothing: the manager that announced it was told it failed."""
        fabric = make_switch()
        fabric.bind("sw/port2", "h0", fresh_ctx())
        (switch_dir / "driver-state.json.tmp").mkdir()
        with pytest.raises(FabricUnavailableError):
            fabric.unbind(self.FENCE, CallContext.with_timeout(30.0, epoch=5))
        fabric.unbind(Binding("sw/port2", "h0"), fresh_ctx())  # epoch 1, which 5 would have fenced
        assert fabric.bindings() == []


MLD_ONLY = {"gpus": 2, "nvme": 0, "ld_count": 4, "mld_capacity_gib": 4, "dc_capacity_gib": 0}
POOLS = {"gpus": 1, "nvme": 0, "ld_count": 4, "mld_capacity_gib": 4, "dc_capacity_gib": 1}


def pool_of(fabric: CxlSwitchFabric, kind: PoolKind) -> str:
    """The id of the fabric's pool of ``kind`` (its name carries the port, fixed at start)."""
    port = fabric.view.dcd_port if kind is PoolKind.DCD else fabric.view.mld_port
    return f"{fabric.name}/{kind.value}-port{port}"


def memory_device(fabric: CxlSwitchFabric, kind: PoolKind) -> str:
    port = fabric.view.dcd_port if kind is PoolKind.DCD else fabric.view.mld_port
    assert port is not None
    return fabric.device_id_of(port)


class TestRepair:
    """`repair_device` brings a device back as what it was, or refuses."""

    @pytest.mark.parametrize("kind", [PoolKind.DCD, PoolKind.MLD], ids=["dcd", "mld"])
    def test_a_pulled_memory_device_is_not_replaced_by_another_kind(
        self, make_switch: Callable[..., CxlSwitchFabric], kind: PoolKind
    ) -> None:
        """The emulator hot-adds only PCIe endpoints: a pulled MLD or DCD would come back as a NIC."""
        fabric = make_switch(**POOLS)
        device = memory_device(fabric, kind)
        port = fabric.view.port_of[device]
        fabric.client.call(VendorOpcode.INJECT_SURPRISE_REMOVAL, InjectSurpriseRemovalRequest(port))
        with pytest.raises(UnsupportedError, match="cannot hot-add"):
            fabric.repair_device(device)
        assert not fabric.port_view(port).present


class TestDcdPool:
    def test_a_refused_allocation_leaves_no_name(
        self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path
    ) -> None:
        """The driver names an allocation's tag before it asks the switch (so a crash in between can still name
        the extent); a refused one's name goes again, or every refused attempt would stay in the state file."""
        fabric = make_switch(dc_capacity_gib=1)
        (pool,) = [p for p in fabric.discover().pools if "dcd" in p.id]
        with pytest.raises(CapacityExhaustedError):
            fabric.pool(pool.id).allocate("too-big", "h0", 2 * 1024**3, fresh_ctx())
        assert "too-big" not in (switch_dir / "driver-state.json").read_text()


class TestEvents:
    def test_a_handler_that_raises_stops_no_event(self, make_switch: Callable[..., CxlSwitchFabric]) -> None:
        """A subscriber whose handler raises loses nothing for the others, nor its own later events."""
        fabric = make_switch()
        raised: list[FabricEvent] = []
        seen: list[FabricEvent] = []

        def broken(event: FabricEvent) -> None:
            raised.append(event)
            raise RuntimeError("a broken subscriber")

        fabric.subscribe(broken)
        fabric.subscribe(seen.append)
        fabric.fail_device("sw/port2")
        wait_until(lambda: len(seen) >= 1)
        fabric.repair_device("sw/port2")
        wait_until(lambda: len(seen) >= 2)
        assert [e.health for e in seen] == [Health.FAILED, Health.OK]
        assert raised == seen

    def test_a_link_event_waits_for_the_handler_before_it(self, make_switch: Callable[..., CxlSwitchFabric]) -> None:
        """set_link's LINK_DOWN is told on the poller's thread once the handler running there returns: told inside
        set_link, it ran beside that handler, ahead of the events the poller had still to tell."""
        fabric = make_switch()
        entered, release = threading.Event(), threading.Event()
        seen: list[tuple[FabricEventKind, str]] = []
        threads: set[threading.Thread] = set()

        def handler(event: FabricEvent) -> None:
            seen.append((event.kind, event.subject))
            threads.add(threading.current_thread())
            if event.kind is FabricEventKind.DEVICE_HEALTH:
                entered.set()
                release.wait(5.0)

        fabric.subscribe(handler)
        fabric.fail_device("sw/port2")
        assert entered.wait(5.0), "the failure was never told"
        try:
            fabric.set_link("h0", "sw/switch0", False)
            assert seen == [(FabricEventKind.DEVICE_HEALTH, "sw/port2")], "told inside set_link"
        finally:
            release.set()
        wait_until(lambda: len(seen) >= 2)
        assert seen == [(FabricEventKind.DEVICE_HEALTH, "sw/port2"), (FabricEventKind.LINK_DOWN, "h0|sw/switch0")]
        assert threading.current_thread() not in threads

    def test_link_events_in_the_order_the_link_changed(
        self, make_switch: Callable[..., CxlSwitchFabric], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A set_link up that runs while the link's down is being told (before its handlers ran) is told after it:
        told in the order set_link's calls ended, the link's last event was LINK_DOWN while it was up."""
        fabric = make_switch()
        seen: list[FabricEventKind] = []
        fabric.subscribe(lambda event: seen.append(event.kind))
        publish, raced = fabric._publish, threading.Event()

        def up_meanwhile(events: Sequence[FabricEvent], *args: object, **kwargs: object) -> None:
            if not raced.is_set() and any(e.kind is FabricEventKind.LINK_DOWN for e in events):
                raced.set()
                other = threading.Thread(target=fabric.set_link, args=("h0", "sw/switch0", True))
                other.start()
                other.join(5.0)
            publish(events, *args, **kwargs)

        monkeypatch.setattr(fabric, "_publish", up_meanwhile)
        fabric.set_link("h0", "sw/switch0", False)
        wait_until(lambda: len(seen) >= 2)
        assert raced.is_set()
        assert all(link.up for link in fabric.discover().links if "h0" in (link.a, link.b))
        assert seen == [FabricEventKind.LINK_DOWN, FabricEventKind.LINK_UP]

    def test_a_link_change_just_before_close_is_told(self, make_switch: Callable[..., CxlSwitchFabric]) -> None:
        """set_link's LINK_DOWN queued just before close is told before close returns: the poller stopped between
        two polls and left it queued, so a subscriber never heard of the link's last change."""
        fabric = make_switch()
        seen: list[tuple[FabricEventKind, str]] = []
        fabric.subscribe(lambda event: seen.append((event.kind, event.subject)))
        fabric.set_link("h0", "sw/switch0", False)
        fabric.close()
        assert seen == [(FabricEventKind.LINK_DOWN, "h0|sw/switch0")]

    def test_events_after_the_switch_restarted(self, tmp_path: Path) -> None:
        """A restarted emulator numbers its event records from 1 again: the poller, still past the old numbers,
        read none of them, so a device that failed after a switch restart never reached the subscribers. The
        restart itself is told first (RESYNC_REQUIRED): it lost the switch's bindings with no record. The new
        emulator is out of the poller's reach until its device failed: reached before, its ports' read would tell
        port3's health, never told, ahead of the failure (`test_a_failure_after_the_restart_was_read`)."""
        with switch_gone(tmp_path) as seen:
            hidden = tmp_path / "new.sock"
            with emulator_process(hidden, *RESTARTED_ARGS):
                fail_port3(hidden)
                hidden.rename(tmp_path / "e.sock")  # only now can the poller reach the new switch
                wait_until(lambda: any(e.subject == "ext/port3" for e in seen))
                assert [(e.kind, e.subject, e.health) for e in seen] == [
                    (FabricEventKind.RESYNC_REQUIRED, "ext/switch0", None),  # before any record of the new switch
                    (FabricEventKind.DEVICE_HEALTH, "ext/port3", Health.FAILED),
                ]
                assert seen[-1].message == "port 3: link down"  # its record, read from the new switch's first

    def test_a_failure_after_the_restart_was_read(self, tmp_path: Path) -> None:
        """A device that fails once the poller has read the restarted switch (RESYNC_REQUIRED, then the ports'
        health where none was told) is told by its record, last: the poller's place is the new switch's."""
        with switch_gone(tmp_path) as seen:
            sock = tmp_path / "e.sock"
            with emulator_process(sock, *RESTARTED_ARGS):
                wait_until(lambda: any(e.subject == "ext/port3" for e in seen))  # the ports read
                fail_port3(sock)
                wait_until(lambda: bool(seen) and seen[-1].health is Health.FAILED)
                assert [(e.kind, e.subject, e.health) for e in seen] == [
                    (FabricEventKind.RESYNC_REQUIRED, "ext/switch0", None),
                    (FabricEventKind.DEVICE_HEALTH, "ext/port3", Health.OK),  # never told before the restart
                    (FabricEventKind.DEVICE_HEALTH, "ext/port3", Health.FAILED),
                ]
                assert seen[-1].message == "port 3: link down"


RESTARTED_ARGS = ("--gpus", "2", "--dc-capacity-gib", "0", "--ld-count", "0")


@contextlib.contextmanager
def switch_gone(tmp_path: Path) -> Iterator[list[FabricEvent]]:
    """A fabric on the emulator at ``tmp_path/e.sock``, whose poller read six records of port2 (failed and
    repaired three times), that emulator then killed and its socket gone; yields the events the fabric
    publishes from then on, and closes it at the end."""
    sock = tmp_path / "e.sock"
    seen: list[FabricEvent] = []
    with emulator_process(sock, *RESTARTED_ARGS) as first:
        fabric = create_fabric("ext", {"address": f"unix:{sock}", "gpus": 2})
        fabric.subscribe(seen.append)
        for _ in range(3):
            fabric.fail_device("ext/port2")
            fabric.repair_device("ext/port2")
        wait_until(lambda: len(seen) >= 6)
    first.wait(5.0)
    sock.unlink()  # a killed emulator leaves its socket behind
    try:
        after: list[FabricEvent] = []
        fabric.subscribe(after.append)
        yield after
    finally:
        fabric.close()


def fail_port3(sock: Path) -> None:
    """Inject Link Down on port 3 through an operator's own client (the driver's may not be back yet)."""
    operator = SocketTransport(sock)
    try:
        injected = Client(operator).call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(3))
    finally:
        operator.close()
    assert injected.return_code == ReturnCode.SUCCESS


def wait_until(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "no event arrived"
        time.sleep(0.02)


class TestBind:
    """Binds honour the deadline and refuse failed devices."""

    def test_deadline_already_passed(self, make_switch: Callable[..., CxlSwitchFabric]) -> None:
        fabric = make_switch()
        with pytest.raises(DeadlineExceededError):
            fabric.bind("sw/port2", "h0", CallContext(epoch=1, deadline=0.0))
        assert fabric.bindings() == []

    def test_a_failed_device_is_busy(self, make_switch: Callable[..., CxlSwitchFabric]) -> None:
        fabric = make_switch()
        fabric.fail_device("sw/port3")
        assert next(d for d in fabric.discover().devices if d.id == "sw/port3").health is Health.FAILED
        with pytest.raises(DeviceBusyError):
            fabric.bind("sw/port3", "h0", fresh_ctx())
        fabric.repair_device("sw/port3")
        assert fabric.bind("sw/port3", "h0", fresh_ctx()) == Binding("sw/port3", "h0")
        fabric.unbind(Binding("sw/port3", "h0"), fresh_ctx())
