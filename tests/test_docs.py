"""The README stays a front page (short, every link alive); the manual lives in docs/."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _broken_links(doc: Path) -> list[str]:
    out = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            out.append(target)
    return out


def test_the_readme_is_short_and_every_link_in_the_docs_resolves():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = {d.name: links for d in docs if (links := _broken_links(d))}
    assert not broken, broken


def test_the_link_check_sees_a_dead_link(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("[alive](x.md) [dead](docs/nowhere.md) [web](https://example.org)")
    assert _broken_links(doc) == ["docs/nowhere.md"]
