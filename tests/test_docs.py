"""The docs home links every page, and the links of the README and the docs home resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not links inside code blocks
    return [m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", text) if not m.startswith(("http", "#", "mailto:"))]


def test_readme_and_docs_home_links_resolve():
    for page in (ROOT / "README.md", DOCS / "index.md", DOCS / "benchmarks" / "index.md"):
        if not page.exists():
            continue
        broken = [link for link in _links(page) if not (page.parent / link).exists()]
        assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_docs_page_is_reachable_from_the_docs_home():
    seen: set[Path] = set()
    todo = [DOCS / "index.md"]
    while todo:
        page = todo.pop().resolve()
        if page in seen or not page.exists() or page.suffix != ".md":
            continue
        seen.add(page)
        for link in _links(page):
            target = page.parent / link
            todo.append(target / "index.md" if target.is_dir() else target)
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    missing = sorted(str(p.relative_to(DOCS.resolve())) for p in pages - seen)
    assert not missing, f"docs pages that no link from docs/index.md reaches (add them to docs/index.md): {missing}"
