"""etcd's election timeout against the leader lease: after etcd's leader dies, its members elect another within one
to two election timeouts and answer no ledger write or lease refresh meanwhile, so a lease shorter than three
election timeouts may run out first, and the fabric manager's leader loses its lead to etcd's election.

etcd serves its election timeout in no API. Its command line, which each member lists at ``/debug/vars`` on its
client URL, is the one place a client reads it, and only when it was given there (``--election-timeout``): one set
by ``ETCD_ELECTION_TIMEOUT`` (Debian's ``/etc/default/etcd``) or in a ``--config-file``, or left at its default
(1000 ms), cannot be read, and then this says so at info level only. Nor does a lease grant tell it: etcd grants
at least 1.5 times its election timeout rounded up to whole seconds, which says 1000 ms and 1300 ms alike.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import requests

from disagg.store.etcd import parse_endpoint

log = logging.getLogger("disagg.ha")

ELECTIONS_PER_LEASE = 3
"""Election timeouts a lease must last at least: an election takes up to two, and the leader's refreshes need the
rest."""
FLAG = "election-timeout"
LONGEST_LEASE_S = 60
"""The longest ``lease_ttl_s`` the configuration takes (`disagg.config`)."""


def election_timeout_ms(cmdline: object) -> int | None:
    """The ``--election-timeout`` (milliseconds) on etcd's command line as ``/debug/vars`` lists it; None when it
    is not there. Go's flags take one dash or two, and the value after ``=`` or as the next argument."""
    if not isinstance(cmdline, list):
        return None
    for n, arg in enumerate(cmdline):
        if not isinstance(arg, str) or not arg.startswith("-"):
            continue
        name, eq, value = arg.lstrip("-").partition("=")
        if name != FLAG:
            continue
        if not eq:
            value = str(cmdline[n + 1]) if n + 1 < len(cmdline) else ""
        return int(value) if value.isascii() and value.isdigit() else None
    return None


def read_election_timeouts(endpoints: Sequence[str], timeout_s: float) -> dict[str, int]:
    """Each member's election timeout that can be read (`election_timeout_ms` of its ``/debug/vars``), by
    endpoint; a member that does not answer, or was not given the flag, is left out."""
    read: dict[str, int] = {}
    with requests.Session() as session:
        for endpoint in endpoints:
            host, port = parse_endpoint(endpoint)
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}/debug/vars"
            try:
                answer = session.get(url, timeout=timeout_s)
                document = answer.json() if answer.status_code == requests.codes.ok else {}
            except (requests.RequestException, ValueError):
                continue
            found = election_timeout_ms(document.get("cmdline")) if isinstance(document, dict) else None
            if found is not None:
                read[endpoint] = found
    return read


def advise(endpoints: Sequence[str], lease_ttl_s: int, timeout_s: float) -> None:
    """Warn once when ``lease_ttl_s`` is shorter than `ELECTIONS_PER_LEASE` times the longest election timeout of
    etcd's members that can be read, naming both and what to set; say at info level when none can be read."""
    read = read_election_timeouts(endpoints, timeout_s)
    enough_ms = lease_ttl_s * 1000 // ELECTIONS_PER_LEASE
    if not read:
        log.info(
            "could not read etcd's --election-timeout (it is read from a member's command line, at /debug/vars): "
            "keep it at a third of [state] lease_ttl_s or less (%d ms), or an election after etcd's leader dies "
            "may outlast the lease",
            enough_ms,
        )
        return
    endpoint, longest = max(read.items(), key=lambda item: item[1])
    if ELECTIONS_PER_LEASE * longest <= lease_ttl_s * 1000:
        return
    raise_to = -(-ELECTIONS_PER_LEASE * longest // 1000)
    log.warning(
        "etcd's --election-timeout of %d ms (at %s) is more than a third of [state] lease_ttl_s of %d s: an election "
        "after etcd's leader dies takes up to two election timeouts and may outlast the lease, which costs this "
        "replica the lead; give etcd an --election-timeout of %d ms or less%s",
        longest,
        endpoint,
        lease_ttl_s,
        enough_ms,
        f", or set lease_ttl_s = {raise_to}" if raise_to <= LONGEST_LEASE_S else "",
    )
