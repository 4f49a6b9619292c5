"""The benchmark pages as written: prose wrapped at the docs' line width, so a generated page reads like the written
ones; table rows and code blocks are left as they are (a Markdown table row cannot wrap)."""
import re
import textwrap

WIDTH = 120
_LIST = re.compile(r"^(\s*)([-*]|\d+\.) ")


def wrap_prose(doc: str) -> str:
    out, fence = [], False
    for line in doc.split("\n"):
        fence ^= line.startswith("```")
        if fence or line.startswith(("|", "#", "<", "!", "```")) or len(line) <= WIDTH:
            out.append(line)
            continue
        m = _LIST.match(line)
        indent = line[:len(line) - len(line.lstrip())]
        more = " " * len(m.group(0)) if m else indent
        out += textwrap.wrap(line.strip(), WIDTH, initial_indent=indent, subsequent_indent=more,
                             break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def write_page(path: str, doc: str) -> None:
    with open(path, "w") as f:
        f.write(wrap_prose(doc))


def section_marks(name: str, shape: str):
    """A script's section markers on its shape's page; on the shared topology page, one section per shape."""
    tag = f"{name}:{shape}" if shape.endswith("-topology") else name
    return f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"


def section_heading(title: str, shape: str) -> str:
    return f"## {title}: {shape}" if shape.endswith("-topology") else f"## {title}"
