"""What titanlite tells the user: each logged line printed as it is, on stdout or (errors) stderr, by rank 0 of a
job unless every rank must say it; a command may quote a component's lines in its own voice."""

import logging

import pytest

from tests.helpers import REPO
from titanlite.base import logs
from titanlite.base.logs import EVERY_RANK, STDERR


@pytest.fixture
def titanlite_logger():
    """The "titanlite" logger as the test found it, afterwards (set_up changes it for the whole process)."""
    logger = logging.getLogger("titanlite")
    handlers, level = list(logger.handlers), logger.level
    yield logging.getLogger("titanlite.components.example")
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_lines_print_as_they_are_on_stdout_and_errors_on_stderr(titanlite_logger, capsys):
    logs.set_up()
    logs.set_up()  # a second set-up replaces the first: each line still prints once
    titanlite_logger.info("  model gpt2 debug: 100% of it")
    titanlite_logger.warning("  checkpoint: WARNING skipping step-10")
    titanlite_logger.debug("not shown")
    titanlite_logger.error("titanlite: second SIGINT: leaving now")
    titanlite_logger.info("bench data: generated 1 MiB", extra=STDERR)
    out, err = capsys.readouterr()
    assert out == "  model gpt2 debug: 100% of it\n  checkpoint: WARNING skipping step-10\n"
    assert err == "titanlite: second SIGINT: leaving now\nbench data: generated 1 MiB\n"


def test_other_ranks_print_only_what_every_rank_says(titanlite_logger, capsys):
    logs.set_up(rank=1)
    titanlite_logger.info("step 10  loss 3.2")
    titanlite_logger.warning("  checkpoint: WARNING skipping step-10")
    titanlite_logger.warning("titanlite: SIGTERM: finishing this step, then saving a checkpoint", extra=EVERY_RANK)
    titanlite_logger.error("titanlite: second SIGTERM: leaving now", extra=EVERY_RANK)
    out, err = capsys.readouterr()
    assert out == "titanlite: SIGTERM: finishing this step, then saving a checkpoint\n"
    assert err == "titanlite: second SIGTERM: leaving now\n"
    assert not logs.prints_here() and not logs.StatusLine().live


def test_a_command_quotes_a_components_lines_in_its_own_voice(titanlite_logger, capsys):
    logs.set_up()
    with logs.restyled(lambda line: f"titanlite: {line.strip()}"):
        titanlite_logger.warning("  checkpoint: WARNING skipping %s", "step-10")
    titanlite_logger.info("  checkpoint: resumed")
    assert capsys.readouterr().out == "titanlite: checkpoint: WARNING skipping step-10\n  checkpoint: resumed\n"


def test_modules_run_with_python_m_log_under_titanlite():
    """Under `python -m titanlite.commands.train` the module is __main__: a logger named __name__ would sit
    outside "titanlite" and print nothing."""
    for path in sorted((REPO / "titanlite").rglob("*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__"' in text:
            assert "getLogger(__name__)" not in text, f"{path.relative_to(REPO)}: use logging.getLogger(__spec__.name)"
