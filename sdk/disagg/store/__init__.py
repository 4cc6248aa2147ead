"""The ledger: compositions, reservations, request ids and the event log (SQLite by default, etcd for several
replicas, in memory for tests)."""

from typing import TYPE_CHECKING

from disagg.store.base import LedgerState, RequestRecord, Store
from disagg.store.memory import MemoryStore
from disagg.store.sqlite import SqliteStore

if TYPE_CHECKING:
    from disagg.store.etcd import EtcdStore


def __getattr__(name: str) -> object:
    # EtcdStore is imported on first use: its HTTP client stack would add a tenth of a second to every start.
    if name == "EtcdStore":
        from disagg.store.etcd import EtcdStore

        return EtcdStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EtcdStore", "LedgerState", "MemoryStore", "RequestRecord", "SqliteStore", "Store"]
