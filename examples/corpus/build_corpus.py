#!/usr/bin/env python
"""Rebuild python_docs.jsonl from Debian's python3.11-doc package (reStructuredText sources).

    apt-get install -y python3.11-doc
    python examples/corpus/build_corpus.py

Each section (a heading and the text up to the next heading) of the tutorial, HOWTOs, FAQ,
language reference, "using" and "extending" guides becomes one JSON line
{"text": ..., "source": "<file>#<n>"}, in sorted file order.
"""
import json
import os
import re
import sys

SOURCES = "/usr/share/doc/python3.11/html/_sources"
PARTS = ["tutorial", "howto", "faq", "reference", "using", "extending"]
_UNDERLINE = re.compile(r"^([=\-~^*#+\"'`])\1{2,}\s*$")


def sections(text):
    lines = text.split("\n")
    starts = [0]
    for i in range(1, len(lines)):
        if _UNDERLINE.match(lines[i]) and lines[i - 1].strip() and len(lines[i].rstrip()) >= len(lines[i - 1].rstrip()):
            start = i - 1
            if start > 0 and _UNDERLINE.match(lines[start - 1]):  # overline + title + underline
                start -= 1
            if start > starts[-1]:
                starts.append(start)
    starts.append(len(lines))
    for a, b in zip(starts[:-1], starts[1:]):
        chunk = "\n".join(lines[a:b]).strip("\n")
        if len(chunk.split()) >= 20:
            yield chunk + "\n"


def main(out_path):
    n = 0
    with open(out_path, "w", encoding="utf-8") as out:
        for part in PARTS:
            root = os.path.join(SOURCES, part)
            for dirpath, _, files in sorted(os.walk(root)):
                for name in sorted(files):
                    if not name.endswith(".rst.txt"):
                        continue
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, SOURCES)[: -len(".txt")]
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                    for k, sec in enumerate(sections(text)):
                        out.write(json.dumps({"text": sec, "source": f"{rel}#{k}"}, ensure_ascii=False) + "\n")
                        n += 1
    print(f"wrote {n} documents to {out_path}", file=sys.stderr)


if __name__ == "__main__":
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_docs.jsonl")
    main(sys.argv[1] if len(sys.argv) > 1 else default)
