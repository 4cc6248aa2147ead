"""The clauses of the driver conformance suite: a stable id, a one-sentence statement, and the features a
driver must declare for the clause to be tested.

Ids never change meaning once released; a clause that changes gets a new id. ``docs/conformance.md`` lists
every clause with its statement (a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import pytest

from disagg.model import Feature

F = TypeVar("F", bound=Callable[..., Any])

MARKER = "disagg_clause"


@attrs.frozen
class Clause:
    id: str
    statement: str
    requires: frozenset[Feature] = frozenset()
    needs: str = ""
    """What else the clause needs from the fabric (two hosts that reach one device, ...), for the record."""
    lacking: frozenset[Feature] = frozenset()
    """Tested only when the driver does not declare every one of these (a clause about undeclared features)."""

    def applies(self, declared: frozenset[Feature]) -> bool:
        """Whether a driver that declares ``declared`` is tested against the clause."""
        return self.requires <= declared and not (self.lacking and self.lacking <= declared)


_ALL = (
    Clause(
        "DISC-WELL-FORMED",
        "Every discovered device has the id `<fabric>/<local id>`, a kind the driver declares, and names only "
        "switches, hosts and pools that discovery also reports; every device, host, switch and pool id is 1 to 256 "
        "printable characters without whitespace (`disagg.interfaces.check_id`); a driver that reports pools "
        "declares carve.",
    ),
    Clause("DISC-STABLE", "Two discoveries report the same device ids with the same serials."),
    Clause("DISC-UNIQUE-SERIALS", "No two devices of a fabric share a serial."),
    Clause(
        "DISC-SCOPED-IDS",
        "Every discovered switch and pool has the id `<fabric>/<local id>`, as every device does, and no two "
        "switches or two pools share an id.",
    ),
    Clause(
        "UNDECLARED-UNSUPPORTED",
        "A bind, an unbind or an allocation that needs a feature the driver does not declare (bind, unbind, carve) "
        "raises UnsupportedError (gRPC UNIMPLEMENTED, reason UNSUPPORTED) and changes nothing.",
        needs="an undeclared bind, unbind or carve, and a device or pool to try it on",
        lacking=frozenset({Feature.BIND, Feature.UNBIND, Feature.CARVE}),
    ),
    Clause(
        "BIND-IDEMPOTENT",
        "Binding a device to the same host N times returns the same binding each time and leaves exactly one binding.",
        frozenset({Feature.BIND}),
    ),
    Clause(
        "UNBIND-IDEMPOTENT",
        "Unbinding a binding N times succeeds every time and leaves the device free to bind again, and unbinding "
        "an unknown device or host succeeds as already unbound.",
        frozenset({Feature.BIND, Feature.UNBIND}),
    ),
    Clause(
        "UNBIND-OTHER-HOST",
        "Unbinding a bound device from a host it is not bound to, another host of the fabric or one the fabric "
        "does not have, succeeds as already unbound and leaves the device bound to its host.",
        frozenset({Feature.BIND, Feature.UNBIND}),
        needs="a free device",
    ),
    Clause(
        "BINDINGS-REPORTED",
        "bindings() reports what the hardware holds: a bound device that then fails is still reported bound to its "
        "host and can be unbound, and a device unbound from one host and bound to another is reported on the second.",
        frozenset({Feature.BIND, Feature.UNBIND}),
        needs="a free device that two hosts reach (the move), fault injection (the failure)",
    ),
    Clause(
        "LIST-WELL-FORMED",
        "After binds of two devices and an allocation in each of two pools, bindings() lists each binding by a "
        "device id and a host id and each device once, and each pool's allocations() lists only that pool's "
        "allocations, each by an allocation id and a host id, of at least one byte, and each id once "
        "(`disagg.interfaces.check_bindings` and `check_allocations`, which the remote client holds a driver's "
        "listings to).",
        needs="bind or carve; a free device or a pool a host reaches (two of each tried)",
    ),
    Clause(
        "BIND-FAILED-LEAVES-NOTHING",
        "A bind that fails leaves the device unbound, and the next bind of it succeeds.",
        frozenset({Feature.BIND, Feature.FAULT_INJECTION}),
    ),
    Clause(
        "ERR-UNKNOWN-DEVICE",
        "Binding a device the fabric does not have raises UnknownDeviceError (gRPC NOT_FOUND, reason UNKNOWN_DEVICE).",
        frozenset({Feature.BIND}),
    ),
    Clause(
        "ERR-UNKNOWN-DEVICE-HANDLE",
        "Asking for the handle of a device the fabric does not have (`Fabric.device`) raises UnknownDeviceError "
        "(gRPC NOT_FOUND, reason UNKNOWN_DEVICE), or UnsupportedError from a fabric that gives no device handles "
        "at all.",
        needs="a device (to learn whether the fabric gives handles)",
    ),
    Clause(
        "ERR-UNKNOWN-POOL",
        "Asking for a pool the fabric does not have (`Fabric.pool`) raises NotFoundError (gRPC NOT_FOUND), at once "
        "or at the first allocate through the handle it gives, and carves nothing.",
        frozenset({Feature.CARVE}),
        needs="a host",
    ),
    Clause(
        "ERR-INVALID-ID",
        "A bind, or an unbind when unbind is declared, given a device or host id that is empty or not a string "
        "raises InvalidRequestError (gRPC INVALID_ARGUMENT, reason INVALID_REQUEST) and changes nothing.",
        frozenset({Feature.BIND}),
        needs="a free device (unbind tested when declared)",
    ),
    Clause(
        "ERR-UNKNOWN-HOST",
        "Binding a device to a host the fabric does not have raises UnknownHostError (gRPC NOT_FOUND, reason "
        "UNKNOWN_HOST) and binds nothing.",
        frozenset({Feature.BIND}),
    ),
    Clause(
        "ERR-DEVICE-BUSY",
        "Binding a device that is bound to another host raises DeviceBusyError (gRPC FAILED_PRECONDITION, "
        "reason DEVICE_BUSY) and leaves the first binding as it was.",
        frozenset({Feature.BIND}),
        needs="a device that two hosts reach",
    ),
    Clause(
        "ERR-DEVICE-FAILED",
        "Binding a device that has failed raises DeviceBusyError (gRPC FAILED_PRECONDITION, reason DEVICE_BUSY) "
        "and binds nothing.",
        frozenset({Feature.BIND, Feature.FAULT_INJECTION}),
        needs="fault injection to fail a free device",
    ),
    Clause(
        "ERR-HOST-UNREACHABLE",
        "Binding a device to a host that no working path joins to it raises HostUnreachableError (gRPC "
        "FAILED_PRECONDITION, reason HOST_UNREACHABLE) and binds nothing.",
        frozenset({Feature.BIND}),
        needs="a host that cannot reach some device, or fault injection to take a link down",
    ),
    Clause(
        "FENCE-STALE-EPOCH",
        "A bind, unbind, allocate or release with a fencing epoch older than one the driver has seen, even on a "
        "call that then failed or changed nothing, raises StaleEpochError (gRPC FAILED_PRECONDITION, reason "
        "STALE_EPOCH) and changes nothing.",
        frozenset({Feature.BIND, Feature.FENCING}),
    ),
    Clause(
        "CARVE-STALE-EPOCH",
        "An allocate or release with a fencing epoch older than one the driver has seen, even on a call that then "
        "failed, raises StaleEpochError (gRPC FAILED_PRECONDITION, reason STALE_EPOCH) and changes nothing.",
        frozenset({Feature.CARVE, Feature.FENCING}),
        needs="a pool",
    ),
    Clause(
        "DEADLINE-PASSED",
        "A bind or unbind that would change something, made once its deadline has passed, raises "
        "DeadlineExceededError (gRPC DEADLINE_EXCEEDED, reason DEADLINE_EXCEEDED) and changes nothing.",
        frozenset({Feature.BIND}),
        needs="a free device (unbind tested when declared)",
    ),
    Clause(
        "DEADLINE-DURING-CALL",
        "A bind made with a deadline half a second away returns by its deadline or raises DeadlineExceededError: "
        "it never answers success once its deadline has passed.",
        frozenset({Feature.BIND}),
        needs="a free device",
    ),
    Clause(
        "DEADLINE-DURING-UNBIND",
        "An unbind of a bound device made with a deadline half a second away returns by its deadline or raises "
        "DeadlineExceededError: it never answers success once its deadline has passed.",
        frozenset({Feature.BIND, Feature.UNBIND}),
        needs="a free device",
    ),
    Clause(
        "CARVE-DEADLINE-PASSED",
        "An allocate or release that would change something, made once its deadline has passed, raises "
        "DeadlineExceededError (gRPC DEADLINE_EXCEEDED, reason DEADLINE_EXCEEDED) and changes nothing.",
        frozenset({Feature.CARVE}),
        needs="a pool with 2 free blocks",
    ),
    Clause(
        "CARVE-DEADLINE-DURING-CALL",
        "An allocate, and a release of an allocation the pool holds, made with a deadline half a second away "
        "return by their deadline or raise DeadlineExceededError: neither answers success once its deadline has "
        "passed.",
        frozenset({Feature.CARVE}),
        needs="a pool with a free block",
    ),
    Clause(
        "CONC-PARALLEL-BINDS",
        "Binds of different devices made at the same moment from several threads all succeed.",
        frozenset({Feature.BIND}),
        needs="at least two free devices",
    ),
    Clause(
        "CONC-RACE-ONE-WINNER",
        "Of binds of one device to different hosts racing from several threads, those to exactly one host "
        "succeed, the others raise DeviceBusyError, and one binding is left.",
        frozenset({Feature.BIND}),
        needs="a device that two hosts reach",
    ),
    Clause(
        "CARVE-CONSERVES",
        "Allocating takes exactly the rounded-up amount from the pool's free capacity and releasing gives all of "
        "it back; the allocation returned is the one the pool then holds, for the host asked and of the rounded-up "
        "amount.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "CARVE-IDEMPOTENT",
        "Allocating an existing allocation id again with the same host and amount returns it and carves nothing "
        "more; with another amount it raises ConflictError.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "CARVE-RACE-SAME-ID",
        "Allocates of one allocation id made at the same moment from several threads carve it once: when all ask "
        "for the same host and amount (a retry racing its first call) each returns the same allocation, when they "
        "ask for two amounts those of one return it and the others raise ConflictError, and the pool's free "
        "capacity falls by that one allocation's amount.",
        frozenset({Feature.CARVE}),
        needs="a pool with 3 free blocks",
    ),
    Clause(
        "CARVE-CONFLICT",
        "Allocating an existing allocation id again for another host, with the same amount, raises ConflictError "
        "(gRPC FAILED_PRECONDITION, reason CONFLICT) and leaves the allocation as it was.",
        frozenset({Feature.CARVE}),
        needs="a pool that two hosts reach",
    ),
    Clause(
        "CARVE-INVALID-AMOUNT",
        "Allocating an amount that is not positive (zero or negative) raises InvalidRequestError (gRPC "
        "INVALID_ARGUMENT, reason INVALID_REQUEST) and carves nothing.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "CARVE-INVALID-ID",
        "An allocate given an allocation id or a host, or a release given an allocation id, that is empty or not a "
        "string raises InvalidRequestError (gRPC INVALID_ARGUMENT, reason INVALID_REQUEST) and changes nothing.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "CARVE-UNKNOWN-HOST",
        "Allocating for a host the fabric does not have raises UnknownHostError (gRPC NOT_FOUND, reason "
        "UNKNOWN_HOST) and carves nothing.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "CARVE-HOST-UNREACHABLE",
        "Allocating for a host that no working path joins to the pool's device raises HostUnreachableError (gRPC "
        "FAILED_PRECONDITION, reason HOST_UNREACHABLE) and carves nothing.",
        frozenset({Feature.CARVE, Feature.FAULT_INJECTION}),
        needs="a pool that some host cannot reach, or a link fault injection can take down",
    ),
    Clause(
        "CARVE-NO-OVERLAP",
        "The extents of a pool's allocations never overlap, lie within the pool, and add up to each "
        "allocation's amount.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "CARVE-EXHAUSTED",
        "An allocation larger than the free capacity raises CapacityExhaustedError and carves nothing.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "CARVE-FREE-CARVABLE",
        "A pool offers only what it can carve: holding no allocation, its free capacity is the capacity discovery "
        "reports, and one allocation of all of it, for a host that reaches the pool, succeeds and leaves none free.",
        frozenset({Feature.CARVE}),
        needs="a pool that holds no allocation",
    ),
    Clause(
        "CARVE-MLD-LOGICAL-DEVICES",
        "Discovery reports every MLD pool with 1 to 16 logical devices (0 when it does not report its LD Count), "
        "and an MLD holds one allocation per logical device: holding none, it carves one allocation for each "
        "logical device it reports, for a host that reaches it, and one more raises CapacityExhaustedError and "
        "carves nothing (one that does not report its count carves at most 16).",
        frozenset({Feature.CARVE}),
        needs="an MLD pool that holds no allocation, with a free block for each logical device and one more",
    ),
    Clause(
        "CARVE-RELEASE-UNKNOWN",
        "Releasing an allocation id the pool does not hold raises nothing and changes nothing.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "CARVE-RELEASE-IDEMPOTENT",
        "Releasing an allocation N times succeeds every time and gives its capacity back once: the pool's free "
        "capacity is again what it was before the allocation.",
        frozenset({Feature.CARVE}),
        needs="a pool",
    ),
    Clause(
        "DISC-HEALTH-REPORTED",
        "A device that has failed is reported by discovery with health FAILED, within the declared event latency "
        "(at most a minute).",
        frozenset({Feature.FAULT_INJECTION}),
        needs="a fabric object that implements `FaultInjection`; a free device",
    ),
    Clause(
        "EVENT-FAILURE-REPORTED",
        "A device failure is reported to subscribers as a DEVICE_HEALTH event for that device, with health FAILED "
        "and the fabric's name, within the declared event latency; no DEVICE_HEALTH event names a device that "
        "discovery does not report.",
        frozenset({Feature.HEALTH_EVENTS, Feature.FAULT_INJECTION}),
    ),
    Clause(
        "EVENT-CANCEL-STOPS",
        "Once Subscription.cancel() has returned, its handler is called no more: a device failure reported to the "
        "other subscribers does not reach it.",
        frozenset({Feature.HEALTH_EVENTS, Feature.FAULT_INJECTION}),
    ),
    Clause(
        "SANITIZE-BEFORE-REUSE",
        "A device that is not bound can be sanitized (idempotently), and sanitizing a bound device raises "
        "DeviceBusyError.",
        frozenset({Feature.BIND, Feature.UNBIND, Feature.SANITIZE}),
    ),
    Clause(
        "SANITIZE-STALE-EPOCH",
        "A sanitize with a fencing epoch older than one the driver has seen, through a sanitize, a bind or a new "
        "leader's announcement, raises StaleEpochError (gRPC FAILED_PRECONDITION, reason STALE_EPOCH) and erases "
        "nothing.",
        frozenset({Feature.SANITIZE, Feature.FENCING}),
    ),
    Clause(
        "SANITIZE-DEADLINE",
        "A sanitize made once its deadline has passed raises DeadlineExceededError (gRPC DEADLINE_EXCEEDED, reason "
        "DEADLINE_EXCEEDED), and one made with a deadline half a second away returns by its deadline or raises "
        "DeadlineExceededError: it never answers success once its deadline has passed.",
        frozenset({Feature.SANITIZE}),
        needs="a free device",
    ),
    Clause(
        "RESTART-BINDINGS",
        "A restarted driver reports the same devices and the same bindings as before the restart, and holds them: a "
        "bind of a device bound before the restart to another host raises DeviceBusyError and leaves it bound.",
        frozenset({Feature.BIND}),
        needs="a way to restart the driver",
    ),
    Clause(
        "RESTART-ALLOCATIONS",
        "A restarted driver reports the same allocations of a pool, and the same free capacity, as before the restart, "
        "and carves the next allocation around them: its extents overlap none of theirs.",
        frozenset({Feature.CARVE}),
        needs="a way to restart the driver; a pool",
    ),
    Clause(
        "RESTART-FENCING",
        "A restarted driver refuses a call with a fencing epoch older than one it saw before the restart with "
        "StaleEpochError, and changes nothing.",
        frozenset({Feature.FENCING}),
        needs="a way to restart the driver",
    ),
    Clause(
        "CLOSE-NO-CHILDREN",
        "A fabric built, discovered, used (a device bound and unbound, a block carved and released, as declared) "
        "and closed leaves no process it started running: every process started under "
        "the suite's process while the fabric was open has ended 3 s after close() returned (checked where /proc "
        "is; a remote driver's own process is not the suite's, and only its client is checked).",
        needs="/proc (Linux)",
    ),
    Clause(
        "CLEANUP-NOTHING-LEFT",
        "After every test, passed or failed, the suite has unbound and released everything it bound or carved, "
        "and the driver confirms it; and no thread the driver started, daemon or not, still runs 3 s after its "
        "last fabric was closed (checked by disagg certify).",
    ),
)

CLAUSES: dict[str, Clause] = {c.id: c for c in _ALL}
SUITE_VERSION = "1.13"
"""The suite's version, in every report: a new clause, a changed statement, or a change in what the suite
accepts raises it. ``docs/conformance.md`` says what each version added."""


def clause(clause_id: str) -> Callable[[F], F]:
    """Mark a test of the suite as checking ``clause_id``."""
    if clause_id not in CLAUSES:
        raise KeyError(f"no clause {clause_id!r}")
    mark: Callable[[F], F] = getattr(pytest.mark, MARKER)(clause_id)
    return mark
