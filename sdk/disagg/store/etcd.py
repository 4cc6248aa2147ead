"""The ledger on an etcd cluster (v3 API, through its JSON gateway), shared by the fabric-manager replicas.

Every record is one key holding the JSON document of its model value (`disagg.codec`, as in SQLite)::

    {prefix}compositions/{id}   {prefix}reservations/{id}   {prefix}requests/{id}   {prefix}events/{revision:020d}

Event keys carry the revision zero-padded, so etcd's key order is revision order: `events_after` is one range
read from the key after ``revision`` (or after the retention's cut), with a limit. No read sorts on the server:
etcd (3.4 and later) answers a sorted range, even one with a limit, by reading the whole range first.

A write is a transaction of its own (an append with its prune of old events; forgetting old request ids deletes
up to `TXN_OPS` keys in one), or, inside `atomic`, part of the one transaction its block commits as it ends: the
composer writes a change's record and its event so. A block of more operations or bytes than etcd takes in one
transaction (a fabric that goes away marks each of its compositions UNKNOWN in one block) is staged first, as one
record, and then applied in several; a writer that stops between them leaves it staged, and the next `load`
finishes it, so that a new leader finds the whole block or none of it (`_write_staged`).

When a prune is due is decided from what etcd holds (read once, at the first use, then followed through this
process's writes), not from a count of this process's writes, so that a ledger whose leader changes or restarts
often still prunes. After `fence`, each transaction succeeds only if the leader key still has the leader's
``create_revision``, so a replica that lost the lead, even one that was paused and does not know it yet, writes
nothing and gets `LeadershipLostError`. A store takes no write before `fence` unless it was made ``unfenced`` (a
single writer: a tool, a test): the ledger is the replicas', and a writer with no lead would write beside the
leader's.

Every transaction is also ordered: it succeeds only if ``{prefix}sequence`` still has the mod revision that this
process last saw (learnt at `load`, else before the first write), and it puts a token of its own there. A write
whose answer is lost (a member stalled, or died) is sent again to the next member; the first copy may still
reach etcd later, after newer writes, and would put back an old record or one deleted since. It cannot: the
sequence has moved on. When the compare fails, the transaction reads both keys back: the sequence holding this
write's own token means a copy sent earlier landed (the write is done); the leader key changed means another
replica leads; anything else means another writer changed the ledger, which fails the store.

A call goes to the endpoint that answered last; one that cannot be reached or does not answer within
``timeout_s`` is tried on the next, round after round with a backoff: an etcd member's death costs an election
(a second or more, when every member refuses or waits), which the lease outlives and the ledger must too. A
fenced store tries while the leader's lease, as etcd granted it, surely holds (the ``lease_left`` that `fence`
was given), and no longer: past it the lead may be another's, whose ledger this is, so a call no member
answered by then loses the lead (`LeadershipLostError`), not the ledger. Before `fence`, or without a lease, it
tries for ``write_patience_s``. Needs etcd 3.4 or later (the ``/v3/`` gateway).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import ipaddress
import itertools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import etcd3gw
import requests
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

from disagg import codec
from disagg.errors import (
    ConfigError,
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    LeadershipLostError,
    LedgerNotFencedError,
)
from disagg.model import Composition, Event, Reservation
from disagg.store.base import (
    REQUEST_RETENTION,
    UNDECODABLE,
    LedgerState,
    RequestRecord,
    Store,
    check_event_retention,
    decoded,
    quarantine_key,
    quarantine_of,
    undecodable,
)
from disagg.wire.sockets import port_from_text

log = logging.getLogger("disagg.store")
_HOST_NAME = re.compile(r"[A-Za-z0-9._-]+")
"""An endpoint's host when not in brackets: a host name or an IPv4 address, and nothing a URL reads as syntax."""

T = TypeVar("T")

EVENT_RETENTION = 100_000
"""Events kept; a watch from an older revision is told the log was compacted (OUT_OF_RANGE)."""
PRUNE_EVERY = 1_000
"""Events past the retention between two prunes of the event log: pruning in steps keeps appending cheap. The
step is counted from the revisions in etcd, not from this process's appends, so that a leader that restarts
(or hands over) often still prunes."""
PAGE = 500
"""Keys per range read: a load of many records is several bounded answers, not one huge one."""
TXN_OPS = 100
"""Operations per transaction, besides the sequence and the fence: etcd refuses more than 128 by default (its
``--max-txn-ops``). A block with more is staged (`STAGED`); old request ids are forgotten this many at a time."""
TXN_BYTES = 1024 * 1024
"""The operations' bytes per transaction, at most, as etcd counts them (raw, not the gateway's base64): etcd
refuses a request above 1.5 MiB by default (``--max-request-bytes``), and this leaves room for the sequence, the
fence and the framing. A block with more is staged (`STAGED`)."""
RECORD_KEY_ROOM = 1024
"""Bytes of a transaction's `TXN_BYTES` left to a record's key and its operation (`record_limit`)."""
STAGED = "staged"
"""The key (under the prefix) that names a staged block while it is applied; its parts are under ``staged/``."""
STAGE_PART_BYTES = 512 * 1024
"""The largest part of a staged block: etcd refuses a request above 1.5 MiB by default (``--max-request-bytes``),
and a part is base64-encoded once more on its way there."""
COMPACTED = "required revision has been compacted"
"""etcd's refusal of a read at a revision that a compaction removed (`load` reads again at a newer one,
`events_after` reads on at the current one)."""
LOAD_TRIES = 3
API_PATH = "/v3/"
"""The gateway's path in etcd 3.4 and later; fixed, so no call waits for a version discovery first."""
SEQUENCE = "sequence"
"""The key (under the prefix) whose mod revision orders the ledger's writes: see the module's docstring."""
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 0.5
"""The pause after a round in which no member answered, doubling up to this."""
MIN_ATTEMPT_S = 0.05
"""A later round's request waits what is left of the patience, and is not sent with less than this."""

COMPOSITIONS = "compositions"
RESERVATIONS = "reservations"
REQUESTS = "requests"
CORDONS = "cordons"
QUARANTINES = "quarantines"
EVENTS = "events"

_UNREACHABLE: tuple[type[BaseException], ...] = (
    ConnectionFailedError,  # refused, reset, or HTTP 503 (Unavailable: no leader, leader changed)
    ConnectionTimeoutError,  # no answer within timeout_s, or HTTP 408/504
    requests.RequestException,  # a broken answer: truncated, not JSON
    OSError,
)


MIN_REQUEST_TIMEOUT_S = 0.25


def request_timeout(lease_ttl_s: float) -> float:
    """How long one request waits for an etcd member before the next is tried: a sixth of the leader's lease,
    so that one stalled member costs neither the lease (the keeper) nor seconds of every call (the ledger)."""
    return max(MIN_REQUEST_TIMEOUT_S, lease_ttl_s / 6)


PATIENCE_REQUESTS = 5
"""A call's patience in request timeouts (`write_patience`): five sixths of the lease."""


def write_patience(lease_ttl_s: float) -> float:
    """How long a call keeps trying the members before the ledger fails, when no lease bounds it (`fence`):
    five sixths of a lease of ``lease_ttl_s``. A leader's store is fenced with its lease, and tries for as long
    as that lease, as etcd granted it, surely holds instead."""
    return PATIENCE_REQUESTS * request_timeout(lease_ttl_s)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def put_op(key: bytes, value: str) -> dict[str, Any]:
    """A put of an etcd transaction (the JSON gateway's form)."""
    return {"request_put": {"key": _b64(key), "value": _b64(value.encode())}}


def delete_op(key: bytes, end: bytes | None = None) -> dict[str, Any]:
    """A transaction's delete of ``key``, or of the keys from it up to ``end``."""
    op: dict[str, Any] = {"key": _b64(key)}
    if end is not None:
        op["range_end"] = _b64(end)
    return {"request_delete_range": op}


TOO_MANY_REQUESTS = "etcdserver: too many requests"
"""What etcd answers (HTTP 429) while its apply loop lags its log: the request was not proposed, so it is sent
again within the patience, as to a member that does not answer. (A message too large is a 429 too, with another
text: that one fails.)"""


def _too_many_requests(answer: requests.Response) -> bool:
    return answer.status_code == requests.codes.too_many_requests and TOO_MANY_REQUESTS in answer.text


def _op_bytes(op: dict[str, Any]) -> int:
    """About what ``op``, a put or a delete of a transaction, adds to its request as etcd measures it: its key and
    value decoded, three bytes for every four of base64. Counted in base64, a record etcd takes (a composition of
    7000 GPUs, 900 kB) was refused, and failed the ledger."""
    (body,) = op.values()
    return 64 + sum(len(value) * 3 // 4 for value in body.values() if isinstance(value, str))


def created_at(key: str, create_revision: int) -> dict[str, Any]:
    """A compare of an etcd transaction: ``key`` still has ``create_revision``, as the leader key of one lead."""
    return {"key": _b64(key.encode()), "target": "CREATE", "result": "EQUAL", "create_revision": create_revision}


def modified_at(key: bytes, mod_revision: int) -> dict[str, Any]:
    """A compare of an etcd transaction: ``key`` was last written at ``mod_revision`` (0: it does not exist)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


def range_op(key: bytes) -> dict[str, Any]:
    """A read of one key in an etcd transaction."""
    return {"request_range": {"key": _b64(key)}}


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end of a prefix)."""
    end = bytearray(prefix.rstrip(b"\xff"))
    if not end:
        return b"\0"  # every key
    end[-1] += 1
    return bytes(end)


def parse_endpoint(address: object) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as (host, port)."""
    if not isinstance(address, str):
        raise ConfigError(f"etcd endpoint {address!r} is not a HOST:PORT string", field="state.endpoints")
    _, url, rest = address.partition("://")
    if url and rest:  # as etcdctl and etcd's own settings write them
        raise ConfigError(
            f"etcd endpoint {address!r} is not HOST:PORT: give it without the scheme ({rest.rstrip('/')})",
            field="state.endpoints",
        )
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        bad_host = not _is_ipv6(host)
    else:  # the client puts it in a URL, which reads '?', '#', '@' and '%' as syntax: 'a?b:1' was a:80
        bad_host = _HOST_NAME.fullmatch(host) is None
    number = port_from_text(port)
    if not sep or bad_host or not number:
        raise ConfigError(
            f"etcd endpoint {address!r} is not HOST:PORT: HOST is a host name (letters, digits, '.', '-', '_'), an "
            "IPv4 address or an IPv6 address in brackets ([::1]:2379)",
            field="state.endpoints",
        )
    return host, number


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return "%" not in host  # a zone, which the client would read as a URL's escape


class EtcdStore(Store):
    """The ledger under ``prefix`` on the etcd cluster at ``endpoints`` (``HOST:PORT`` each, tried in order).

    Each request waits ``timeout_s`` for a member; a call tries the members for ``write_patience_s`` in all
    (`PATIENCE_REQUESTS` times ``timeout_s`` unless given: `write_patience` of the lease when ``timeout_s`` is
    its `request_timeout`), or, once fenced with a lease, while that lease holds. Writes are refused until
    `fence` unless ``unfenced`` (a single writer)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        prefix: str = "/disagg/",
        event_retention: int = EVENT_RETENTION,
        timeout_s: float = 5.0,
        write_patience_s: float | None = None,
        unfenced: bool = False,
    ) -> None:
        if isinstance(endpoints, str):
            raise ConfigError(
                f"etcd endpoints are a list of HOST:PORT, not the string {endpoints!r}", field="state.endpoints"
            )
        if not endpoints:
            raise ConfigError("the etcd ledger needs at least one endpoint", field="state.endpoints")
        addresses = [parse_endpoint(e) for e in endpoints]
        retention = check_event_retention(event_retention)
        if not timeout_s > 0:
            raise ConfigError(f"the etcd timeout must be positive, not {timeout_s}")
        patience = PATIENCE_REQUESTS * timeout_s if write_patience_s is None else write_patience_s
        if not patience >= 0:
            raise ConfigError(f"the etcd write patience must be 0 or more, not {write_patience_s}")
        self.endpoints: tuple[str, ...] = tuple(endpoints)
        self.timeout_s = timeout_s
        self.write_patience_s = patience
        self.unfenced = unfenced
        self.prefix = prefix
        self._key_prefix = prefix.encode()
        self._retention = retention
        self._session = requests.Session()
        self._clients = [
            etcd3gw.client(host=host, port=port, timeout=timeout_s, api_path=API_PATH, session=self._session)
            for host, port in addresses
        ]
        self._current = 0
        """The endpoint that answered last: the next call starts there."""
        self._state_lock = threading.Lock()
        self._write_lock = threading.Lock()
        """Held over each write, so that a prune sees no write of this process between its read and its deletes."""
        self._fence: dict[str, Any] | None = None
        """The compare of every write once `fence` was called."""
        self._fence_revision = 0
        self._sequence_key = self._key_prefix + SEQUENCE.encode()
        self._staged_key = self._key_prefix + STAGED.encode()
        self._sequence: int | None = None
        """The sequence key's mod revision as this process last saw it (0: absent; None: to be read before the
        next write). Guarded by `_write_lock`."""
        self._token_prefix = uuid.uuid4().hex
        self._tokens = itertools.count(1)
        self._failure = ""
        """Why a write failed (`_commit`): from then on the store takes no writes."""
        self._closed = False
        self._fence_key = ""
        self._fence_name = ""
        self._on_deposed: Callable[[str], None] = lambda why: None
        self._deposed = ""
        """Why a call found the lead lost when its lease may have run out (`_call`): from then on the store takes no
        writes, each refused as a lost lead."""
        self._lease_left: Callable[[], float] | None = None
        """Set by `fence`: how long the leader's lease surely holds from now, which bounds a call's tries."""
        self._log: tuple[int, int] | None = None
        """The oldest revision the log may hold in etcd and the newest it holds, read at the first use (`_log_ends`)
        and followed through appends and prunes; guarded by `_state_lock`."""
        self._atomic = _AtomicTxn()
        """Per thread, the transaction `atomic` gathers (None outside it)."""
        self._request_keys: int | None = None
        """At least the keys under ``requests/`` (a put that replaces one counts as one more), counted at the first
        put: their prune is due when they reach twice the retention. Guarded by `_write_lock`."""

    # ----------------------------------------------------------------- keys

    def _key(self, kind: str, name: str) -> bytes:
        return self._key_prefix + f"{kind}/{name}".encode()

    def _event_key(self, revision: int) -> bytes:
        return self._key(EVENTS, f"{revision:020d}")

    def _bounds(self, kind: str) -> tuple[bytes, bytes]:
        start = self._key_prefix + f"{kind}/".encode()
        return start, _prefix_end(start)

    # ----------------------------------------------------------------- fencing

    def fence(
        self,
        key: str,
        create_revision: int,
        on_deposed: Callable[[str], None] | None = None,
        *,
        lease_left: Callable[[], float] | None = None,
    ) -> None:
        """From now on, write only while ``key`` (the leader key, outside the prefix) has ``create_revision``:
        the fencing epoch this replica got when it won the lead. ``on_deposed`` is called, with why, when a write is
        refused for that reason (another replica leads, which this one learns then rather than at its next
        refresh), or when no member answered a call before the lease may have run out.

        ``lease_left`` says how long from now the lead surely holds (`disagg.ha.Leadership.lease_left`, from the
        lease etcd granted): a call then tries the members for that long, not for ``write_patience_s``, which is
        counted from the lease asked. etcd may grant more (at least 1.5 times its ``--election-timeout``), and its
        elections take as long: a write gave up while the lease, and the lead, still held, and failed the ledger.
        No member is tried again past the lease (each is tried once, however little of it is left); a copy that
        landed after it would be refused by the fence all the same, since another leader's key has another create
        revision and a key that ran out with the lease has none. A call that no member answered by then ends the
        lead, not the ledger: `LeadershipLostError`, and every later write is refused so."""
        if create_revision < 1:
            raise InvalidRequestError(
                f"a fencing epoch is a key's create revision (1 or more), not {create_revision}",
                field="create_revision",
            )
        with self._write_lock:
            self._fence = created_at(key, create_revision)
            self._fence_revision = create_revision
            self._sequence = None  # learnt anew (`load`, else the next write): the last leader may have moved it
            self._fence_key = key
            self._fence_name = f"{key} at create revision {create_revision}"
            self._on_deposed = on_deposed or (lambda why: None)
            self._lease_left = lease_left

    @property
    def record_limit(self) -> int:
        """See `Store.record_limit`: what one transaction takes (`TXN_BYTES`), less room for the record's key."""
        return TXN_BYTES - RECORD_KEY_ROOM

    @property
    def failure(self) -> str:
        """See `Store.failure` and `_commit`."""
        return self._failure

    # ----------------------------------------------------------------- calls, with failover

    def _call(self, what: str, path: str, payload: Mapping[str, Any]) -> Mapping[str, Any]:
        """POST ``payload`` to ``path`` on the current endpoint, then on each next one that cannot be reached
        (`_UNREACHABLE`: refused, timed out, 503), round after round with a backoff until `write_patience_s`
        has passed, or, fenced with a lease, until the lease may have run out (every member is tried once however
        short it is). Then a `FabricUnavailableError` names every endpoint, a `LeadershipLostError` when the lease
        bounded the tries (`_lose_lead`); any other refusal raises one naming that member at once."""
        with self._state_lock:
            first = self._current
        started = time.monotonic()
        lease_left = self._lease_left

        def deadline() -> float:
            """Read again each time: a refresh the lease keeper got taken meanwhile moves the lease on."""
            if lease_left is None:
                return started + self.write_patience_s
            return time.monotonic() + lease_left()

        failures: dict[str, str] = {}
        pause = FIRST_BACKOFF_S
        attempt = 0
        while True:
            index = (first + attempt) % len(self._clients)
            endpoint = self.endpoints[index]
            timeout = self.timeout_s
            if attempt >= len(self._clients):
                timeout = min(timeout, deadline() - time.monotonic())
                if timeout < MIN_ATTEMPT_S:
                    break
            try:
                result = self._post(index, path, payload, timeout)
            except _UNREACHABLE as exc:
                failures[endpoint] = describe_error(exc)
                attempt += 1
                if attempt < len(self._clients):
                    log.warning("etcd did not answer (%s: %s); trying the next endpoint", endpoint, failures[endpoint])
                elif attempt % len(self._clients) == 0:
                    left = deadline() - time.monotonic()
                    if attempt == len(self._clients) and left > 0:
                        log.warning("no etcd endpoint answered; trying them again for %.1f s", left)
                    time.sleep(max(0.0, min(pause, left)))
                    pause = min(2 * pause, MAX_BACKOFF_S)
                continue
            except Etcd3Exception as exc:
                raise FabricUnavailableError(
                    f"etcd at {endpoint} refused to {what}: {describe_error(exc)}", metadata={"endpoint": endpoint}
                ) from exc
            if index != first:
                with self._state_lock:
                    self._current = index
            if attempt >= len(self._clients):
                log.info("etcd at %s answered after %.1f s", endpoint, time.monotonic() - started)
            return result
        unanswered = (
            f"no etcd endpoint answered ({', '.join(self.endpoints)}) within {time.monotonic() - started:.1f} s"
        )
        causes = "; ".join(f"{e}: {why}" for e, why in failures.items())
        if lease_left is not None:
            self._lose_lead(f"{unanswered}, while its lease surely held; it may have run out since")
            raise LeadershipLostError(
                f"{unanswered}, so the ledger could not {what} while this replica surely led: its lease may have run "
                f"out, and another replica may lead now: {causes}",
                metadata={"endpoints": ",".join(self.endpoints)},
            )
        raise FabricUnavailableError(
            f"{unanswered}, so the ledger could not {what}: {causes}", metadata={"endpoints": ",".join(self.endpoints)}
        )

    def _lose_lead(self, why: str) -> None:
        """A call was not answered before the leader's lease may have run out: whether a write landed is unknown,
        and another replica may lead, so the lead ends (``on_deposed``) before the call fails, and no later write
        is sent. A lost lead, not a failed ledger: the replica steps down and comes back as a standby."""
        with self._state_lock:
            first, self._deposed = not self._deposed, self._deposed or why
        if first:
            self._on_deposed(why)

    def _post(self, index: int, path: str, payload: Mapping[str, Any], timeout: float) -> Mapping[str, Any]:
        """One request to one member, waiting ``timeout`` at most; etcd3gw's errors, as its own post raises them
        (which waits its client's fixed timeout)."""
        try:
            answer = self._session.post(self._clients[index].get_url(path), json=payload, timeout=timeout)
        except requests.Timeout as exc:
            raise ConnectionTimeoutError(str(exc)) from exc
        except requests.ConnectionError as exc:
            raise ConnectionFailedError(str(exc)) from exc
        if answer.status_code == requests.codes.service_unavailable or _too_many_requests(answer):
            raise ConnectionFailedError(answer.text, answer.reason)
        if answer.status_code in (requests.codes.request_timeout, requests.codes.gateway_timeout):
            raise ConnectionTimeoutError(answer.text, answer.reason)
        if answer.status_code != requests.codes.ok:
            raise Etcd3Exception(answer.text, answer.reason)
        document: Mapping[str, Any] = answer.json()
        return document

    def _range(
        self,
        start: bytes,
        end: bytes,
        *,
        limit: int = 0,
        revision: int = 0,
        keys_only: bool = False,
        count_only: bool = False,
    ) -> Mapping[str, Any]:
        payload: dict[str, Any] = {"key": _b64(start)}
        if end:
            payload["range_end"] = _b64(end)
        if limit:
            payload["limit"] = limit
        if revision:
            payload["revision"] = revision
        if keys_only:
            payload["keys_only"] = True
        if count_only:
            payload["count_only"] = True
        return self._call("read", "/kv/range", payload)

    def _scan(self, kind: str, revision: int, *, keys_only: bool = False) -> Iterator[Mapping[str, Any]]:
        """Every key-value of ``kind`` at ``revision`` (0: as the first read finds them), in key order, `PAGE`
        keys per read."""
        start, end = self._bounds(kind)
        while True:
            answer = self._range(start, end, limit=PAGE, revision=revision, keys_only=keys_only)
            kvs: list[Mapping[str, Any]] = answer.get("kvs", [])
            yield from kvs
            if not answer.get("more") or not kvs:
                return
            revision = revision or int(answer["header"]["revision"])
            start = _unb64(kvs[-1]["key"]) + b"\0"

    def _snapshot(self) -> int:
        """The cluster's current revision: reads at it see one consistent ledger."""
        key, _ = self._bounds(EVENTS)
        answer = self._range(key, b"", count_only=True)  # one key, not a range: quick however big the ledger
        return int(answer["header"]["revision"])

    def _commit(self, ops: list[dict[str, Any]]) -> None:
        """One transaction of ``ops``, ordered after this process's last write (the module's docstring); fenced,
        it raises `LeadershipLostError` and changes nothing when the leader key is no longer this replica's, and
        raises it too when no member answered before the lease may have run out (`_lose_lead`). Call it holding
        `_write_lock`.

        A write that fails otherwise (no member answers within the patience, or etcd refuses it: out of space;
        or another writer moved the sequence) fails the store as a whole (`failure`), and every later write is
        refused: the composer changed its memory before writing, and whether a timed-out write landed is
        unknown, so memory and etcd may differ from then on. The server stops serving, and the next leader
        recovers from etcd and the hardware; a copy of the write that lands late can land only before any
        later write, and before the next leader's key exists."""
        self._refuse_writes()
        if self._sequence is None:
            self._sequence = self._read_for_write(self._read_sequence)
        token = f"{self._token_prefix}:{next(self._tokens)}"
        fence = self._fence
        txn = {
            "compare": ([] if fence is None else [fence]) + [modified_at(self._sequence_key, self._sequence)],
            "success": [*ops, put_op(self._sequence_key, token)],
            "failure": [range_op(self._sequence_key)] + ([] if fence is None else [range_op(self._fence_key.encode())]),
        }
        try:
            answer = self._call("write", "/kv/txn", txn)
        except LeadershipLostError:
            raise  # the lead is lost, not the ledger (`_lose_lead`)
        except FabricUnavailableError as exc:
            self._failure = exc.message
            raise
        if answer.get("succeeded"):
            self._sequence = int(answer["header"]["revision"])
            return
        self._refused(answer, token)

    def _refused(self, answer: Mapping[str, Any], token: str) -> None:
        """Tell why the compare of the write with ``token`` failed, from the keys its transaction read back."""
        responses = [r.get("response_range", {}).get("kvs", []) for r in answer.get("responses", [])]
        sequence = responses[0][0] if responses and responses[0] else {}
        if sequence and _unb64(sequence.get("value", "")).decode(errors="replace") == token:
            # A copy sent earlier landed, whose answer was lost: this copy was refused because of it. No other
            # copy can land after it, since each compares the sequence as it was before this write.
            self._sequence = int(sequence["mod_revision"])
            log.info("a copy of a ledger write sent earlier landed at etcd revision %d", self._sequence)
            return
        if self._fence is not None:
            leader = responses[1][0] if len(responses) > 1 and responses[1] else {}
            if int(leader.get("create_revision", 0)) != self._fence_revision:
                self._on_deposed(f"the ledger refused a write: the leader key is no longer {self._fence_name}")
                raise LeadershipLostError(
                    f"the ledger refused a write: another replica leads now (the leader key is no longer "
                    f"{self._fence_name})",
                    metadata={"leader_key": self._fence_key},
                )
        self._failure = (
            f"another writer changed the etcd ledger under {self.prefix} (its sequence is at revision "
            f"{int(sequence.get('mod_revision', 0))}, not {self._sequence}): this process's memory may no longer "
            "match it"
        )
        raise FabricUnavailableError(self._failure, metadata={"prefix": self.prefix})

    def _read_sequence(self, revision: int = 0) -> int:
        """The sequence key's mod revision (at ``revision``, 0: now); 0 if it does not exist."""
        kvs = self._range(self._sequence_key, b"", revision=revision, keys_only=True).get("kvs", [])
        return int(kvs[0]["mod_revision"]) if kvs else 0

    def _refuse_if_failed(self) -> None:
        if self._failure:
            raise FabricUnavailableError(f"the ledger on etcd failed earlier and takes no more writes: {self._failure}")
        if self._deposed:
            raise LeadershipLostError(
                f"this replica may no longer lead and its ledger takes no more writes: {self._deposed}",
                metadata={"leader_key": self._fence_key},
            )

    def _refuse_writes(self) -> None:
        """Refuse a write of a failed or closed store, and of one neither fenced nor made ``unfenced`` (which
        fails it)."""
        self._refuse_if_failed()
        if self._closed:
            raise FabricUnavailableError(f"the etcd ledger under {self.prefix} is closed")
        if self._fence is None and not self.unfenced:
            self._failure = (
                f"the etcd ledger under {self.prefix} was written before it was fenced: it is the replicas' ledger, "
                "written only by the replica that leads (`fence`); a single writer makes it with unfenced=True"
            )
            raise LedgerNotFencedError(self._failure, metadata={"prefix": self.prefix})

    def _read_for_write(self, read: Callable[[], T]) -> T:
        """``read``, which a write needs first (when a prune is due): its failure fails the store as the
        write's would (`_commit`), since the caller changed its memory before writing."""
        self._refuse_writes()
        try:
            return read()
        except LeadershipLostError:
            raise
        except FabricUnavailableError as exc:
            self._failure = exc.message
            raise

    # ----------------------------------------------------------------- the ledger

    def load(self) -> LedgerState:
        """The ledger as it stands at one etcd revision. A compaction past that revision while the pages are
        read (an operator's ``etcdctl compact`` of the latest revision, on an etcd other programs write too) is
        no failure: the ledger is read again at the revision then, up to `LOAD_TRIES` times."""
        self._finish_staged()
        return self._at_one_revision(self._load_at, "the ledger")

    def _at_one_revision(self, read: Callable[[int], T], what: str) -> T:
        """``read`` of ``what`` at the current revision, read again whole at the revision then when etcd compacts
        that one before its last page is read, up to `LOAD_TRIES` times: its pages are one state of etcd or none."""
        tries = 1
        while True:
            revision = self._snapshot()
            try:
                return read(revision)
            except FabricUnavailableError as exc:
                if COMPACTED not in exc.message or tries == LOAD_TRIES:
                    raise
            log.warning("etcd compacted revision %d while %s was read there; reading it again", revision, what)
            tries += 1

    def _load_at(self, revision: int) -> LedgerState:
        comps = tuple(self._decoded(kv, Composition) for kv in self._scan(COMPOSITIONS, revision))
        res = tuple(self._decoded(kv, Reservation) for kv in self._scan(RESERVATIONS, revision))
        # Oldest first in the order they were written (their mod revisions, whichever replica wrote them), as
        # MemoryStore and SqliteStore (by rowid) keep them, never in the order of the client-chosen ids. Answers
        # written in one transaction (one hold of the composer) share a revision and are equally new: key order.
        kvs = sorted(self._scan(REQUESTS, revision), key=lambda kv: int(kv["mod_revision"]))
        requests_ = tuple(self._decoded(kv, RequestRecord) for kv in kvs[-REQUEST_RETENTION:])
        cordons = tuple(sorted(self._text(kv) for kv in self._scan(CORDONS, revision)))
        keys = sorted(self._text(kv) for kv in self._scan(QUARANTINES, revision))
        try:
            quarantined = tuple(quarantine_of(k) for k in keys)
        except UNDECODABLE as exc:
            raise undecodable(self._where, "a quarantines record", exc, "state.prefix") from exc
        oldest, newest = self._log_ends(revision)
        sequence = self._read_sequence(revision)
        with self._state_lock:
            self._log = (oldest, newest)  # a leader loads as it starts: what etcd holds, whoever wrote it
        with self._write_lock:
            # Writes are ordered after what was loaded, so a write by anyone else since fails the first of them.
            self._sequence = sequence if self._sequence is None else max(self._sequence, sequence)
        return LedgerState(comps, res, newest, requests_, cordons, quarantined)

    def _first_event_from(self, revision: int, at: int) -> int | None:
        """The lowest event revision at or above ``revision``, read at etcd revision ``at``; None if none."""
        start, end = self._bounds(EVENTS)
        answer = self._range(self._event_key(max(revision, 0)), end, limit=1, revision=at, keys_only=True)
        kvs = answer.get("kvs", [])
        return int(_unb64(kvs[0]["key"])[len(start) :]) if kvs else None

    def _log_ends(self, at: int) -> tuple[int, int]:
        """The lowest and the highest event revision at etcd revision ``at``; (1, 0) for an empty log, whose
        first event may be revision 1."""
        low = self._first_event_from(0, at)
        return (1, 0) if low is None else (low, self._last_event(low, at))

    def _last_event(self, low: int, at: int) -> int:
        """The highest event revision, the lowest being ``low``, without reading the log: range reads of one
        key each count the log, so contiguous revisions take three reads; gaps are found by galloping up and
        bisecting back (``2 log2`` more reads)."""
        start, end = self._bounds(EVENTS)
        count = int(self._range(start, end, revision=at, count_only=True).get("count", 0))
        # ``count`` distinct revisions from ``low`` on: the highest is at least low + count - 1.
        found = self._first_event_from(low + count - 1, at)
        low = low if found is None else found
        step = 1
        while (found := self._first_event_from(low + step, at)) is not None:
            low, step = found, step * 2
        high = low + step  # an event at low, none at or above high
        while high - low > 1:
            mid = (low + high) // 2
            found = self._first_event_from(mid, at)
            if found is None:
                high = mid
            else:
                low = found
        return low

    def _known_log(self) -> tuple[int, int]:
        """The oldest revision the event log may hold and the newest it holds: read from etcd the first time,
        then as this process's appends and prunes left them."""
        with self._state_lock:
            known = self._log
        if known is not None:
            return known
        ends = self._log_ends(self._snapshot())
        with self._state_lock:  # unless an append learnt them meanwhile, and may have moved them since
            if self._log is None:
                self._log = ends
            return self._log

    @property
    def _where(self) -> str:
        return f"etcd {', '.join(self.endpoints)} under prefix {self.prefix!r}"

    def _decoded(self, kv: Mapping[str, Any], cls: type[T]) -> T:
        """A record read from etcd, or the refusal naming its key: a damaged or hand-written value is the
        operator's to restore, never a traceback as a replica takes the lead."""
        key = _unb64(kv["key"]).decode(errors="replace")
        return decoded(_unb64(kv["value"]), cls, self._where, f"the record {key!r}", "state.prefix")

    def _text(self, kv: Mapping[str, Any]) -> str:
        try:
            return _unb64(kv["value"]).decode()
        except UNDECODABLE as exc:
            key = _unb64(kv["key"]).decode(errors="replace")
            raise undecodable(self._where, f"the record {key!r}", exc, "state.prefix") from exc

    def put_composition(self, composition: Composition) -> None:
        self._write(lambda txn: txn.put(self._key(COMPOSITIONS, composition.id), codec.record(composition)))

    def delete_composition(self, composition_id: str) -> None:
        self._write(lambda txn: txn.delete(self._key(COMPOSITIONS, composition_id)))

    def put_reservation(self, reservation: Reservation) -> None:
        self._write(lambda txn: txn.put(self._key(RESERVATIONS, reservation.id), codec.record(reservation)))

    def delete_reservation(self, reservation_id: str) -> None:
        self._write(lambda txn: txn.delete(self._key(RESERVATIONS, reservation_id)))

    def put_cordon(self, device: str) -> None:
        self._write(lambda txn: txn.put(self._key(CORDONS, device), device))

    def delete_cordon(self, device: str) -> None:
        self._write(lambda txn: txn.delete(self._key(CORDONS, device)))

    def put_quarantine(self, pool: str, allocation_id: str) -> None:
        key = quarantine_key(pool, allocation_id)
        self._write(lambda txn: txn.put(self._key(QUARANTINES, key), key))

    def delete_quarantine(self, pool: str, allocation_id: str) -> None:
        key = quarantine_key(pool, allocation_id)
        self._write(lambda txn: txn.delete(self._key(QUARANTINES, key)))

    def put_request(self, record: RequestRecord) -> None:
        """Write the request's key, and forget the oldest once etcd may hold twice the retention: now and then,
        not on every put, and counted from the keys found at the first put, so that a leader that restarts
        often still forgets."""

        def put(txn: _Txn) -> None:
            self._read_for_write(self._count_requests)
            txn.put(self._key(REQUESTS, record.id), codec.record(record))
            txn.after(self._request_put)

        self._write(put)

    def _request_put(self) -> None:
        """A request's key is in etcd: count it, and forget the oldest when due. Holding `_write_lock`."""
        self._request_keys = (self._request_keys or 0) + 1
        if self._request_keys >= 2 * REQUEST_RETENTION:
            self._request_keys = self._forget_old_requests()

    def _count_requests(self) -> int:
        """`_request_keys`, counted in etcd the first time."""
        if self._request_keys is None:
            start, end = self._bounds(REQUESTS)
            self._request_keys = int(self._range(start, end, count_only=True).get("count", 0))
        return self._request_keys

    def _forget_old_requests(self) -> int:
        """Delete every request id but the newest `REQUEST_RETENTION` (by etcd's mod revision, as `load`); the
        keys left. Holding `_write_lock`."""
        kvs = sorted(
            self._read_for_write(lambda: list(self._scan(REQUESTS, 0, keys_only=True))),
            key=lambda kv: int(kv["mod_revision"]),
        )
        old = [_unb64(kv["key"]) for kv in kvs[: max(0, len(kvs) - REQUEST_RETENTION)]]
        for i in range(0, len(old), TXN_OPS):
            self._commit([delete_op(key) for key in old[i : i + TXN_OPS]])
        return len(kvs) - len(old)

    def delete_request(self, request_id: str) -> None:
        self._write(lambda txn: txn.delete(self._key(REQUESTS, request_id)))

    def append_event(self, event: Event) -> None:
        """Write the event's key, in one transaction with the prune that keeps the log to its retention once a
        step of revisions is due: decided from the revisions, so that it does not matter how many of them this
        process wrote."""

        def append(txn: _Txn) -> None:
            oldest = txn.log_oldest if txn.log_oldest is not None else self._read_for_write(self._known_log)[0]
            txn.put(self._event_key(event.revision), codec.record(event))
            cutoff = event.revision - self._retention  # events at or below it are past the retention
            if cutoff - oldest + 1 >= min(PRUNE_EVERY, self._retention):
                start, _ = self._bounds(EVENTS)
                txn.delete(start, self._event_key(cutoff + 1))  # a later prune in the group replaces this one
                oldest = cutoff + 1
            txn.log_oldest = oldest
            txn.after(functools.partial(self._appended, oldest, event.revision))

        self._write(append)

    def _write(self, make: Callable[[_Txn], None]) -> None:
        """A write: ``make`` adds its operations to a transaction. Inside `atomic` to this thread's, written as the
        block ends; otherwise to one of its own, written now. Under `_write_lock`, so that a prune sees no write
        of this process between its read and its deletes."""
        txn = self._atomic.txn
        with self._write_lock:
            if txn is not None:
                self._refuse_writes()
                make(txn)
                return
            txn = _Txn()
            make(txn)
            self._write_txn(txn)

    def _write_txn(self, txn: _Txn) -> None:
        """Commit ``txn`` and then call what follows it (`_Txn.after`); holding `_write_lock`. More operations or
        bytes than etcd takes in one transaction (`TXN_OPS`, `TXN_BYTES`; a fabric gone away with many
        compositions) are staged first."""
        ops = list(txn.ops.values())
        if len(ops) > TXN_OPS or sum(map(_op_bytes, ops)) > TXN_BYTES:
            self._write_staged(ops)
        elif ops:
            self._commit(ops)
        for after in txn.followers:
            after()

    def _write_staged(self, ops: list[dict[str, Any]]) -> None:
        """Write ``ops``, more than one transaction takes, so that a reader finds all of them or none: put them
        under `STAGED` first (in parts of `STAGE_PART_BYTES`, the key that names the parts put with the last, so
        that parts without it are ignored), then apply them in transactions etcd takes (`_chunks`), the last
        deleting the staged block. A store that fails between leaves the block staged: the next `load` applies it
        before it reads (`_finish_staged`), and every operation in it is a put or a delete, which a second
        application leaves as the first did. A block that another writer left staged is finished first: this one
        would replace its parts, and then delete them. Holding `_write_lock`."""
        chunks = self._chunks(ops)  # before anything is staged: a block that no transaction can take is not
        try:
            self._read_for_write(self._finish_staged_locked)
        except LeadershipLostError:
            raise
        except DisaggError as exc:  # one left staged that cannot be read back stops the writes too
            self._failure = self._failure or exc.message
            raise
        text = json.dumps(ops)
        parts = [text[i : i + STAGE_PART_BYTES] for i in range(0, len(text), STAGE_PART_BYTES)]
        for index, part in enumerate(parts):
            staged = [put_op(self._key(STAGED, f"{index:06d}"), part)]
            if index == len(parts) - 1:
                staged.append(put_op(self._staged_key, json.dumps({"parts": len(parts)})))
            self._commit(staged)
        self._apply_staged(chunks)

    def _chunks(self, ops: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """``ops`` in order, in transactions etcd takes: at most `TXN_OPS` less the two that delete a staged block,
        and `TXN_BYTES`. An operation larger than that fails the store, as etcd's refusal of it would."""
        chunks: list[list[dict[str, Any]]] = [[]]
        size = 0
        for op in ops:
            length = _op_bytes(op)
            if length > TXN_BYTES:
                self._failure = (
                    f"a ledger record of {length} bytes is more than etcd takes in one transaction ({TXN_BYTES})"
                )
                raise FabricUnavailableError(self._failure, metadata={"prefix": self.prefix})
            if chunks[-1] and (len(chunks[-1]) >= TXN_OPS - 2 or size + length > TXN_BYTES):
                chunks.append([])
                size = 0
            chunks[-1].append(op)
            size += length
        return chunks

    def _apply_staged(self, chunks: list[list[dict[str, Any]]]) -> None:
        """Apply a staged block's operations, ``chunks`` a transaction each, the last transaction deleting the
        block. Holding `_write_lock`."""
        start, end = self._bounds(STAGED)
        for chunk in chunks[:-1]:
            self._commit(chunk)
        self._commit([*chunks[-1], delete_op(self._staged_key), delete_op(start, end)])

    def _finish_staged(self) -> None:
        """Apply the block a writer staged and did not finish (`_write_staged`), if any: a leader does, as it loads,
        before it reads or writes anything else."""
        with self._write_lock:
            self._finish_staged_locked()

    def _finish_staged_locked(self) -> None:
        """`_finish_staged`, holding `_write_lock`. The block is read at one revision, and again at a newer one when
        etcd compacts it between the block's pages (`_at_one_revision`): a compaction there failed a leader's start,
        before its load could read again, and a writer's block, which failed the store."""
        ops = self._at_one_revision(self._staged_ops, "a staged block")
        if ops is None:
            return
        log.warning("finishing a block of %d ledger writes that the last writer staged and did not finish", len(ops))
        self._apply_staged(self._chunks(ops))

    def _staged_ops(self, revision: int) -> list[dict[str, Any]] | None:
        """The operations of the block left staged, as etcd held them at ``revision``; None if there is none."""
        kvs = self._range(self._staged_key, b"", revision=revision).get("kvs", [])
        if not kvs:
            return None
        if self._fence is None and not self.unfenced:
            raise FabricUnavailableError(
                f"the etcd ledger under {self.prefix} holds a block of writes that its last writer staged and did "
                "not finish: the replica that leads finishes it as it loads, and nothing else can read the ledger "
                "whole before then",
                metadata={"prefix": self.prefix},
            )
        what = f"the staged block {self._staged_key.decode(errors='replace')!r}"
        try:
            count = int(json.loads(_unb64(kvs[0]["value"]))["parts"])
            parts = [_unb64(kv["value"]).decode() for kv in self._scan(STAGED, revision)][:count]
            if len(parts) != count:
                raise ValueError(f"{len(parts)} of its {count} parts are there")
            ops: list[dict[str, Any]] = json.loads("".join(parts))
            if not isinstance(ops, list):
                raise ValueError("its parts do not hold a list of operations")
        except UNDECODABLE as exc:
            raise undecodable(self._where, what, exc, "state.prefix") from exc
        return ops

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """See `Store.atomic`: the writes are gathered into one etcd transaction, committed as the block ends."""
        return self._in_one_txn()

    @contextlib.contextmanager
    def _in_one_txn(self) -> Iterator[None]:
        held = self._atomic
        if held.txn is not None:
            yield
            return
        txn = held.txn = _Txn()
        try:
            yield
        finally:
            held.txn = None
            if txn.ops:
                with self._write_lock:
                    self._write_txn(txn)

    def _appended(self, oldest: int, revision: int) -> None:
        """Follow an append of ``revision`` (and its prune, which left ``oldest``) in the known log."""
        with self._state_lock:
            newest = self._log[1] if self._log is not None else 0
            self._log = (oldest, max(newest, revision))

    def events_after(self, revision: int, limit: int = 1000) -> Sequence[Event]:
        """The events after ``revision`` within the retention (the newest revision minus it), as the other
        ledgers serve them: keys a prune has yet to delete are not served, so that a watch is refused at the
        same revision whichever ledger holds the log.

        Later pages read the log as the first one saw it, unless etcd compacts that revision meanwhile: they
        then read on at the current one (`_events_page`), where a prune may have deleted the events after the
        last one read. The answer never holds such a hole: it is then the log as it is now, from after that
        hole, whose first event a watch finds beyond the one it needs (OUT_OF_RANGE), as on any ledger."""
        _, newest = self._known_log()
        events: list[Event] = []
        start = self._event_key(max(revision, newest - self._retention, -1) + 1)
        _, end = self._bounds(EVENTS)
        at = 0
        while len(events) < limit:
            answer, at = self._events_page(start, end, min(PAGE, limit - len(events)), at)
            kvs = answer.get("kvs", [])
            page = [codec.loads(_unb64(kv["value"]), Event) for kv in kvs]
            if events and page and page[0].revision != events[-1].revision + 1:
                events = []  # pruned since the last one read: serving those would skip the hole silently
            events.extend(page)
            if not answer.get("more") or not kvs:
                break
            start = _unb64(kvs[-1]["key"]) + b"\0"
        return events

    def _events_page(self, start: bytes, end: bytes, limit: int, at: int) -> tuple[Mapping[str, Any], int]:
        """A page of the event log from ``start``, read at etcd revision ``at`` (0: the current one), and the
        revision it was read at. A compaction of ``at`` (an operator's ``etcdctl compact``, or etcd's
        auto-compaction) has it read at the current revision instead, which no compaction can have passed, so
        a watch far behind catches up however often etcd compacts."""
        try:
            answer = self._range(start, end, limit=limit, revision=at)
        except FabricUnavailableError as exc:
            if not at or COMPACTED not in exc.message:
                raise
            log.info("etcd compacted revision %d while the event log was read there; reading on at the current one", at)
            answer = self._range(start, end, limit=limit)
            at = 0
        return answer, at or int(answer["header"]["revision"])

    def close(self) -> None:
        """Refuse every later write, then close the connections (a request made after would open new ones)."""
        self._closed = True
        self._session.close()


class _Txn:
    """The operations of one etcd transaction being gathered, one per key (a later write of a key replaces the
    earlier, as etcd refuses a transaction that names a key twice), and what follows its commit."""

    __slots__ = ("followers", "log_oldest", "ops")

    def __init__(self) -> None:
        self.ops: dict[bytes, dict[str, Any]] = {}
        self.followers: list[Callable[[], None]] = []
        self.log_oldest: int | None = None
        """The oldest revision the event log will hold once this transaction's prune, if any, is done."""

    def put(self, key: bytes, value: str) -> None:
        self.ops.pop(key, None)  # the key's place is where it was last written
        self.ops[key] = put_op(key, value)

    def delete(self, key: bytes, end: bytes | None = None) -> None:
        """Delete ``key``, or the keys from it up to ``end``. A range drops what was gathered inside it: the range
        would delete it, and etcd refuses a transaction that puts a key its delete range covers. (The store's one
        range, the prune of old events, lies below every key put after it.)"""
        if end is not None:
            for inside in [k for k in self.ops if key <= k < end]:
                del self.ops[inside]
        self.ops.pop(key, None)
        self.ops[key] = delete_op(key, end)

    def after(self, follow: Callable[[], None]) -> None:
        """Call ``follow`` once the transaction is committed, holding the store's write lock."""
        self.followers.append(follow)


class _AtomicTxn(threading.local):
    txn: _Txn | None = None


def describe_error(exc: BaseException) -> str:
    """The gist of an etcd3gw or requests exception: the gateway's error text, else the exception's own."""
    text = (exc.detail_text if isinstance(exc, Etcd3Exception) else None) or str(exc) or type(exc).__name__
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    return str(doc.get("error", text)) if isinstance(doc, dict) else text


__all__ = ["EtcdStore", "LeadershipLostError", "describe_error"]
