"""What titanlite tells its user goes through `logging`, a logger per module under "titanlite"; `set_up`, called
once by each entry point, prints each record's text as it is: on stdout, or stderr for errors, on rank 0."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ROOT = "titanlite"
# extra= of a record that every torchrun worker prints (a signal it received, a fault it injects); any other
# record is printed by rank 0 alone, which speaks for the job.
EVERY_RANK = {"every_rank": True}
# extra= of a record below ERROR that belongs on stderr: a tool's progress notes, kept off the report it prints.
STDERR = {"stderr": True}


class Lines(logging.Handler):
    """Each record's text and nothing else (no level, no time: the lines users and tests read), on stdout, or on
    stderr at ERROR and above or with extra=STDERR, flushed at once; off rank 0, records with extra=EVERY_RANK only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def emit(self, record: logging.LogRecord) -> None:
        if self.rank != 0 and not getattr(record, "every_rank", False):
            return
        # Looked up per record, not kept: pytest's capsys and contextlib.redirect_stdout swap sys.stdout.
        stream = sys.stderr if record.levelno >= logging.ERROR or getattr(record, "stderr", False) else sys.stdout
        try:
            stream.write(self.format(record) + "\n")  # one write: the ranks of a node share the stream
            stream.flush()
        except Exception:
            self.handleError(record)


def set_up(rank: int = 0) -> None:
    """Print titanlite's records in this process (INFO and above), as `rank` (a torchrun worker's RANK; 0
    elsewhere). A second call replaces the first: the CLI's in-process train and eval call it again."""
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, Lines)]:
        logger.removeHandler(handler)
    logger.addHandler(Lines(rank))
    logger.setLevel(logging.INFO)


def prints_here() -> bool:
    """Whether this process prints rank 0's lines (set_up ran, as rank 0)."""
    return any(isinstance(h, Lines) and h.rank == 0 for h in logging.getLogger(ROOT).handlers)


@contextmanager
def restyled(restyle: Callable[[str], str]) -> Iterator[None]:
    """Inside the block, each printed line rewritten by `restyle`: a command quoting a component's notes in its
    own voice (`titanlite check` prints a run's '  checkpoint: ...' as 'titanlite: checkpoint: ...')."""

    def rewrite(record: logging.LogRecord) -> bool:
        record.msg, record.args = restyle(record.getMessage()), None
        return True

    handlers = [h for h in logging.getLogger(ROOT).handlers if isinstance(h, Lines)]
    for handler in handlers:
        handler.addFilter(rewrite)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(rewrite)


# The loggers of torchao's import (and of the pytree registrations it makes), which warn once per optional CUDA
# extension that cannot load on this machine: nothing a titanlite user acts on.
TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextmanager
def quieted(names: tuple[str, ...] = TORCHAO_IMPORT_LOGGERS) -> Iterator[None]:
    """Inside the block, the loggers `names` pass on errors only; their levels are restored after it."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class StatusLine:
    """A line redrawn in place on stderr (a progress bar), where stderr is a terminal and this process prints
    (prints_here). A stream, not a record: logging writes whole lines, a bar rewrites its own with '\\r'."""

    def __init__(self) -> None:
        self.live = sys.stderr.isatty() and prints_here()

    def show(self, text: str) -> None:
        sys.stderr.write("\r" + text + "\033[K")
        sys.stderr.flush()

    def clear(self) -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
