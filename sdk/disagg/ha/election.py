"""Leader election on an etcd lease, and the fencing epoch that comes with leading.

A replica campaigns by creating the leader key bound to its own lease, only if the key does not exist; the
key's ``create_revision``, which etcd makes strictly greater for every new holder, is the replica's fencing
epoch. Every driver call carries it (a driver refuses an older one) and every ledger write is a transaction
on it (`EtcdStore.fence`), so a replica that lost the lead, even one that was paused and does not know yet,
can change neither the hardware nor the ledger.

The epoch is the create revision plus a base kept in etcd beside the leader key (``<key>.epoch-base``), 0
until raised: a new or rebuilt etcd cluster starts its revisions low again, while the drivers remember the
highest epoch they have seen and would refuse every call. The operator sets ``[state] epoch_base`` above that
(the drivers' refusal names it); a leader raises the stored base to it, never lowers it, in a transaction
fenced on its own leader key, so epochs still rise from one leader to the next whichever replica was told.

The lease is refreshed every third of its time to live, counted from the last refresh etcd took, also the one
just before a campaign's create: a standby that waited longer than the time to live would otherwise win with a
lease about to expire, and lose the lead a moment later. A member that does not answer is given a sixth of the
time to live before the next one is tried at once, so one stalled member does not cost the lead. Refreshes
that fail for the time to live, a leader key that another replica now holds, or anything else that stops the
keeper end the lead: `lost` is set and the replica must stop serving at once. A fenced ledger write that etcd
refuses says the same between two refreshes (`deposed`). Reads are not fenced by etcd, so `leading` also
answers from the local clock: no other replica can lead before the lease, counted from the last refresh sent,
has run out. A replica that was paused past it (a stopped process, a stalled VM) answers nothing from memory
once it runs again, even before its keeper has found the lead lost.

etcd grants no lease less than about 1.5 times its election timeout (``--election-timeout``), in whole seconds,
and answers the grant and every refresh with the time to live it gave: the replica counts all of the above
from that answer, not from the time asked (``lease_ttl_s``), and says once when it is longer, since a dead
leader then holds the lead longer than the configuration says.

A campaign keeps its lease when etcd does not answer; only a refresh that says the lease ran out replaces it.
The create may have landed with its answer lost, and the leader key, bound to that lease, would shut every
replica out until the lease ran out: the next attempt finds the key bound to its lease and leads, its epoch
derived from the key's create revision as after a create it saw answered. A campaign that no member answers
for `SILENT_TTLS` times to live says so once as an error (a mistyped endpoint), beside its warnings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import etcd3gw
import requests
from etcd3gw.exceptions import Etcd3Exception

from disagg.errors import ConfigError
from disagg.store.etcd import API_PATH, created_at, describe_error, parse_endpoint, put_op, request_timeout

log = logging.getLogger("disagg.ha")


LEADER_KEY = "/disagg/leader"
LEASE_TTL_S = 3
CAMPAIGN_POLL_S = 0.5
RETRY_PAUSE_S = 0.05
"""Between two members tried in a row, so that a refresh never spins on members that refuse at once."""
LEASE_GONE = "requested lease not found"
"""etcd's answer to a revoke of a lease that has run out: an answer, not a member that did not answer."""
SILENT_TTLS = 3
"""Lease times to live with no answer from any member after which a campaign logs an error, once: a mistyped
endpoint then stands out from a standby that waits for the lead, which logs nothing."""
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (Etcd3Exception, OSError, requests.RequestException)


def lease_clock() -> float:
    """Seconds on a clock that goes on while the machine is suspended (Linux's CLOCK_BOOTTIME), as etcd's clock
    does: `time.monotonic` stops then, and a host resumed after its lease ran out would go on counting it valid.
    Elsewhere the monotonic clock, which suspends rarely stop on servers."""
    return time.clock_gettime(_LEASE_CLOCK)


_LEASE_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


class Leadership:
    """This replica's campaign for the lead, named ``identity`` in the leader key's value."""

    def __init__(
        self,
        endpoints: Sequence[str],
        identity: str,
        *,
        key: str = LEADER_KEY,
        ttl_s: int = LEASE_TTL_S,
        timeout_s: float = 2.0,
        epoch_base: int = 0,
    ) -> None:
        if not endpoints:
            raise ConfigError("high availability needs at least one etcd endpoint", field="state.endpoints")
        if ttl_s < 2:
            raise ConfigError("the leader lease must live at least 2 seconds", field="state.lease_ttl_s")
        self._endpoints = [parse_endpoint(e) for e in endpoints]
        self.identity = identity
        self.key = key
        self.ttl_s = ttl_s
        """The lease's time to live asked of etcd."""
        self.granted_ttl_s = ttl_s
        """The time to live etcd gave the current lease, by its last answer: what refreshes, the read lease and the
        step-down are counted from (`_refreshed`)."""
        self._told_granted = False
        self.timeout_s = min(timeout_s, request_timeout(ttl_s))
        """Each request to etcd: a sixth of the time to live at most, so that the keeper tries other members."""
        if epoch_base < 0:
            raise ConfigError(f"the epoch base must be 0 or more, not {epoch_base}", field="state.epoch_base")
        self.epoch_base = epoch_base
        """The least base this replica leads with (`_settle_base`)."""
        self.epoch = 0
        """The fencing epoch while this replica leads (its key's create revision plus the base); 0 before."""
        self.create_revision = 0
        """The leader key's create revision while this replica leads: what ledger writes are fenced on."""
        self.lost = threading.Event()
        """Set when this replica, having led, no longer does."""
        self._stop = threading.Event()
        self._valid_until = 0.0
        """While leading: until when (`lease_clock`) no other replica can lead, the last refresh etcd took (sent
        then) plus the time to live."""
        self._lease: etcd3gw.Lease | None = None
        self._lease_lock = threading.Lock()
        """Held while `_attempt` creates the key on its lease, and while `resign` takes the lease to revoke: a
        resign that landed between an attempt's refresh and its create left a key on no lease, which never ran
        out, and no replica could lead again."""
        self._keeper: threading.Thread | None = None
        self._next = 0
        self._clients: dict[int, etcd3gw.Etcd3Client] = {}

    def _client(self) -> etcd3gw.Etcd3Client:
        """The client of the current endpoint; `_rotate` moves to the next when a member does not answer."""
        n = self._next % len(self._endpoints)
        if n not in self._clients:
            host, port = self._endpoints[n]
            # The gateway's path fixed, as the ledger's: discovering it asked the member's /version first, one
            # more round trip to each member newly tried, as in a failover.
            self._clients[n] = etcd3gw.client(host=host, port=port, timeout=self.timeout_s, api_path=API_PATH)
        return self._clients[n]

    def _rotate(self) -> None:
        self._next += 1

    def _where(self) -> str:
        """The current endpoint, to name in the log."""
        host, port = self._endpoints[self._next % len(self._endpoints)]
        return f"{host}:{port}"

    def campaign(self, stop: threading.Event | None = None) -> int:
        """Block until this replica leads (or ``stop`` is set: returns 0); returns the fencing epoch."""
        stop = stop or self._stop
        answered = time.monotonic()
        told = False
        while not stop.is_set():
            try:
                epoch = self._attempt()
                answered, told = time.monotonic(), False
                if epoch:
                    return epoch
            except _CONNECTION_ERRORS as exc:
                log.warning(
                    "campaign: etcd at %s did not answer (%s); trying the next endpoint",
                    self._where(),
                    describe_error(exc),
                )
                self._rotate()
                silent = time.monotonic() - answered
                if not told and silent >= SILENT_TTLS * self.granted_ttl_s:
                    told = True
                    log.error(
                        "no etcd member has answered for %.0f s (%s): this replica cannot lead until one does; "
                        "check [state] endpoints",
                        silent,
                        ", ".join(f"{host}:{port}" for host, port in self._endpoints),
                    )
            stop.wait(CAMPAIGN_POLL_S)
        return 0

    def _attempt(self) -> int:
        """One try for the lead: refresh this replica's lease (a new one if it ran out), create the leader key on
        it unless the key exists, then lead if the key is bound to the lease, whether this create made it or an
        earlier one whose answer was lost did. Returns the epoch, or 0 while another replica holds the key."""
        client = self._client()
        fresh = time.monotonic()  # the lease lives at least the time to live from here
        fresh_lease = lease_clock()
        lease = self._lease
        if lease is not None:
            lease.client = client
        if lease is None or not self._refreshed(lease.refresh()):
            lease = self._grant(client)
        with self._lease_lock:
            if self._stop.is_set():  # resigned meanwhile: it revoked the lease it found, and this one runs out
                return 0
            self._lease = lease
            client.create(self.key, self.identity, lease=lease)
        held = client.get(self.key, metadata=True)
        if not held or int(held[0][1].get("lease", 0)) != lease.id:
            return 0
        self.create_revision = int(held[0][1]["create_revision"])
        base = self._settle_base(client)
        if base is None:  # the key was lost between the create and the base: campaign again
            return 0
        self.epoch = base + self.create_revision
        self._valid_until = fresh_lease + self.granted_ttl_s
        log.info("leading with epoch %d (lease %s)", self.epoch, lease.id)
        self._keeper = threading.Thread(target=self._keep, args=(fresh,), name="disagg-lease", daemon=True)
        self._keeper.start()
        return self.epoch

    def _grant(self, client: etcd3gw.Etcd3Client) -> etcd3gw.Lease:
        """A new lease of `ttl_s` asked, its time to live as granted (`etcd3gw.Etcd3Client.lease` drops it)."""
        answer = client.post(client.get_url("/lease/grant"), json={"TTL": self.ttl_s, "ID": 0})
        lease = etcd3gw.Lease(int(answer["ID"]), client=client)
        self._refreshed(int(answer.get("TTL", self.ttl_s)))
        if self.granted_ttl_s > self.ttl_s and not self._told_granted:
            self._told_granted = True
            log.warning(
                "etcd granted the leader lease %d s to live, not the %d s asked ([state] lease_ttl_s): etcd gives "
                "no lease less than 1.5 times its --election-timeout, so a dead leader holds the lead %d s and a "
                "standby takes over that much later; give etcd an --election-timeout of %d ms or less",
                self.granted_ttl_s,
                self.ttl_s,
                self.granted_ttl_s,
                self.ttl_s * 2000 // 3,
            )
        return lease

    def _refreshed(self, ttl: int) -> bool:
        """Take etcd's answer to a grant or refresh: the lease's time to live from now, or 0 or less if it ran
        out. etcd may give more than `ttl_s`, never less: counting the time asked would give up a lead etcd
        still keeps, and a server that gave less would have this replica lead past its lease."""
        if ttl <= 0:
            return False
        self.granted_ttl_s = ttl
        return True

    @property
    def base_key(self) -> str:
        return f"{self.key}.epoch-base"

    def _settle_base(self, client: etcd3gw.Etcd3Client) -> int | None:
        """The epoch base in etcd, raised first to `epoch_base` if that is higher, in one transaction that holds
        only while the leader key is still this replica's (None when it is not)."""
        stored = client.get(self.base_key)
        raw = stored[0] if stored else b"0"
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        if not (text.isascii() and text.isdigit()):
            raise ConfigError(
                f"the epoch base {self.base_key!r} in etcd holds {text!r}, not a whole number of epochs: put the "
                "highest epoch a replica of this cluster led with there (docs/ha.md), or set [state] epoch_base to "
                "it and delete the key",
                field="state.epoch_base",
            )
        base = int(text)
        if self.epoch_base <= base:
            return base
        txn = {
            "compare": [created_at(self.key, self.create_revision)],
            "success": [put_op(self.base_key.encode(), str(self.epoch_base))],
            "failure": [],
        }
        if not client.transaction(txn).get("succeeded"):
            return None
        log.warning("raised the epoch base from %d to %d ([state] epoch_base)", base, self.epoch_base)
        return self.epoch_base

    def _keep(self, fresh: float) -> None:
        """Refresh the lease until it cannot be, or the key is no longer ours: then the lead is lost. ``fresh``:
        when the last refresh (or grant) that etcd took was sent; the lease lives the time to live from it.

        Anything else that goes wrong here (an answer etcd3gw cannot read, a bug) ends the lead too: the lease
        would run out unrefreshed while this replica went on serving."""
        try:
            self._refresh_until_lost(fresh)
        except Exception as exc:
            self.deposed(f"the lease keeper failed ({type(exc).__name__}: {describe_error(exc)}); the lease runs out")
            return
        if not self._stop.is_set():
            self.deposed("another replica may lead now")

    def _refresh_until_lost(self, fresh: float) -> None:
        """Refresh the lease every third of its time to live; return when the lead is lost or given up."""
        lease = self._lease  # `resign` lets go of it while this thread may still run
        assert lease is not None
        deadline = fresh + self.granted_ttl_s
        due = fresh + self.granted_ttl_s / 3
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            sent, sent_lease = time.monotonic(), lease_clock()
            try:
                client = self._client()
                lease.client = client  # a lease is an id: any member refreshes it
                if not self._refreshed(lease.refresh()):
                    break
                held = client.get(self.key, metadata=True)
                if not held or int(held[0][1]["create_revision"]) != self.create_revision:
                    break
                deadline = sent + self.granted_ttl_s
                self._valid_until = sent_lease + self.granted_ttl_s
                due = sent + self.granted_ttl_s / 3
            except _CONNECTION_ERRORS as exc:
                log.warning(
                    "lease refresh: etcd at %s did not answer (%s); trying the next member",
                    self._where(),
                    describe_error(exc),
                )
                self._rotate()
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    break
                due = time.monotonic() + RETRY_PAUSE_S

    def leading(self) -> bool:
        """Whether this replica surely still leads now: it won, has not lost or given up the lead, and its lease
        cannot have run out yet by the local clock. Reads served from memory ask it, as writes are fenced."""
        return (
            self.epoch > 0 and not self.lost.is_set() and not self._stop.is_set() and lease_clock() < self._valid_until
        )

    def lease_left(self) -> float:
        """Seconds from now during which no other replica can lead (`leading`'s bound), 0 once it may: how long
        this leader's fenced ledger tries etcd for a call (`EtcdStore.fence`)."""
        if self.epoch == 0 or self.lost.is_set() or self._stop.is_set():
            return 0.0
        return max(0.0, self._valid_until - lease_clock())

    def deposed(self, why: str) -> None:
        """Another replica leads, as this one learnt from etcd between two refreshes (a fenced ledger write was
        refused): the lead is lost now, not at the next refresh."""
        if not self.lost.is_set() and not self._stop.is_set():  # after resign, a refused write is no news
            log.critical("lost the lead (epoch %d): %s", self.epoch, why)
            self.lost.set()

    def resign(self) -> None:
        """Give the lead up (revoke the lease, which deletes the key) so a standby takes over at once; each member
        is asked in turn until one takes it, since a dead one would leave the standby the whole time to live."""
        with self._lease_lock:  # after an attempt's create, whose key this revokes, or before it, which stops it
            self._stop.set()
            lease, self._lease = self._lease, None  # revoked once: a second resign (a stop after one) asks nothing
        if lease is not None:
            for _ in self._endpoints:
                try:
                    lease.client = self._client()
                    lease.revoke()
                    break
                except _CONNECTION_ERRORS as exc:
                    if LEASE_GONE in describe_error(exc):  # it ran out (a pause, a partition): nothing to revoke
                        log.info("the lease had already run out; nothing to revoke")
                        break
                    log.warning(
                        "could not revoke the lease at %s (%s); trying the next member",
                        self._where(),
                        describe_error(exc),
                    )
                    self._rotate()
            else:
                log.warning("no member revoked the lease; it expires in %d s", self.granted_ttl_s)
        if self._keeper is not None:
            self._keeper.join(self.granted_ttl_s)
