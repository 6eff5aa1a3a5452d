"""The documentation: the README's quick start is ``examples/quickstart.py`` as it is (``make demo`` runs the file), and
every relative link of the README, ``docs/`` and ``benchmarks/`` resolves."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "benchmarks" / "results").rglob("*.md"))]


def test_the_readmes_quick_start_is_examples_quickstart():
    section = (ROOT / "README.md").read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```python\n", 1)[1].split("\n```\n", 1)[0]
    assert block + "\n" == (ROOT / "examples" / "quickstart.py").read_text(), \
        "the README's quick start differs from examples/quickstart.py: paste the file into the README"


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links are not looked for in code blocks
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor of the page itself
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)
