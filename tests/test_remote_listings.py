"""A remote driver's listing of bindings or allocations that breaks the driver interface's contract (an empty id,
another pool's allocation, no bytes, a device or id listed twice) is its bug: reconciliation judged from it,
quarantining and cordoning what the hardware never held and degrading compositions whose parts it still held."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import attrs
import pytest
from composer_helpers import ForwardingPool
from disagg.composer import FabricComposer
from disagg.errors import FabricUnavailableError
from disagg.interfaces import CallContext, Pool
from disagg.model import Allocation, Binding, CompositionState, EventType, Extent
from disagg.remote import RemoteFabric
from disagg.requestlang import parse_request
from disagg_sim import SimFabric
from remote_helpers import Plain, cxl, pcie, served

Garble = Callable[[list[Binding]], list[Binding]]
GarbleMemory = Callable[[list[Allocation]], list[Allocation]]


class GarbledPool(ForwardingPool):
    """A pool whose listing goes through ``garble`` while ``on``."""

    def __init__(self, inner: Pool, driver: Garbling) -> None:
        super().__init__(inner)
        self.driver = driver

    def allocations(self) -> Sequence[Allocation]:
        listed = list(self.inner.allocations())
        return self.driver.garble_memory(listed) if self.driver.on else listed


class Garbling(Plain):
    """A driver with a bug (another language, a field forgotten): once turned ``on``, it lists its bindings and
    allocations through ``garble`` and ``garble_memory``."""

    def __init__(self, inner: SimFabric, garble: Garble = list, garble_memory: GarbleMemory = list) -> None:
        super().__init__(inner)
        self.garble = garble
        self.garble_memory = garble_memory
        self.on = False

    def bindings(self) -> Sequence[Binding]:
        listed = list(self.inner.bindings())
        return self.garble(listed) if self.on else listed

    def pool(self, pool: str) -> Pool:
        return GarbledPool(self.inner.pool(pool), self)


@contextlib.contextmanager
def composed(driver: Garbling, request: list[str]) -> Iterator[tuple[FabricComposer, RemoteFabric, str]]:
    """A composer of ``driver``'s fabric served remotely, with one composition of ``request`` on it."""
    with served(driver) as server:
        remote = RemoteFabric(driver.name, server.address)
        composer = FabricComposer({driver.name: remote})
        try:
            composer.start()
            composition = composer.compose(parse_request("job", request)).composition
            assert composition is not None
            assert composer.reconcile() == 0
            yield composer, remote, composition.id
        finally:
            composer.close()
            remote.close()


def assert_left_alone(composer: FabricComposer, composition_id: str, caplog: pytest.LogCaptureFixture) -> None:
    """The pass judged nothing from the listing: it changed nothing, and said the fabric could not be read."""
    after = composer.revision
    with caplog.at_level(logging.WARNING, "disagg"):
        assert composer.reconcile() == 0
    assert composer.get(composition_id).state is CompositionState.COMPOSED
    assert composer.get(composition_id).missing == ()
    assert composer.cordoned_devices() == set()
    quarantined = {EventType.BINDING_QUARANTINED, EventType.ALLOCATION_QUARANTINED}
    assert not [e for e in composer.events(after) if e.type in quarantined]
    assert "malformed" in caplog.text


def _host_emptied(listed: list[Binding]) -> list[Binding]:
    return [attrs.evolve(b, host="") for b in listed]


def _device_emptied(listed: list[Binding]) -> list[Binding]:
    return [*listed, Binding("", listed[0].host)]


def _device_twice(listed: list[Binding]) -> list[Binding]:
    return [*listed, Binding(listed[0].device, "h-other")]


@pytest.mark.parametrize(
    "garble", [_host_emptied, _device_emptied, _device_twice], ids=["empty-host", "empty-device", "device-twice"]
)
def test_a_malformed_listing_of_bindings_is_not_judged(garble: Garble, caplog: pytest.LogCaptureFixture) -> None:
    driver = Garbling(pcie(), garble=garble)
    with composed(driver, ["gpu x1"]) as (composer, remote, composition_id):
        driver.on = True
        assert_left_alone(composer, composition_id, caplog)
        with pytest.raises(FabricUnavailableError, match="malformed bindings"):
            remote.bindings()


def _id_emptied(listed: list[Allocation]) -> list[Allocation]:
    return [attrs.evolve(a, id="") for a in listed]


def _host_of_memory_emptied(listed: list[Allocation]) -> list[Allocation]:
    return [attrs.evolve(a, host="") for a in listed]


def _another_pool(listed: list[Allocation]) -> list[Allocation]:
    return [attrs.evolve(a, pool=a.pool + "-other") for a in listed]


def _no_bytes(listed: list[Allocation]) -> list[Allocation]:
    return [attrs.evolve(a, amount_bytes=0) for a in listed]


def _id_twice(listed: list[Allocation]) -> list[Allocation]:
    return [*listed, *(attrs.evolve(a, host="h-other") for a in listed)]


def _more_than_the_pool(listed: list[Allocation]) -> list[Allocation]:
    return [attrs.evolve(a, amount_bytes=2**64 - 1, extents=()) for a in listed]


def _more_than_the_pool_together(listed: list[Allocation]) -> list[Allocation]:
    """Three allocations of a TiB each, without extents, from a pool of 2 TiB."""
    return [attrs.evolve(a, id=f"{a.id}-{n}", amount_bytes=1 << 40, extents=()) for a in listed for n in range(3)]


def _extent_beyond_the_pool(listed: list[Allocation]) -> list[Allocation]:
    return [attrs.evolve(a, extents=(Extent(2**63, a.amount_bytes),)) for a in listed]


def _extents_overlap(listed: list[Allocation]) -> list[Allocation]:
    """Another allocation carved over the very extents of the first."""
    return [*listed, *(attrs.evolve(a, id=f"{a.id}-over", host="h-other") for a in listed)]


@pytest.mark.parametrize(
    "garble",
    [
        _id_emptied,
        _host_of_memory_emptied,
        _another_pool,
        _no_bytes,
        _id_twice,
        _more_than_the_pool,
        _more_than_the_pool_together,
        _extent_beyond_the_pool,
        _extents_overlap,
    ],
    ids=[
        "empty-id",
        "empty-host",
        "another-pool",
        "no-bytes",
        "id-twice",
        "more-than-the-pool",
        "more-than-the-pool-together",
        "extent-beyond-the-pool",
        "extents-overlap",
    ],
)
def test_a_malformed_listing_of_allocations_is_not_judged(
    garble: GarbleMemory, caplog: pytest.LogCaptureFixture
) -> None:
    driver = Garbling(cxl(), garble_memory=garble)
    with composed(driver, ["cxl-memory 8GiB"]) as (composer, remote, composition_id):
        pool = composer.get(composition_id).allocations[0].pool
        driver.on = True
        assert_left_alone(composer, composition_id, caplog)
        with pytest.raises(FabricUnavailableError, match="malformed allocations"):
            remote.pool(pool).allocations()


def test_a_well_formed_listing_is_read() -> None:
    """Every pool's allocations, carved for two hosts, and every binding pass."""
    sim = cxl()
    with served(sim) as server:
        remote = RemoteFabric("cxl0", server.address)
        try:
            pool = next(p.id for p in remote.discover().pools)
            hosts = [h.id for h in remote.discover().hosts][:2]
            for n, host in enumerate(hosts):
                remote.pool(pool).allocate(f"a{n}", host, 1 << 30, CallContext(epoch=1))
            assert {(a.id, a.host) for a in remote.pool(pool).allocations()} == {
                (f"a{n}", host) for n, host in enumerate(hosts)
            }
            assert remote.bindings() == tuple(sim.bindings())
        finally:
            remote.close()


def test_an_allocation_that_names_no_pool_is_the_asked_pools() -> None:
    """A driver in another language may leave an allocation's pool unset: the listing is of the pool asked for, as
    a stream's event that names no fabric is the stream's."""
    driver = Garbling(cxl(), garble_memory=lambda listed: [attrs.evolve(a, pool="") for a in listed])
    with composed(driver, ["cxl-memory 8GiB"]) as (composer, remote, composition_id):
        (held,) = composer.get(composition_id).allocations
        driver.on = True
        assert [(a.id, a.pool) for a in remote.pool(held.pool).allocations()] == [(held.id, held.pool)]
        assert composer.reconcile() == 0
        assert composer.get(composition_id).state is CompositionState.COMPOSED
