"""The ``disagg`` console script: loads the command line, then runs it.

Loading it (grpc, protobuf, the composer) takes a third of a second, before `disagg.cli.main` can catch an
interrupt: Ctrl-C then was a traceback and a death by SIGINT, where a moment later it is "disagg: interrupted"
and exit 130. Nothing has started yet, so nothing is left half done.
"""

from __future__ import annotations

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


if __name__ == "__main__":
    sys.exit(main())
