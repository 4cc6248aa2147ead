"""The ledger: compositions, reservations, request ids and the event log (SQLite by default, in memory for tests)."""

from disagg.store.base import LedgerState, RequestRecord, Store
from disagg.store.memory import MemoryStore
from disagg.store.sqlite import SqliteStore

__all__ = ["LedgerState", "MemoryStore", "RequestRecord", "SqliteStore", "Store"]
