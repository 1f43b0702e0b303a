"""Plain text out of the sources lab/fetch_data.py downloads: reStructuredText, handbook HTML,
fortune files, Gutenberg plays, the Jargon File and WordNet's dictd file. Each function is pure
(bytes or str in, text out), so the extraction is deterministic.
"""

from __future__ import annotations

import gzip
import re
from html.parser import HTMLParser

# Jargon File: the lexicon entries whose name starts with these letters are held out; every other
# entry, chapters 1-9 (essays on hacker slang and style) and appendices A-B (folklore) are train.
HELDOUT_JARGON_LETTERS = "mn"
# WordNet: its glosses, each once (synonyms share one), in file order; every WORDNET_EVERY-th headword
# is train, every fourth of the headwords half-way between those held-out (a sample: the whole is 30 MB).
WORDNET_EVERY = 24


_ROLE = re.compile(r":[a-zA-Z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_UNDERLINE = re.compile(r"^([=\-~*^#\"'+])\1{3,}\s*$")


def rst_to_text(src: str) -> str:
    """Strip reStructuredText markup from a docs page so that it reads as plain prose and code."""
    lines, out, skip_indent = src.splitlines(), [], None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            # Directive options (`:maxdepth: 2`) and bodies of index/toctree directives are dropped.
            if stripped == "" or indent > skip_indent:
                continue
            skip_indent = None
        if stripped.startswith(".. "):
            keep_body = re.match(r"\.\. (code-block|doctest|testcode|note|warning|seealso|"
                                 r"versionadded|versionchanged|sourcecode)::", stripped)
            if not keep_body:
                skip_indent = indent
            continue
        if _UNDERLINE.match(line) or re.match(r"^:[A-Za-z ]+:", stripped):
            continue
        line = _ROLE.sub(lambda m: m.group(1).split(".")[-1] if m.group(0).find("~") >= 0
                         else m.group(1), line)
        line = line.replace("``", "").replace("::", ":")
        out.append(line.rstrip())
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


class _HtmlText(HTMLParser):
    """The readable blocks of one handbook page: headings, paragraphs, list items, table rows (cells
    joined by " | ") and <pre> blocks, each a block of its own; navigation, banner, tables of contents, index anchors,
    images and <head> are dropped. Publican's XHTML closes every element, so a stack tracks them."""

    BLOCK = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "pre", "table",
             "ul", "ol", "dl", "blockquote"}
    VOID = {"br", "img", "meta", "link", "hr", "input", "col", "area", "base", "wbr"}
    SKIP_CLASS = {"docnav", "toc", "mediaobject", "indexterm"}

    def __init__(self):
        super().__init__(convert_charrefs=True)  # entities decoded in handle_data
        self.stack: list[tuple[str, bool]] = []  # (tag, inside a dropped subtree)
        self.blocks: list[str] = []
        self.buf: list[str] = []
        self.bullet = ""  # "- " until the first block of a list item is written
        self.pre = 0
        self.cells = 0  # cells seen in the current table row

    def _dropped(self, tag: str, attrs: list) -> bool:
        a = dict(attrs)
        return (tag in {"head", "script", "style", "noscript"} or a.get("id") in {"banner", "title"}
                or bool(self.SKIP_CLASS & set((a.get("class") or "").split())))

    def flush(self) -> None:
        raw, self.buf = "".join(self.buf), []
        if self.pre:  # code and terminal sessions keep their lines and indentation
            text = "\n".join(ln.rstrip() for ln in raw.split("\n")).strip("\n")
        else:
            text = " ".join(raw.split())
        if text:
            self.blocks.append(self.bullet + text)
            self.bullet = ""

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        dropped = (bool(self.stack) and self.stack[-1][1]) or self._dropped(tag, attrs)
        self.stack.append((tag, dropped))
        if dropped:
            return
        if tag in self.BLOCK:
            self.flush()
        if tag == "li":
            self.bullet = "- "
        elif tag == "pre":
            self.pre += 1
        elif tag == "tr":
            self.cells = 0
        elif tag in {"td", "th"}:
            if self.cells:
                self.buf.append(" | ")
            self.cells += 1

    def handle_startendtag(self, tag, attrs):
        pass  # <a id="..."/>, <img/>, <br/>: no text

    def handle_endtag(self, tag):
        if all(t != tag for t, _ in self.stack):
            return
        while self.stack:
            t, dropped = self.stack.pop()
            if not dropped and t in self.BLOCK:
                self.flush()
                if t == "pre":
                    self.pre -= 1
            if t == tag:
                break

    def handle_data(self, data):
        if not (self.stack and self.stack[-1][1]):
            self.buf.append(data)


def html_to_text(src: str) -> str:
    """Plain text of one handbook page: its blocks separated by blank lines."""
    parser = _HtmlText()
    parser.feed(src)
    parser.close()
    parser.flush()
    return "\n\n".join(parser.blocks) + "\n"


def fortune_entries(raw: bytes) -> list[str]:
    """The quotations of one `%`-separated fortune file, trailing whitespace stripped."""
    out: list[str] = []
    for ch in raw.decode("utf-8"):
        if ch == "\b":  # overstrike (underline, bold): the character after it is the one shown
            if out:
                out.pop()
        elif ch != "\a":
            out.append(ch)
    entries = re.split(r"^%$", "".join(out), flags=re.MULTILINE)
    lines = ("\n".join(ln.rstrip() for ln in e.split("\n")).strip("\n") for e in entries)
    return [e for e in lines if e.strip()]


def _plain(block: str) -> str:
    """Dedent a Jargon File block and drop its cross-reference braces ({frob} -> frob)."""
    lines = [ln[3:] if ln.startswith("   ") else ln.lstrip() for ln in block.split("\n")]
    return re.sub(r"[{}]", "", "\n".join(ln.rstrip() for ln in lines)).strip("\n")


def jargon_text(raw: bytes) -> tuple[str, str]:
    """(train, held-out) text of the Jargon File's plain-text edition: see HELDOUT_JARGON_LETTERS."""
    text = raw.decode("utf-8").replace("\r\n", "\n").replace("\u00a0", " ")  # headings use no-break spaces
    starts = [m.start() for m in re.finditer(r"^Chapter 1\. ", text, flags=re.MULTILINE)]
    essays = text[starts[-1]: text.index("\nChapter 10. ", starts[-1])]  # the last match: past the TOC
    lexicon = text[text.index("\n   :"): text.index("\nAppendix A. ")]
    folklore = text[text.index("\nAppendix A. "): text.index("\nAppendix C. ")]
    train, heldout = [_plain(essays), _plain(folklore)], []
    for entry in re.split(r"\n(?=   :)", lexicon):
        name = entry.strip().lstrip(":").lower()
        if name:
            (heldout if name[0] in HELDOUT_JARGON_LETTERS else train).append(_plain(entry))
    tidy = lambda parts: re.sub(r"\n{3,}", "\n\n", "\n\n".join(parts)).strip() + "\n"  # noqa: E731
    return tidy(train), tidy(heldout)


def wordnet_text(raw: bytes) -> tuple[str, str]:
    """(train, held-out) lines "headword: gloss; \"example\"" from WordNet's dictd file (gzip-compatible
    dictzip); synonym lists dropped, each gloss kept once; see WORDNET_EVERY."""
    text = gzip.decompress(raw).decode("utf-8")
    seen: set[str] = set()
    out: tuple[list[str], list[str]] = ([], [])
    for i, m in enumerate(re.finditer(r"^(\S[^\n]*)\n((?:[ \t][^\n]*\n?)+)", text, flags=re.MULTILINE)):
        head, body = m[1].strip(), m[2]
        side = 0 if i % WORDNET_EVERY == 0 else 1 if i % (4 * WORDNET_EVERY) == WORDNET_EVERY // 2 else None
        if side is None or head.startswith("00-database"):
            continue
        body = re.sub(r"\[(syn|ant|also|see also):[^\]]*\]", "", " ".join(body.split()))
        for sense in re.split(r"\s*(?:\b(?:n|v|adj|adv)\s+)?\b\d+:\s*", body):
            sense = sense.strip(" ;")
            if len(sense) > 3 and sense not in seen:
                seen.add(sense)
                out[side].append(f"{head}: {sense}")
    return "\n".join(out[0]) + "\n", "\n".join(out[1]) + "\n"


def play_text(raw: bytes) -> str:
    text = raw.decode("latin-1").replace("\r\n", "\n")
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
