"""The documentation cannot drift from the code: docs/configuration.md is exactly what `titanlite help
--markdown` prints from titanlite/config/sections.py, and every relative link in README.md and docs/ reaches an
existing file and heading."""

import re
from pathlib import Path

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
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
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
