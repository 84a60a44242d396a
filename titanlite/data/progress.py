"""Progress of a long data preparation: a live bar on a terminal, a plain line every so often in a log."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

LOG_EVERY_SECONDS = 15.0


class Progress:
    """Documents, MB read, tokens/s and ETA of one build. `say` prints a line (None: stay quiet); on a
    terminal the bar is redrawn in place on stderr instead."""

    def __init__(self, label: str, total_bytes: int, say: Callable[[str], None] | None, done_bytes: int = 0) -> None:
        self.label, self.total_bytes, self.say = label, total_bytes, say
        self.done_bytes = done_bytes  # counted as read, but not in the speed
        self.bytes = self.tokens = self.documents = 0
        self.start = self.last_line = time.perf_counter()
        self.live = say is not None and sys.stderr.isatty()

    def note(self, text: str) -> None:
        if self.say is not None:
            self.say(f"  prepare {self.label}: {text}")

    def update(self, nbytes: int, tokens: int, documents: int) -> None:
        self.bytes += nbytes
        self.tokens += tokens
        self.documents += documents
        now = time.perf_counter()
        if self.live:
            sys.stderr.write("\r" + self.line() + "\033[K")
            sys.stderr.flush()
        elif self.say is not None and now - self.last_line >= LOG_EVERY_SECONDS:
            self.say("  " + self.line())
            self.last_line = now

    def finish(self) -> None:
        if self.live:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        if self.say is not None and self.bytes:
            self.say("  " + self.line(final=True))

    def line(self, final: bool = False) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        read = (self.done_bytes + self.bytes) / 2**20
        total = f"/{self.total_bytes / 2**20:,.0f}" if self.total_bytes else ""
        speed = self.tokens / elapsed
        text = (
            f"prepare {self.label}: {self.documents:,} documents, {read:,.0f}{total} MB, "
            f"{self.tokens / 1e6:,.1f} M tokens, {speed / 1e6:.2f} M tokens/s"
        )
        if final:
            return text + f", {elapsed:.1f} s"
        if self.total_bytes and self.bytes:
            left = (self.total_bytes - self.done_bytes - self.bytes) * elapsed / self.bytes
            text += f", ETA {int(left // 60)}m{int(left % 60):02d}s"
        return text
