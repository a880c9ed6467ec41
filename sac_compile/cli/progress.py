"""A plain-stderr progress bar (no dependency) and one-line status messages.

On a terminal the bar redraws in place (``\\r``); elsewhere (a pipe, a CI log, a test)
status lines are printed as they come and the bar only at phase ends, so logs stay short.
"""
from __future__ import annotations

import sys
import time
from typing import IO

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, *, stream: IO[str] | None = None, enabled: bool = True,
                 width: int = 28) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.phase = ""
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._drawn = False

    # -- bar -----------------------------------------------------------------------------
    def _bar(self) -> str:
        frac = min(1.0, self.done / self.total)
        fill = int(frac * self.width)
        elapsed = time.perf_counter() - self.start
        return (f"[{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:3.0f}% "
                f"{elapsed:5.1f}s  {self.phase}")

    def _draw(self, force: bool = False) -> None:
        if not self.enabled or not self.tty:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        line = self._bar()
        self.stream.write("\r" + line[:118].ljust(118))
        self.stream.flush()
        self._drawn = True

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r" + " " * 118 + "\r")
            self._drawn = False

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._draw(force=True)

    # -- messages ------------------------------------------------------------------------
    def say(self, message: str) -> None:
        """One status line (e.g. what a compile step is doing), above the bar."""
        if not self.enabled:
            return
        self._clear()
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"[{elapsed:6.1f}s] {message}\n")
        self.stream.flush()
        self._draw(force=True)

    def finish(self) -> None:
        self.done = self.total
        if self.enabled and self.tty:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False
