"""Progress of a long data preparation: a live bar on a terminal, a plain line every so often in a log."""

from __future__ import annotations

import logging
import time

from titanlite.base.logs import StatusLine

LOG_EVERY_SECONDS = 15.0

logger = logging.getLogger(__name__)


class Progress:
    """Documents, MB read, tokens/s and ETA of one build, as a line every LOG_EVERY_SECONDS; on a terminal the
    bar is redrawn in place on stderr instead."""

    def __init__(self, label: str, total_bytes: int, done_bytes: int = 0) -> None:
        self.label, self.total_bytes = label, total_bytes
        self.done_bytes = done_bytes  # counted as read, but not in the speed
        self.bytes = self.tokens = self.documents = 0
        self.start = self.last_line = time.perf_counter()
        self.bar = StatusLine()

    def note(self, text: str) -> None:
        logger.info(f"  prepare {self.label}: {text}")

    def update(self, nbytes: int, tokens: int, documents: int) -> None:
        self.bytes += nbytes
        self.tokens += tokens
        self.documents += documents
        now = time.perf_counter()
        if self.bar.live:
            self.bar.show(self.line())
        elif now - self.last_line >= LOG_EVERY_SECONDS:
            logger.info("  " + self.line())
            self.last_line = now

    def finish(self) -> None:
        if self.bar.live:
            self.bar.clear()
        if self.bytes:
            logger.info("  " + self.line(final=True))

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
