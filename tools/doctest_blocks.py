"""A Markdown extension for the API reference: doctest examples in docstrings (``>>>`` lines and their output,
up to a blank line) render as Python code blocks, not as quoted paragraphs (where a list in the output reads as
a link reference). Loaded by mkdocs.yml (tools/ is on the path while tools/api_reference.py builds)."""
from __future__ import annotations

from markdown import Extension
from markdown.preprocessors import Preprocessor


class _Doctests(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        i, fenced = 0, False
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                fenced = not fenced
            if fenced or not line.lstrip().startswith(">>>"):
                out.append(line)
                i += 1
                continue
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
                i += 1
            out += ["", f"{indent}```python", *[indent + b for b in block], f"{indent}```", ""]
        return out


class DoctestBlocks(Extension):
    """Registers the preprocessor (before Markdown sees the text)."""

    def extendMarkdown(self, md) -> None:  # noqa: N802 -- Markdown's API
        md.preprocessors.register(_Doctests(md), "forgelab_doctests", 30)


def makeExtension(**kwargs) -> DoctestBlocks:  # noqa: N802 -- Markdown's entry point
    return DoctestBlocks(**kwargs)
