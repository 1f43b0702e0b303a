"""The documentation holds together: every relative link in README.md, docs/*.md and lab/*.md
points at a file that exists and, for a #anchor, at a heading of that file (GitHub's anchors); the
README stays a ten-minute read for users, without the lab's history."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("lab/*.md")])
README_MAX_LINES = 450
# History belongs in lab/LOG.md; these phrases mark it (the repository's before-stop hook warns on them too).
HISTORY = ("not adopted", "before this stop", "this session", "measured today")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not checked here


def test_there_are_pages_and_they_link_somewhere():
    assert REPO / "README.md" in PAGES and len(PAGES) >= 5
    assert sum(len(links(p)) for p in PAGES) > 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading '{anchor}' in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_anchors_follow_github():
    page = REPO / "docs" / "demo-model.md"
    assert "make-demos-report" in anchors(page)  # "`make demo`'s report"


def test_readme_is_short_and_holds_no_history():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    found = [h for h in HISTORY if h in text.lower()]
    assert not found, f"README.md reads as history ({', '.join(found)}): that belongs in lab/LOG.md"
