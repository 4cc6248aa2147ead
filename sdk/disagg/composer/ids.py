"""The ids the composer makes for compositions and reservations: ``c-`` or ``r-`` and 12 lowercase hex digits,
the shape the protocol keeps for them (docs/protocol.md refuses names of that shape).

Ids made one after another are neighbours: the upper 24 bits are random for a run of ids, and the lower 24 count
up within it. A ledger indexes its records by id, and SQLite's index took each new composition, and its record
again when composed, on a random page of the index: a commit of a dozen Composes wrote 26 pages to the
write-ahead log, 13 with neighbouring ids (docs/benchmarks.md). A run is a maker's life, or 2**24 ids; it starts
at a random count in its lower half. Two makers (two processes, or one after the other) share a run's upper
bits once in 2**24, and then overlap only if their counts meet (48 random bits an id would make a pair of equal
ids likely after about 2**24 ids in all); the composer also never gives an id that a record it holds has
(`FabricComposer._fresh_id`).
"""

from __future__ import annotations

import os
import random
import threading

RUN_BITS = 24
"""The bits of an id that count up within a run; the others are the run's."""


class IdMaker:
    """Makes ids, ``maker("c")``; thread-safe."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random(int.from_bytes(os.urandom(16), "big"))
        self._lock = threading.Lock()
        self._run = 0
        self._count = 1 << RUN_BITS  # no run yet: the first id starts one

    def __call__(self, prefix: str) -> str:
        with self._lock:
            if self._count >= 1 << RUN_BITS:
                self._run = self._rng.getrandbits(48 - RUN_BITS) << RUN_BITS
                self._count = self._rng.getrandbits(RUN_BITS - 1)
            made = self._run | self._count
            self._count += 1
        return f"{prefix}-{made:012x}"
