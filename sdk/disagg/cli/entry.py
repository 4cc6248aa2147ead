"""The ``disagg`` console script: loads the command line, then runs it.

Loading it (grpc, protobuf, the composer) takes a third of a second, before `disagg.cli.main` can catch an
interrupt: Ctrl-C then was a traceback and a death by SIGINT, where a moment later it is "disagg: interrupted"
and exit 130. Nothing has started yet, so nothing is left half done.

Once the command has its exit status, Ctrl-C is ignored (`finished`).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

INTERRUPTED = 130
"""The exit code of a command stopped by Ctrl-C, as a shell reports one ended by SIGINT."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from disagg.cli.main import main as run
    except KeyboardInterrupt:
        print("disagg: interrupted while starting: nothing was done", file=sys.stderr)
        return INTERRUPTED
    return run(argv)


def script() -> int:
    """The console script: the command line, then its exit status as `finished` keeps it."""
    return finished(main())


def finished(code: int) -> int:
    """``code``, the exit status of the command this process ran, from now on kept whatever Ctrl-C comes: the
    interpreter's exit takes a while (grpc's threads, the modules), and after Python has put back the default
    action of SIGINT, a Ctrl-C then ended the process as killed by SIGINT, so that a shell or CI reported a
    command that had finished (its change made, its reports written, its status printed) as interrupted. Only
    for a process that runs one command: never in one that calls `main` as a library."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(script())
