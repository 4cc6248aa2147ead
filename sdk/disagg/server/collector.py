"""What a serving process asks of Python's garbage collector.

`disagg serve` keeps a large heap for as long as it runs (the fabric's devices and their index, frozen out of the
collector's generations once discovered) and makes many short-lived objects for each call, nearly all freed by
reference counting as the call ends. CPython collects its youngest generation every 700 net allocations of
container objects, a setting made for small programs: in the server that is a collection every few dozen
Composes, each walking what the calls since made, about 4% of a durable Compose's time on the event loop
(docs/benchmarks.md). A young generation of `YOUNG_THRESHOLD` objects is collected about thirty times less
often, for at most a few megabytes of cyclic garbage left waiting meanwhile; the older generations keep the
thresholds they have.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
"""Net allocations of container objects between two collections of the youngest generation (CPython: 700)."""


def tune_for_serving() -> None:
    """Collect the youngest generation every `YOUNG_THRESHOLD` allocations; the process's to call, once."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
