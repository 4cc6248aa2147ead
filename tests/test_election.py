"""Leader election on a real etcd (`disagg.ha.Leadership`): the lead is kept as long as etcd can refresh it.

A standby that campaigned for longer than the lease's time to live wins with a lease as fresh as a leader's,
and a member that stops answering costs the leader a member, not the lead.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.ha import Leadership
from etcd_helpers import EtcdCluster, etcd_binary, start_etcd_cluster

TTL_S = 2
WAIT_S = 10.0


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    etcd_binary()
    cluster = start_etcd_cluster(tmp_path, members=3)
    try:
        yield cluster
    finally:
        for member in cluster.members:
            if member.process is not None and member.process.poll() is None:
                member.process.send_signal(signal.SIGCONT)
        cluster.stop()


def campaign_in_thread(leadership: Leadership) -> tuple[threading.Thread, list[int]]:
    won: list[int] = []
    thread = threading.Thread(target=lambda: won.append(leadership.campaign()), daemon=True)
    thread.start()
    return thread, won


class TestLeadership:
    def test_a_standby_that_waited_keeps_the_lead_it_wins(self, etcd: EtcdCluster) -> None:
        """The lead frees up when the standby's first lease is most of its time to live old: the standby
        refreshes its lease before it creates the key, so it does not lose the lead a moment after winning."""
        first = Leadership(etcd.endpoints, "first", ttl_s=TTL_S)
        assert first.campaign() > 0
        standby = Leadership(etcd.endpoints, "standby", ttl_s=TTL_S)
        thread, won = campaign_in_thread(standby)
        time.sleep(0.7 * TTL_S)
        first.resign()
        thread.join(WAIT_S)
        assert won and won[0] > first.epoch
        assert not standby.lost.wait(2.5 * TTL_S), "the new leader lost the lead with nothing wrong"
        standby.resign()

    def test_a_member_that_stops_answering_costs_no_lead(self, etcd: EtcdCluster) -> None:
        """The member the leader talks to stops (SIGSTOP: it holds its connections and answers nothing); the
        leader's refresh times out within a sixth of the time to live and goes to the next member at once."""
        leader = Leadership(etcd.endpoints, "leader", ttl_s=TTL_S)
        assert leader.campaign() > 0
        stalled = etcd.members[0].process
        assert stalled is not None
        stalled.send_signal(signal.SIGSTOP)
        try:
            assert not leader.lost.wait(3 * TTL_S), "one stalled member of three cost the lead"
        finally:
            stalled.send_signal(signal.SIGCONT)
        leader.resign()
