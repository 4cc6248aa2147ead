"""The event poller: reads the switch's event log (vendor Get Event Records, C000h) on a thread of the driver's
and hands each record, in order, to the fabric, which turns it into `FabricEvent`s for its subscribers.

Polling rather than a notification because the FM API has none over this transport; the interval is well inside
the driver's declared event latency. The poller has its own connection, so a long Bind vPPB never delays it.
The log is bounded: records dropped before they were read (its oldest record past the poller's place) are a gap,
logged, after which the fabric is asked to `resync` from the switch's state, until it has. A restarted switch
numbers its records from 1 again: a next sequence number below the poller's place starts it over from the
switch's oldest record, and any new connection has the state read as after a gap (see `EventPoller._read`).
Either may be a restart, which lost the switch's bindings and allocations with no record: the fabric is told so
(``restarted``) before the records read then are delivered, so that a port's link up among them cannot stand a
composition whose binding the restart lost as whole before the fabric manager has read the switch again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from disagg.errors import DisaggError

from disagg_cxl_switch.driver.client import CCIClient, decode
from disagg_cxl_switch.emulator.events import EventRecord
from disagg_cxl_switch.emulator.vendor import GetEventRecordsRequest, GetEventRecordsResponse, VendorOpcode

POLL_INTERVAL_S = 0.05
STOP_TIMEOUT_S = 2.0
"""How long `EventPoller.stop` waits for the poller's thread to end (a handler running, a read of the switch)."""
log = logging.getLogger("disagg.cxl_switch")


def next_sequence(client: CCIClient) -> int:
    """The sequence number the switch's next event will carry: where a new reader starts."""
    raw = client.call(VendorOpcode.GET_EVENT_RECORDS, GetEventRecordsRequest(0, 0))
    return decode(GetEventRecordsResponse.decode, raw).next_sequence


class EventPoller:
    def __init__(
        self,
        address: str,
        first_sequence: int,
        deliver: Callable[[EventRecord], None],
        resync: Callable[[], None],
        restarted: Callable[[], None],
        *,
        queued: Callable[[], None],
    ) -> None:
        """``deliver`` takes each record in order; ``resync`` (raising `DisaggError` when the switch cannot be read,
        to be called again after the next poll) tells subscribers what the records lost in a gap would have;
        ``restarted`` tells them that the switch may have restarted (reached anew, or numbering anew); ``queued``
        publishes, before each poll, the events the driver's calls queued for this thread."""
        self._client = CCIClient(address)
        self._publish_queued = queued
        self._next = first_sequence
        self._deliver = deliver
        self._resync = resync
        self._on_restart = restarted
        self._behind = False
        self._anew = False
        """Whether the switch may have restarted since the last poll delivered: reached anew, or numbering anew."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cxl-switch-events {address}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            self._publish_queued()  # whether or not the switch answers the poll
            try:
                response = self._read()
                if response.next_sequence < self._next:
                    self._restarted(response)
                    response = self._read()
            except (DisaggError, ValueError):
                continue  # the switch is away; the next poll tries again
            if self._anew:
                self._anew = False
                self._on_restart()
            self._take(response)
            if self._behind:
                self._catch_up()
        self._publish_queued()  # queued before `stop`: a subscriber hears the last change a call made

    def _read(self) -> GetEventRecordsResponse:
        """The records from the poller's place. Read on a new connection, the switch may have restarted since the
        last read and already numbered past that place anew, which no number shows: its state is read too."""
        connections = self._client.connections
        raw = self._client.call(VendorOpcode.GET_EVENT_RECORDS, GetEventRecordsRequest(self._next, 0xFF))
        response = GetEventRecordsResponse.decode(raw)
        if connections and self._client.connections != connections:
            self._behind = self._anew = True
        return response

    def _restarted(self, response: GetEventRecordsResponse) -> None:
        """A switch whose next record is below the poller's place was restarted (a running one never reuses a
        number): every record it holds is new, and what its restart changed has no record."""
        log.warning(
            "cxl-switch: the switch's event log starts again at %d (the switch restarted); its records are read "
            "from there and the devices' health from the switch",
            response.oldest_sequence,
        )
        self._next = response.oldest_sequence
        self._behind = self._anew = True

    def _take(self, response: GetEventRecordsResponse) -> None:
        """Deliver the records read, after noting a gap before them."""
        if response.oldest_sequence > self._next:
            log.warning(
                "cxl-switch: the switch's event log dropped records %d to %d before they were read; the devices' "
                "health is read from the switch instead",
                self._next,
                response.oldest_sequence - 1,
            )
            self._behind = True
        for record in response.records:
            self._next = record.sequence + 1
            try:
                self._deliver(record)
            except Exception:  # a subscriber's handler: the poller must outlive it, or every later event is lost
                log.exception("cxl-switch: delivering event record %d failed", record.sequence)
        self._next = max(self._next, response.oldest_sequence)

    def _catch_up(self) -> None:
        """Resync after a gap, once the records the log still held are delivered (the state read is newer)."""
        try:
            self._resync()
        except DisaggError as exc:
            log.warning("cxl-switch: reading the devices' health after an event log gap failed (%s)", exc.message)
            return
        self._behind = False

    def stop(self) -> None:
        """Stop polling, once the events queued before now are published on the poller's thread, in order, within
        `STOP_TIMEOUT_S`: behind a handler that takes longer, or a read of a switch that does not answer, they are
        published after this returns, still in order."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=STOP_TIMEOUT_S)
        self._client.close()
