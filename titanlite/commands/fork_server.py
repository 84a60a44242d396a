"""Imported first by the launcher's forkserver (multiprocessing's preload; titanlite/commands/launch.py): the
server ends with the launcher that started it (Linux). Its workers end with it in turn (die_with_launcher),
so no worker outlives a SIGKILLed launcher; without this the server would live on, since every worker keeps
its end of the pipe by which multiprocessing ends a server.

The server ignores SIGTERM and SIGHUP, as multiprocessing already has it ignore SIGINT: a signal sent to the whole
job (Slurm's at its time limit or `scancel`, `kill -TERM -PGID`, a closed terminal's SIGHUP) reaches the server
too, and a server that died of it would take every worker with it (die_with_launcher) before they could finish
their step and save its checkpoint. Each worker restores the default dispositions as it starts (worker.forked)."""

import signal

from titanlite.commands.worker import die_with_parent

die_with_parent()
for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, signal.SIG_IGN)
