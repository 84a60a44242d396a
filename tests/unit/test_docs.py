"""The documentation cannot drift from the code: docs/configuration.md is exactly what `titanlite help
--markdown` prints from titanlite/config/sections.py, every relative link in README.md and docs/ reaches an
existing file and heading, no page quotes a line number of the code, and the preemption lines quoted are the
ones a stopped run prints."""

import logging
import os
import re
import shlex
import signal
from pathlib import Path

import torch

from titanlite.base import devices
from titanlite.base.errors import Preempted
from titanlite.base.failures import record
from titanlite.commands import check as preflight
from titanlite.commands import cli
from titanlite.commands.check import GIB, Capacity
from titanlite.components.resilience import StopOnSignal
from titanlite.config import JobConfig, reference_markdown

REPO = Path(__file__).resolve().parents[2]
REGENERATE = ".venv/bin/titanlite help --markdown > docs/configuration.md"


def test_configuration_reference_is_generated_from_the_code():
    on_disk = (REPO / "docs" / "configuration.md").read_text()
    assert on_disk == reference_markdown() + "\n", (
        f"docs/configuration.md differs from titanlite/config/sections.py; regenerate it: {REGENERATE}"
    )


def test_configuration_reference_lists_every_key():
    reference = reference_markdown()
    for section, value in vars(JobConfig()).items():
        for name in vars(value):
            assert f"| `{section}.{name}` |" in reference, f"{section}.{name} is missing from the generated reference"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # no headings inside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_relative_links_reach_files_and_headings():
    pages = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


# A file:line of our own code, or "line 12": true on the day it is written, wrong after the next edit above it.
OWN_FILE_LINE = re.compile(r"((?:titanlite|tests|scripts)/[\w/.-]*\.py|\b[\w-]+\.py):(\d+)")
LINE_NUMBER = re.compile(r"\blines? \d+\b")


def test_docs_quote_no_line_numbers_of_the_code():
    found = []
    for page in [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), start=1):
            for match in OWN_FILE_LINE.finditer(line):
                path = match.group(1)
                ours = "/" in path or any(REPO.glob(f"titanlite/**/{path}")) or any(REPO.glob(f"tests/**/{path}"))
                if ours and not line[: match.start()].endswith("/"):  # not a path inside torch or another package
                    found.append(f"{page.name}:{n}: {match.group(0)}")
            found += [f"{page.name}:{n}: {m.group(0)}" for m in LINE_NUMBER.finditer(line)]
    assert not found, "name the function instead of a line number (write `...` where output shows one):\n" + "\n".join(
        found
    )


def quoted_spans(text: str, needle: str) -> list[str]:
    """Every `code` span of a page that contains `needle`, its line breaks and indents made single spaces."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    spans = [span for paragraph in re.split(r"\n\s*\n", prose) for span in re.findall(r"`([^`]+)`", paragraph)]
    return [" ".join(span.split()) for span in spans if needle in span]


def matches(quote: str, printed: str) -> bool:
    """Whether a quoted line is the printed one, `...` standing for text the docs left out."""
    return re.fullmatch(".*?".join(re.escape(part) for part in quote.split("...")), printed) is not None


def test_the_preemption_lines_the_docs_quote_are_the_ones_printed(capsys, caplog, monkeypatch):
    printed = []
    for saved in (True, False):
        record(Preempted(signal.SIGTERM, 12, saved), rank=0, run_dir=None)  # what the worker prints last
        printed.append(capsys.readouterr().err.strip())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        caplog.set_level(logging.INFO, logger="titanlite")
        for saves in (True, False):
            StopOnSignal(torch.device("cpu"), saves=saves).handle(signal.SIGTERM, None)
        exits: list[int] = []
        monkeypatch.setattr(os, "_exit", exits.append)
        stop = StopOnSignal(torch.device("cpu"))
        stop.handle(signal.SIGTERM, None)
        stop.first_at -= 10.0  # a second signal, not the launcher's echo of the first
        stop.handle(signal.SIGTERM, None)
        assert exits == [128 + signal.SIGTERM]
        printed += [r.getMessage() for r in caplog.records]  # what every rank prints when the signal arrives
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    quotes = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        quotes += [(page.name, q) for q in quoted_spans(page.read_text(), "SIGTERM") if q.startswith("titanlite:")]
    assert len(quotes) >= 4, quotes
    wrong = [f"{name}: {quote}" for name, quote in quotes if not any(matches(quote, line) for line in printed)]
    assert not wrong, "quoted, but not what runs print:\n" + "\n".join(wrong) + "\nprinted:\n" + "\n".join(printed)


def untested_train_commands(page: Path) -> list[tuple[dict[str, str], list[str]]]:
    """Each `./run_train.sh` command of the page's plain ```bash blocks (the ones no test runs: GPUs, several
    nodes) as (its environment assignments, its arguments), continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "./run_train.sh" in words:
                at = words.index("./run_train.sh")
                commands.append((dict(w.split("=", 1) for w in words[:at]), words[at + 1 :]))
    return commands


def test_the_readmes_gpu_commands_pass_check_at_their_world_size(monkeypatch, tmp_path, capsys):
    """The README's commands for GPU nodes (not run by the tests: no GPU here) are what `check` accepts at the
    world size they name, NGPU x NNODES, on nodes of 8 H100 80GB (the README's machines)."""
    monkeypatch.setattr(devices, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    h100 = Capacity(80 * GIB, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(preflight, "memory_capacity", lambda pool, n: h100 if pool == "cuda" else Capacity(2e12, "RAM"))
    commands = untested_train_commands(REPO / "README.md")
    assert len(commands) >= 2 and any("NNODES" in env for env, _ in commands), commands
    for env, args in commands:
        ngpu, nnodes = int(env.get("NGPU", "8")), int(env.get("NNODES", "1"))
        world = ["--world-size", str(ngpu * nnodes), "--nproc-per-node", str(ngpu)]
        code = cli.main(["check", *world, *args, "--job.dump_folder", str(tmp_path)])
        out, err = capsys.readouterr()
        assert code == 0, f"README: {env} ./run_train.sh {' '.join(args)}: {err}"
        assert f"config ok for {ngpu * nnodes} process(es)" in out + err


def test_no_page_shows_a_command_as_bare_titanlite():
    """A fresh clone has no `titanlite` on the PATH (it lives in .venv/bin): a command shown as `titanlite plan ...`
    fails as written. Output lines (`titanlite plan: ...`) are fine."""
    bare = re.compile(r"^\s*(\$ )?titanlite [a-z-]+(\s|$)")
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced and bare.match(line):
                found.append(f"{page.relative_to(REPO)}:{number}: {line.strip()[:60]}")
    assert not found, "write .venv/bin/titanlite in commands: " + "; ".join(found)
