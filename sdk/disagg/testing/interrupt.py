"""The suite's process's record that it was interrupted, which its pytest plugin reads between tests.

The first SIGINT or SIGTERM raises KeyboardInterrupt wherever the main thread is. Where that is a finaliser
(``__del__``, a weakref callback, a generator closed by the collector), Python prints the exception and goes on,
and the later signals are ignored so as not to cut the clean-up short: the run would go on to the end. The plugin
stops it after the test under way instead.
"""

from __future__ import annotations

import threading

_requested = threading.Event()
_why = ""


def request_stop(why: str) -> None:
    """Note that the run must stop (from a signal handler: it only sets a flag), saying ``why``."""
    global _why
    if not _requested.is_set():
        _why = why
        _requested.set()


def stop_requested() -> str:
    """Why the run must stop, or empty while nothing asked it to."""
    return _why if _requested.is_set() else ""
