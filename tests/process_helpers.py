"""The output of a child process (`disagg serve`, `disagg driver serve`), read on a thread as it comes.

Reading as it comes keeps the child from blocking on a full pipe however much it logs, and lets a test wait
for a line ("serving on ...") with a bound, seeing everything the child said when the line does not come.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time


class ChildOutput:
    """Every line ``proc`` writes to its (merged) standard output, kept in order."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._lines: list[str] = []
        self._ended = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def lines(self) -> list[str]:
        with self._changed:
            return list(self._lines)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_ended(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the child's output to end (after it exits, all of it is read)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._ended, timeout)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str] | None:
        """The first line that matches ``pattern`` (searched), waiting up to ``timeout`` seconds for it; None
        when it does not come in time or the child's output ends without it."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self._lines[seen:]:
                    if found := re.search(pattern, line):
                        return found
                seen = len(self._lines)
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    return None
                self._changed.wait(left)

    def wait_ready(self, pattern: str, timeout: float, what: str) -> re.Match[str]:
        """`wait_for`, or AssertionError saying whether ``what`` exited or only stayed silent, with its output."""
        found = self.wait_for(pattern, timeout)
        if found is not None:
            return found
        if self._ended:
            code = self.proc.wait(10)
            raise AssertionError(f"{what} exited with {code} before printing {pattern!r}:\n{self.text}")
        raise AssertionError(f"{what} printed no {pattern!r} line in {timeout:g} s:\n{self.text}")
