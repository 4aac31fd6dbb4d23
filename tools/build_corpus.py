"""Rebuild unifusion/data/python_docs_prose.txt, the demo's bundled English corpus.

Source: the reStructuredText sources of the Python 3.11 documentation (tutorial, HOWTOs, FAQ) from Debian's
``python3.11-doc`` package (PSF licence, see unifusion/data/LICENSE-python-docs.txt). Only prose paragraphs are kept:
code blocks, directives, tables and headings are dropped and inline markup is reduced to its text.

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb pd
    python tools/build_corpus.py pd/usr/share/doc/python3.11/html/_sources unifusion/data/python_docs_prose.txt
"""

from __future__ import annotations

import pathlib
import re
import sys

ROLE = re.compile(r":[a-z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
LITERAL = re.compile(r"``([^`]*)``")
LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`_+")
EMPH = re.compile(r"\*\*?([^*]+)\*\*?")
REF = re.compile(r"`([^`]+)`_*")


def prose_paragraphs(text: str) -> list[str]:
    out: list[str] = []
    in_block = False
    block_indent = 0
    para: list[str] = []
    lines = text.splitlines()

    def flush() -> None:
        if para:
            p = " ".join(s.strip() for s in para)
            para.clear()
            if len(p) > 120 and not p.startswith(("..", ">>>", "|", "+", "=", "*", "-", "#")):
                p = ROLE.sub(r"\1", p)
                p = LINK.sub(r"\1", p)
                p = LITERAL.sub(r"\1", p)
                p = EMPH.sub(r"\1", p)
                p = REF.sub(r"\1", p)
                if p.endswith("::"):
                    p = p[:-1]
                if "`" not in p and "|" not in p:
                    out.append(p)

    for i, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if in_block:
            if stripped and indent <= block_indent:
                in_block = False
            else:
                continue
        if not stripped:
            flush()
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if set(nxt.strip()) <= set("=-~^*#\"'") and nxt.strip() and len(nxt.strip()) >= len(stripped) - 1:
            flush()  # heading
            continue
        if set(stripped) <= set("=-~^*#\"'"):
            continue
        if stripped.startswith(".."):
            flush()
            in_block, block_indent = True, indent
            continue
        if indent > 0 and not para:
            continue  # indented material (quotes, definitions, code) is skipped
        para.append(line)
        if stripped.endswith("::"):
            flush()
            in_block, block_indent = True, indent
    flush()
    return out


def main(src: str, dst: str, limit: int = 1_500_000) -> None:
    root = pathlib.Path(src)
    files = sorted((root / "tutorial").glob("*.rst.txt")) + sorted((root / "howto").glob("*.rst.txt")) + \
        sorted((root / "faq").glob("*.rst.txt"))
    paragraphs: list[str] = []
    for f in files:
        paragraphs += prose_paragraphs(f.read_text(encoding="utf-8"))
    text, size = [], 0
    for p in paragraphs:
        size += len(p.encode()) + 1
        if size > limit:
            break
        text.append(p)
    pathlib.Path(dst).write_text("\n".join(text) + "\n", encoding="utf-8")
    print(f"{len(text)} paragraphs, {size} bytes from {len(files)} files")


if __name__ == "__main__":
    main(*sys.argv[1:3])
