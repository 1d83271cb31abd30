#!/usr/bin/env python3
"""Regenerates kjv.txt from Debian's bible-kjv package (the King James
Version, public domain): `apt-get install bible-kjv && python3 make_kjv.py`.

Keeps the books listed below, drops verse numbers, and writes each chapter as
one paragraph wrapped at 79 columns under a "Book N" heading. The output is
plain ASCII, so byte-level tokens are characters."""
import re
import subprocess
import textwrap

BOOKS = [("Genesis", "gen1:1-gen50:26"), ("Exodus", "exo1:1-exo40:38"),
         ("Matthew", "mat1:1-mat28:20"), ("Mark", "mar1:1-mar16:20"),
         ("Luke", "luk1:1-luk24:53"), ("John", "joh1:1-joh21:25")]


def book_text(spec):
    raw = subprocess.run(["bible", spec], check=True, capture_output=True, text=True).stdout
    chapters, heading, verses = [], None, []
    for line in raw.splitlines():
        if re.fullmatch(r"[1-3]?\s?[A-Za-z ]+ \d+", line.strip()) and not line.startswith(" "):
            if heading:
                chapters.append((heading, verses))
            heading, verses = line.strip(), []
        elif line.strip():
            verses.append(re.sub(r"^\s*\d+\s+", "", line) if re.match(r"^\s+\d+ ", line) else line.strip())
    if heading:
        chapters.append((heading, verses))
    out = []
    for heading, verses in chapters:
        body = " ".join(v.strip() for v in verses)
        out.append(heading + "\n\n" + "\n".join(textwrap.wrap(body, 79)) + "\n")
    return "\n".join(out)


def main():
    text = "\n".join(book_text(spec) for _, spec in BOOKS)
    text.encode("ascii")  # byte-level tokens: the corpus must be plain ASCII
    with open("kjv.txt", "w", encoding="ascii", newline="\n") as f:
        f.write(text)


if __name__ == "__main__":
    main()
