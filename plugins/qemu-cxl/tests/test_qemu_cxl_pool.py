"""The checks QEMU 7.2 skips, made by the driver before QEMU is touched, against real QEMU processes."""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from disagg.errors import (
    CapacityExhaustedError,
    ConflictError,
    FabricUnavailableError,
    InvalidRequestError,
    StaleEpochError,
    UnknownHostError,
)
from disagg.interfaces import CallContext
from disagg_qemu_cxl import QemuCxlFabric
from disagg_qemu_cxl.command import LSA_BYTES, host_dir, memory_file
from disagg_qemu_cxl.state import FIRST_SERIAL, Record
from qemu_cxl_helpers import GiB, MiB, RawQMP, qemu_pid

POOL = "qc/cxl-pool"


def hand_add(state_dir: Path, host: str, port: int, sn: int, name: str, *, with_id: bool = True) -> None:
    """device_add a Type-3 behind the driver's back, on the auxiliary QMP monitor (without an id: QEMU keeps it
    under /machine/peripheral-anon)."""
    with RawQMP(state_dir, host) as qmp:
        qmp.execute("object-add", **{"qom-type": "memory-backend-ram", "id": f"{name}-m", "size": 256 * MiB})
        qmp.execute("object-add", **{"qom-type": "memory-backend-ram", "id": f"{name}-l", "size": MiB})
        named = {"id": name} if with_id else {}
        qmp.execute(
            "device_add", driver="cxl-type3", **named, bus=f"dsp{port}", addr="0", sn=sn,
            memdev=f"{name}-m", lsa=f"{name}-l",
        )  # fmt: skip


class TestPorts:
    """One Type-3 per downstream port, at function 0; a full host refuses with CapacityExhaustedError."""

    def test_occupied_ports_are_refused(self, fabric: QemuCxlFabric, ctx: CallContext) -> None:
        pool = fabric.pool(POOL)
        for i in range(2):
            pool.allocate(f"a{i}", "h2", 256 * MiB, ctx)
        with pytest.raises(CapacityExhaustedError, match="no free CXL downstream port"):
            pool.allocate("a2", "h2", 256 * MiB, ctx)
        assert {a.id for a in pool.allocations()} == {"a0", "a1"}

    def test_a_port_taken_behind_the_drivers_back_is_skipped(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext
    ) -> None:
        hand_add(state_dir, "h1", 0, 0x9000, "foreign")
        fabric.pool(POOL).allocate("a", "h1", 256 * MiB, ctx)
        with RawQMP(state_dir, "h1") as qmp:
            found = qmp.type3()
        assert found["foreign"]["port"] == "dsp0"
        (ours,) = [v for k, v in found.items() if k != "foreign"]
        assert ours["port"] == "dsp1"

    @pytest.mark.parametrize("with_id", [True, False])
    def test_a_port_held_by_another_kind_of_device_is_skipped(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, with_id: bool
    ) -> None:
        """An operator's device that is not a Type-3 on dsp0 (with an id, or without one: QEMU keeps those apart):
        only Type-3s were counted, so every allocation on the host picked dsp0 again and QEMU refused it."""
        with RawQMP(state_dir, "h2") as qmp:
            qmp.execute(
                "device_add", driver="virtio-rng-pci", bus="dsp0", addr="0", **({"id": "rng0"} if with_id else {})
            )
        fabric.pool(POOL).allocate("a", "h2", 256 * MiB, ctx)
        with RawQMP(state_dir, "h2") as qmp:
            assert {v["port"] for v in qmp.type3().values()} == {"dsp1"}
        with pytest.raises(CapacityExhaustedError, match="no free CXL downstream port"):
            fabric.pool(POOL).allocate("b", "h2", 256 * MiB, ctx)

    def test_a_refusal_of_the_type3_is_not_retryable(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """QEMU refusing the Type-3 (here a device the walk did not see, on the port it chose) was
        FabricUnavailableError, UNAVAILABLE on the wire, which says "retry": a client retried a refusal that a
        retry meets again. It is a conflict with the machine's state, and nothing is left of the attempt."""
        monkeypatch.setattr("disagg_qemu_cxl.discovery._port_of", lambda monitor, path: None)
        with RawQMP(state_dir, "h2") as qmp:
            qmp.execute("device_add", driver="virtio-rng-pci", id="rng0", bus="dsp0", addr="0")
        pool = fabric.pool(POOL)
        with pytest.raises(ConflictError, match="refused the Type-3") as refused:
            pool.allocate("a", "h2", 256 * MiB, ctx)
        assert not refused.value.retryable and not isinstance(refused.value, FabricUnavailableError)
        assert not pool.allocations()


def address_space_of(pid: int) -> int:
    """The bytes of address space process ``pid`` maps now (VmSize)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))


@pytest.fixture
def squeezed_h2(fabric: QemuCxlFabric, state_dir: Path) -> Iterator[int]:
    """h2's QEMU with 128 MiB of address space to spare (its soft RLIMIT_AS): mapping a larger backend fails
    ENOMEM, as on a host short of memory. Lifted again at the end; yields the QEMU's pid."""
    pid = qemu_pid(state_dir, "h2")
    assert pid is not None
    limits = resource.prlimit(pid, resource.RLIMIT_AS)
    squeezed = address_space_of(pid) + 128 * MiB
    resource.prlimit(pid, resource.RLIMIT_AS, (squeezed, limits[1]))
    yield pid
    resource.prlimit(pid, resource.RLIMIT_AS, limits)


class TestRefusals:
    """QEMU refusing a hot-add is told apart by its reason: a host short of memory for the backend is capacity, a
    host whose directory cannot hold the backend file is unavailable, and neither leaves anything held."""

    def test_a_host_short_of_memory_is_capacity(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, squeezed_h2: int
    ) -> None:
        """QEMU cannot map the backend (``unable to map backing store for guest RAM: Cannot allocate memory``):
        not a conflict with the machine's state, which a retry meets again, but too little room on the host, which
        may pass. Once it has, the same allocation succeeds."""
        pool = fabric.pool(POOL)
        with pytest.raises(CapacityExhaustedError, match="host h2 has no room for the 512 MiB backend") as info:
            pool.allocate("a", "h2", 512 * MiB, ctx)
        assert "Cannot allocate memory" in info.value.message
        assert not pool.allocations() and not fabric.pool(POOL).allocations()
        with RawQMP(state_dir, "h2") as qmp:
            objects = {o["name"] for o in qmp.execute("qom-list", path="/objects")}
        assert not {o for o in objects if o.startswith("cxl-")}, "a backend of the refused hot-add is held"
        assert not list(host_dir(state_dir, "h2").glob("*.img")), "a backend file of the refused hot-add is left"
        hard = resource.prlimit(squeezed_h2, resource.RLIMIT_AS)[1]
        resource.prlimit(squeezed_h2, resource.RLIMIT_AS, (hard, hard))
        assert pool.allocate("a", "h2", 512 * MiB, ctx).amount_bytes == 512 * MiB

    def test_a_backend_file_the_host_cannot_open_is_unavailable(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext
    ) -> None:
        """The host's directory cannot hold the backend file (here its name leads under a regular file: ``can't
        open backing store ... Not a directory``; a removed or read-only directory alike): the operator's to mend,
        and the host cannot be used meanwhile, so FabricUnavailableError naming the file, not a conflict."""
        backend = host_dir(state_dir, "h2") / memory_file(Record("a", "h2", 0, FIRST_SERIAL, 256 * MiB, ()))
        backend.symlink_to(host_dir(state_dir, "h2") / "qemu.pid" / "x")
        pool = fabric.pool(POOL)
        with pytest.raises(FabricUnavailableError, match="cannot open the backend file") as info:
            pool.allocate("a", "h2", 256 * MiB, ctx)
        assert "Not a directory" in info.value.message and backend.name in info.value.message
        assert not pool.allocations()
        with RawQMP(state_dir, "h2") as qmp:
            assert not qmp.type3()
        backend.unlink(missing_ok=True)
        assert pool.allocate("a", "h2", 256 * MiB, ctx).amount_bytes == 256 * MiB


@pytest.fixture
def disk_free(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Set the bytes free (to unprivileged users too) that statvfs reports for the file system of ``state_dir``:
    only that reading is made up; QEMU and the files are real."""
    real, free = os.statvfs, [0]
    root = state_dir.resolve()

    def statvfs(path: int | str | os.PathLike[str]) -> os.statvfs_result:
        result = real(path)
        if isinstance(path, int) or not Path(path).resolve().is_relative_to(root):
            return result
        fields = list(result)
        fields[3] = fields[4] = free[0] // result.f_frsize  # f_bfree, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)
    return lambda n: free.__setitem__(0, n)


class TestDiskSpace:
    """Backend files are sparse (QEMU only sizes them), so a hot-add succeeded on a file system too full to hold
    them, and the guest met the full disk later: SIGBUS on a page of the memory that could not be written. The
    driver refuses such a hot-add as capacity, before QEMU is touched, counting the backend files made before
    and not yet filled as promised."""

    def test_too_little_free_space_is_capacity(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, disk_free: Callable[[int], None]
    ) -> None:
        disk_free(300 * MiB)
        pool = fabric.pool(POOL)
        with pytest.raises(CapacityExhaustedError) as info:
            pool.allocate("a", "h2", 512 * MiB, ctx)
        message = info.value.message
        assert str(host_dir(state_dir.resolve(), "h2")) in message, message
        assert f"{300 * MiB} bytes free" in message and f"{512 * MiB + LSA_BYTES} bytes" in message, message
        assert not pool.allocations() and fabric._ledger.state.record("a") is None
        assert not list(host_dir(state_dir, "h2").glob("*.img")), "a backend file of the refused hot-add is left"
        with RawQMP(state_dir, "h2") as qmp:
            assert not {o["name"] for o in qmp.execute("qom-list", path="/objects") if o["name"].startswith("cxl-")}
        disk_free(513 * MiB)
        assert pool.allocate("a", "h2", 512 * MiB, ctx).amount_bytes == 512 * MiB

    def test_backends_not_yet_filled_are_promised(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, disk_free: Callable[[int], None]
    ) -> None:
        """h2's 512 MiB backend holds no block yet: the 700 MiB free are hers but 187 MiB, too few for 256 MiB
        more on h1. Once 80 MiB of it are written and 100 MiB are freed elsewhere (720 MiB free), 287 MiB are left:
        the blocks written are not counted again as promised."""
        disk_free(700 * MiB)
        pool = fabric.pool(POOL)
        pool.allocate("a", "h2", 512 * MiB, ctx)
        with pytest.raises(CapacityExhaustedError, match=f"{513 * MiB} of them promised") as info:
            pool.allocate("b", "h1", 256 * MiB, ctx)
        assert str(host_dir(state_dir.resolve(), "h1")) in info.value.message
        assert [a.id for a in pool.allocations()] == ["a"]
        record = fabric._ledger.state.record("a")
        assert record is not None
        with open(host_dir(state_dir, "h2") / memory_file(record), "r+b") as backend:
            for _ in range(80):
                backend.write(b"\1" * MiB)
            backend.flush()
            os.fsync(backend.fileno())
        disk_free(720 * MiB)
        assert pool.allocate("b", "h1", 256 * MiB, ctx).amount_bytes == 256 * MiB

    def test_a_retry_needs_only_what_its_backend_files_lack(
        self,
        make_fabric: Callable[..., QemuCxlFabric],
        state_dir: Path,
        ctx: CallContext,
        disk_free: Callable[[int], None],
    ) -> None:
        """The hot-add of ``a`` lost its answer, yet QEMU added the device and the guest wrote 200 MiB of it; its
        QEMU then stopped before a call saw the device. The retry reuses the backend files, so it needs their holes
        free, 57 MiB, not the whole 257 MiB that the 200 MiB written already hold."""
        disk_free(GiB)
        first = make_fabric()
        first.pool(POOL).allocate("a", "h2", 256 * MiB, ctx)
        record = first._ledger.state.record("a")
        assert record is not None
        backend = host_dir(state_dir, "h2") / memory_file(record)
        with open(backend, "r+b") as data:
            for _ in range(200):
                data.write(b"\1" * MiB)
            data.flush()
            os.fsync(data.fileno())
        first.close()
        state_file = state_dir / "state.json"
        doc = json.loads(state_file.read_text())
        doc["allocations"]["a"]["plugged"] = False
        state_file.write_text(json.dumps(doc))
        pool = make_fabric().pool(POOL)
        assert pool.allocations() == []
        lacking = (
            256 * MiB
            + LSA_BYTES
            - sum(f.stat().st_blocks * 512 for f in host_dir(state_dir, "h2").glob(f"*-{record.sn:x}.img"))
        )
        assert lacking <= 57 * MiB
        disk_free(lacking - MiB)
        with pytest.raises(CapacityExhaustedError, match=f"needs {lacking} bytes"):
            pool.allocate("a", "h2", 256 * MiB, ctx)
        disk_free(lacking)
        assert pool.allocate("a", "h2", 256 * MiB, ctx).amount_bytes == 256 * MiB
        with RawQMP(state_dir, "h2") as qmp:
            (dev,) = qmp.type3().values()
        assert dev["sn"] == record.sn
        with open(backend, "rb") as data:
            assert all(data.read(MiB) == b"\1" * MiB for _ in range(200)), "the retry lost the data written"


class TestUniqueness:
    """Serials and backend ids never repeat, even when the state file's counter is wound back."""

    def test_serials_and_backends_stay_unique(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, ctx: CallContext
    ) -> None:
        first = make_fabric(stop_hosts_on_close=False)
        first.pool(POOL).allocate("a", "h1", 256 * MiB, ctx)
        first.pool(POOL).allocate("b", "h2", 256 * MiB, ctx)
        first.close()
        hand_add(state_dir, "h1", 3, 0x1002, "foreign")  # the serial the counter would hand out next
        state = state_dir / "state.json"
        doc = json.loads(state.read_text())
        doc["next_sn"] = 0x1000  # a state file from the past
        state.write_text(json.dumps(doc))
        make_fabric().pool(POOL).allocate("c", "h2", 256 * MiB, ctx)
        serials: list[int] = []
        backends: list[str] = []
        for host in ("h1", "h2"):
            with RawQMP(state_dir, host) as qmp:
                for dev in qmp.type3().values():
                    serials.append(dev["sn"])
                    backends.append(dev["memdev"])
        assert len(serials) == 4 and len(set(serials)) == 4, serials
        assert len(set(backends)) == 4, backends


class TestSizes:
    """Amounts round up to whole 256 MiB blocks; a non-positive amount is invalid; the pool's size is a bound."""

    def test_rounding(self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext) -> None:
        alloc = fabric.pool(POOL).allocate("a", "h1", 300 * MiB, ctx)
        assert alloc.amount_bytes == 512 * MiB
        with RawQMP(state_dir, "h1") as qmp:
            (dev,) = qmp.type3().values()
        assert dev["size"] == 512 * MiB

    @pytest.mark.parametrize("amount", [0, -1])
    def test_non_positive(self, fabric: QemuCxlFabric, ctx: CallContext, amount: int) -> None:
        with pytest.raises(InvalidRequestError):
            fabric.pool(POOL).allocate("a", "h1", amount, ctx)

    def test_capacity_exhausted(self, fabric: QemuCxlFabric, ctx: CallContext) -> None:
        pool = fabric.pool(POOL)
        pool.allocate("a", "h1", GiB + 512 * MiB, ctx)
        with pytest.raises(CapacityExhaustedError):
            pool.allocate("b", "h2", GiB, ctx)
        assert pool.free_bytes() == 512 * MiB
        assert [a.id for a in pool.allocations()] == ["a"]


class TestContract:
    """Unknown hosts, idempotency, conflicts and fencing, per the Pool contract."""

    def test_unknown_host(self, fabric: QemuCxlFabric, ctx: CallContext) -> None:
        with pytest.raises(UnknownHostError):
            fabric.pool(POOL).allocate("a", "h9", 256 * MiB, ctx)
        assert fabric.pool(POOL).allocations() == []

    def test_idempotent_and_conflicts(self, fabric: QemuCxlFabric, ctx: CallContext) -> None:
        pool = fabric.pool(POOL)
        first = pool.allocate("a", "h1", 256 * MiB, ctx)
        assert pool.allocate("a", "h1", 200 * MiB, ctx) == first
        with pytest.raises(ConflictError):
            pool.allocate("a", "h2", 256 * MiB, ctx)
        with pytest.raises(ConflictError):
            pool.allocate("a", "h1", 512 * MiB, ctx)
        pool.release("nope", ctx)
        assert pool.allocations() == [first]

    def test_stale_epoch_changes_nothing(self, fabric: QemuCxlFabric, state_dir: Path) -> None:
        pool = fabric.pool(POOL)
        pool.allocate("a", "h1", 256 * MiB, CallContext(epoch=7))
        with pytest.raises(StaleEpochError):
            pool.allocate("b", "h1", 256 * MiB, CallContext(epoch=6))
        with pytest.raises(StaleEpochError):
            pool.release("a", CallContext(epoch=6))
        assert [a.id for a in pool.allocations()] == ["a"]
        assert json.loads((state_dir / "state.json").read_text())["epoch"] == 7


class TestDrift:
    """QEMU is the truth: a record without its device is not held, a device without a record is reported."""

    def test_a_record_whose_device_never_came(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, ctx: CallContext
    ) -> None:
        make_fabric(stop_hosts_on_close=False).close()
        ghost = {"host": "h1", "port": 2, "sn": 0x5000, "size": 256 * MiB, "extents": [[0, 256 * MiB]]}
        doc = {"version": 1, "epoch": 0, "next_sn": 0x5001, "allocations": {"ghost": ghost}}
        (state_dir / "state.json").write_text(json.dumps(doc))  # a crash between writing the intent and device_add
        fabric = make_fabric()
        assert fabric.hosts["h1"].adopted
        pool = fabric.pool(POOL)
        assert pool.allocations() == []
        assert pool.free_bytes() == 2 * GiB
        pool.allocate("ghost", "h1", 256 * MiB, ctx)  # the retry completes it as recorded
        with RawQMP(state_dir, "h1") as qmp:
            (dev,) = qmp.type3().values()
        assert dev["port"] == "dsp2" and dev["sn"] == 0x5000

    def test_a_device_without_a_record(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, ctx: CallContext
    ) -> None:
        first = make_fabric(stop_hosts_on_close=False)
        first.pool(POOL).allocate("a", "h1", 256 * MiB, ctx)
        first.pool(POOL).allocate("b", "h1", 256 * MiB, ctx)
        first.close()
        state = state_dir / "state.json"
        doc = json.loads(state.read_text())
        device = f"cxl-t3-{doc['allocations']['a']['sn']:x}"
        del doc["allocations"]["a"]  # a lost state file entry
        state.write_text(json.dumps(doc))
        hand_add(state_dir, "h1", 3, 0x9000, "foreign")
        pool = make_fabric().pool(POOL)
        held = {a.id: a.amount_bytes for a in pool.allocations()}
        assert held == {f"unrecorded:h1:{device}": 256 * MiB, "b": 256 * MiB, "unrecorded:h1:foreign": 256 * MiB}
        with pytest.raises(FabricUnavailableError, match="not made by this driver"):
            pool.release("unrecorded:h1:foreign", ctx)
        with pytest.raises(FabricUnavailableError, match="did not make"):
            pool.release("b", ctx)  # a restart would silently drop the foreign device
        assert len(pool.allocations()) == 3, "a refused release changed something"

    def test_a_device_added_without_an_id(self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext) -> None:
        """QEMU keeps it apart (/machine/peripheral-anon), where the driver did not look: it was not reported, its
        port was taken for free (every allocate on the host then failed, as retryable), and a release on the host
        restarted QEMU without it, its memory gone."""
        pool = fabric.pool(POOL)
        pool.allocate("a", "h1", 256 * MiB, ctx)  # dsp0
        hand_add(state_dir, "h1", 1, 0x9000, "stray", with_id=False)
        held = {a.id: a.amount_bytes for a in pool.allocations()}
        (anonymous,) = [i for i in held if i.startswith("unrecorded:h1:anon-")]
        assert held == {"a": 256 * MiB, anonymous: 256 * MiB}
        pool.allocate("b", "h1", 256 * MiB, ctx)  # on dsp2: dsp1 is the stray's
        with pytest.raises(FabricUnavailableError, match="did not make"):
            pool.release("a", ctx)  # a restart would silently drop the stray
        assert len(pool.allocations()) == 3, "a refused release changed something"

    def test_releasing_a_device_whose_record_was_lost(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, ctx: CallContext
    ) -> None:
        first = make_fabric(stop_hosts_on_close=False)
        first.pool(POOL).allocate("a", "h1", 256 * MiB, ctx)
        first.pool(POOL).allocate("b", "h1", 512 * MiB, ctx)
        first.close()
        state = state_dir / "state.json"
        doc = json.loads(state.read_text())
        device = f"cxl-t3-{doc['allocations']['b']['sn']:x}"
        del doc["allocations"]["b"]
        state.write_text(json.dumps(doc))
        pool = make_fabric().pool(POOL)
        pool.release(f"unrecorded:h1:{device}", ctx)
        assert [(a.id, a.amount_bytes) for a in pool.allocations()] == [("a", 256 * MiB)]

    def test_an_unrecorded_id_for_a_recorded_device_releases_nothing(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext
    ) -> None:
        """``unrecorded:<host>:<device>`` of a device that a record names is no allocation the pool reports: its
        release is of an absent allocation, and must not take the recorded one's device and backend files."""
        pool = fabric.pool(POOL)
        alloc = pool.allocate("a", "h1", 256 * MiB, ctx)
        record = fabric._ledger.state.record("a")
        assert record is not None
        pid = qemu_pid(state_dir, "h1")
        files = sorted(host_dir(state_dir, "h1").glob("*.img"))
        pool.release(f"unrecorded:h1:{record.device}", ctx)
        assert qemu_pid(state_dir, "h1") == pid, "the host was restarted"
        assert pool.allocations() == [alloc]
        assert [r.allocation for r in fabric._ledger.state.records] == ["a"]
        assert sorted(host_dir(state_dir, "h1").glob("*.img")) == files and files
