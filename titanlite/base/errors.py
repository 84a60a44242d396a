"""The ways a run ends early that titanlite names: the entry points turn each into its own exit status
(titanlite/base/failures.py): 2 for a ConfigError, 3 for a NonFiniteLoss or TooManySkippedSteps, 128 + the signal for
Preempted."""

from __future__ import annotations

import os
import signal
import stat


class ConfigError(ValueError):
    """A bad config value, an impossible layout, or unusable input data; the message names the knob."""


class NonFiniteLoss(Exception):
    """A step's loss or gradient norm is NaN or infinite; the run stops before anything of it is saved."""


class TooManySkippedSteps(Exception):
    """More steps in a row were skipped (spikes, non-finite values) than training.max_skipped_steps_in_row allows; the
    run stops before anything past them is saved."""


class Preempted(Exception):
    """The run stopped after a signal, with a checkpoint at the step it had reached when checkpoints are on."""

    def __init__(self, signum: int, step: int, saved: bool):
        name = signal.Signals(signum).name
        if saved:
            super().__init__(
                f"stopped by {name} after step {step}, with a checkpoint of it; run the same command to resume"
            )
        else:
            super().__init__(f"stopped by {name} after step {step}; nothing was saved (checkpoint.enable is false)")
        self.signum = signum


def short_reason(error: BaseException, limit: int = 120) -> str:
    """An exception's first line, shortened, for a one-line message that quotes what a library said."""
    lines = str(error).strip().splitlines()
    reason = lines[0] if lines else type(error).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def resolved_against(path: str | os.PathLike) -> str:
    """' (resolved against CWD)' for a relative path, '' for an absolute one: what a message naming a path the
    user gave adds, since ./run_train.sh runs from the checkout, not from where it was started."""
    text = os.path.expanduser(os.fspath(path))
    return "" if not text or os.path.isabs(text) else f" (resolved against {os.getcwd()})"


# Linux's limits, in bytes: a name (one file or folder) of at most NAME_MAX, a path of fewer than PATH_MAX (its end
# included). Past either, every call that takes the path fails with ENAMETOOLONG.
NAME_MAX, PATH_MAX = 255, 4096


def check_path_length(path: str | os.PathLike, what: str) -> None:
    """Refuse a path that no file system could hold, before anything uses it (ConfigError; `what` names where it was
    given: a config key, "--config", "generate --output"): a name in it over NAME_MAX bytes, or the whole path (with
    ~ expanded) PATH_MAX bytes or more."""
    text = os.path.expanduser(os.fspath(path))
    for name in text.split(os.sep):
        size = len(os.fsencode(name))
        if size > NAME_MAX:
            raise ConfigError(
                f"{what}: its name '{name[:24]}...' is {size} bytes long, more than the {NAME_MAX} a file or folder "
                "name may have; shorten it"
            )
    size = len(os.fsencode(text))
    if size >= PATH_MAX:
        raise ConfigError(
            f"{what} is {size} bytes long, more than the {PATH_MAX - 1} a path may have; use a shorter one"
        )


def special_file(path: str | os.PathLike) -> str | None:
    """'a FIFO (named pipe)', 'a socket', 'a character device' or 'a block device' for a path that exists as
    one, else None: what a message says instead of 'does not exist' for a path that is there but no file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((name for test, name in kinds if test(mode)), None)
