"""The documented commands keep working: every ```bash tested block of README.md and docs/*.md runs as
written, on the CPU, each in its own `bash -e` (so every command in it must succeed), with its /tmp/ paths
moved into a fresh folder. Blocks are marked `tested` where they are cheap: the debug models, a few steps;
`tested slow` where another test already runs the same thing (they run with the slow tests, to keep the
default suite within its 7 minutes). Other blocks (GPUs, many nodes, corpora you bring) are documentation
only; tests elsewhere cover their code. Markdown renderers take the info string's first word, `bash`."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, env

pytestmark = pytest.mark.distributed  # several blocks launch torchrun

BLOCK = re.compile(r"^```bash tested( slow)?\n(.*?)^```", flags=re.S | re.M)
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def marked_blocks() -> list:
    blocks = []
    for page in PAGES:
        for match in BLOCK.finditer(page.read_text()):
            line = page.read_text()[: match.start()].count("\n") + 1
            block_id = f"{page.stem}:{line}"
            marks = [pytest.mark.slow] if match.group(1) else []
            blocks.append(pytest.param(page, line, match.group(2), id=block_id, marks=marks))
    return blocks


def test_the_docs_mark_blocks_to_test():
    blocks = marked_blocks()
    pages = {block.values[0].name for block in blocks}
    assert "README.md" in pages and len(blocks) >= 8, pages


@pytest.mark.parametrize("page,line,block", marked_blocks())
def test_documented_block_runs(tmp_path, page: Path, line: int, block: str):
    script = block.replace("/tmp/", f"{tmp_path}/")
    proc = subprocess.run(
        ["bash", "-e", "-c", script], cwd=REPO, env=env(), capture_output=True, text=True, timeout=600
    )
    where = f"{page.relative_to(REPO)}:{line}"
    assert proc.returncode == 0, (
        f"the block at {where} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
