"""Imported first by the launcher's forkserver (multiprocessing's preload; titanlite/commands/launch.py): the
server ends with the launcher that started it (Linux). Its workers end with it in turn (die_with_launcher),
so no worker outlives a SIGKILLed launcher; without this the server would live on, since every worker keeps
its end of the pipe by which multiprocessing ends a server."""

from titanlite.commands.worker import die_with_parent

die_with_parent()
