"""torchrun that ends a failed job with the failing worker's own line and exit status.

`python -m titanlite.commands.launch <torchrun options> -m titanlite.commands.train ...` (what run_train.sh,
`eval --ngpu`, `plan --measure`, `bench strategies` and the tests run) is torchrun, run in this process, with one
difference: torchrun ends a failed job with its multi-line summary and status 1 whatever the worker's
was. Here every worker records its failure (titanlite/base/failures.py) in a temporary folder; after a
failure the first one's line is printed last and its status (2 config, 3 non-finite loss, 4 out of
memory, 1 other) is this command's. A signal to the launcher ends it with 128 + the signal number;
torchrun's own failure (a rendezvous that cannot connect) is one line and status 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from titanlite.base.failures import FAILURE_DIR_ENV, PREFIX, first_failure


def main(argv: list[str] | None = None) -> int:
    folder = Path(tempfile.mkdtemp(prefix="titanlite-failures-"))
    os.environ[FAILURE_DIR_ENV] = str(folder)
    try:
        torchrun.run(torchrun.parse_args(sys.argv[1:] if argv is None else argv))
        return 0
    except ChildFailedError as error:
        return report(folder, error)
    except SignalException as e:
        return 128 + int(e.sigval)
    except Exception as e:  # torchrun itself failed (rendezvous, arguments): one line, not its traceback
        print(f"{PREFIX}torchrun could not run the job: {chain(e)}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def chain(e: BaseException) -> str:
    """'Type: message' of an exception and of the exceptions it was raised from (the rendezvous errors
    keep their reason, e.g. a host name that does not resolve, in __cause__)."""
    parts = []
    while e is not None and len(parts) < 3:
        message = " ".join(str(e).split())[:200]
        parts.append(f"{type(e).__name__}{': ' + message if message else ''}")
        e = e.__cause__ or e.__context__
    return "; from ".join(parts)


def report(folder: Path, error) -> int:
    """Print the root cause last; returns the exit status for it."""
    first = first_failure(folder)
    if first is not None:
        print(first["line"], file=sys.stderr, flush=True)
        return first["code"]
    rank, failure = error.get_first_failure()  # no worker said why: it was killed, or died in C
    code = failure.exitcode
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        print(
            f"{PREFIX}rank {rank}: killed by {name} without a reason (a kill, or the kernel's out-of-memory "
            f"killer: see `dmesg`); torchrun's log above has its last output",
            file=sys.stderr,
            flush=True,
        )
        return 128 - code
    print(
        f"{PREFIX}rank {rank}: exited with status {code} before titanlite could say why (see its output above)",
        file=sys.stderr,
        flush=True,
    )
    return code or 1


if __name__ == "__main__":
    sys.exit(main())
