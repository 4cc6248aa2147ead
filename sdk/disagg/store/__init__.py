"""The ledger: compositions, reservations and the event log (SQLite by default, in memory for tests)."""

from disagg.store.base import LedgerState, Store
from disagg.store.memory import MemoryStore
from disagg.store.sqlite import SqliteStore

__all__ = ["LedgerState", "MemoryStore", "SqliteStore", "Store"]
