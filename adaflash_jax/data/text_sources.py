"""Readers for the offline documentation every Debian-like machine carries.

Man pages (gzipped roff), Vim help, GNU Info manuals and fortune files are turned into
clean prose passages. Each reader yields `(group_key, Passage)`, the group being one
document unit (a man page, a help section, an Info node, one fortune), so the split rule
keeps a document's passages together. Readers of missing directories yield nothing.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import os
import re
from collections.abc import Iterator

from .records import stable_order


@dataclasses.dataclass(frozen=True)
class Passage:
    """A paragraph (or a one-line summary, `kind="summary"`) and where it was read."""

    text: str
    where: str  # human wording, e.g. "the ls(1) manual page"
    source: str  # stable id, e.g. "man:ls(1)"
    kind: str = "paragraph"  # "paragraph" | "summary" | "quote"
    topic: str = ""


_BOILERPLATE = re.compile(
    r"copyright|licen[cs]e|warranty|free software foundation|report bugs|bug reports|"
    r"this (manual )?page (was|is) |written by|permission is granted|all rights reserved"
)  # matched against lower-cased text: much faster than re.IGNORECASE
_NOT_A_LETTER = re.compile(r"[^\w\s]|[\d_]")


def clean_paragraph(text: str, *, min_words: int = 20, max_words: int = 220, sentence: bool = True) -> str | None:
    """Whitespace-collapsed text, or None for boilerplate, odd lengths and mostly non-letters.

    With `sentence`, the text must also end like a sentence: a paragraph that stops
    mid-sentence introduced an example that was cut out.
    """
    text = re.sub(r"\s+", " ", text).strip()
    words = text.split()
    if not min_words <= len(words) <= max_words or _BOILERPLATE.search(text.lower()):
        return None
    if sentence and not text.endswith((".", "!", "?", ")", '"', "\u201d", "'", "\u2019")):
        return None
    return text if len(_NOT_A_LETTER.findall(text)) <= 0.2 * len(text) else None


def _readable_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except (OSError, EOFError):
        return ""


def _hashed_groups(groups: dict[str, list[Passage]], seed: int, cap: int) -> Iterator[tuple[str, Passage]]:
    for key in stable_order(groups, seed):
        for passage in groups[key][:cap]:
            yield key, passage


# ----- man pages ---------------------------------------------------------------------

_GLYPHS = {
    "em": "\u2014", "en": "\u2013", "aq": "'", "dq": '"', "lq": "\u201c", "rq": "\u201d", "oq": "\u2018",
    "cq": "\u2019", "bu": "\u2022", "co": "\u00a9", "rg": "\u00ae", "tm": "\u2122", "mu": "\u00d7",
    "de": "\u00b0", "hy": "-", "ga": "`", "ha": "^", "ti": "~", "ba": "|", "Fo": "\u00ab", "Fc": "\u00bb",
    "R": "\u00ae", "lh": "", "rh": "", "ua": "\u2191", "da": "\u2193", "<=": "\u2264", ">=": "\u2265",
}
_LITERAL_BACKSLASH = "\x00"  # what `\e` prints, kept out of reach of the later patterns
_ROFF_ESCAPES = (
    (re.compile(r'\\".*$', re.MULTILINE), ""),
    (re.compile(r"\\[fF](\[[^\]]*\]|\(..|.)"), ""),
    (re.compile(r"\\s[+-]?\d+"), ""),
    (re.compile(r"\\[nkgm](\[[^\]]*\]|\(..|.)"), ""),
    (re.compile(r"\\[hvwlLoXZbDNR]'[^']*'"), ""),
    (re.compile(r"\\\*?\((..)"), lambda m: _GLYPHS.get(m.group(1), "")),
    (re.compile(r"\\\*?\[([^\]]*)\]"), lambda m: _GLYPHS.get(m.group(1), "")),
    (re.compile(r"\\\*."), ""),
    (re.compile(r"\\-"), "-"),
    (re.compile(r"\\e"), _LITERAL_BACKSLASH),
    (re.compile(r"\\[ ~0t]"), " "),
    (re.compile(r"\\[&)^|,/%c:!{}]"), ""),
    (re.compile(r"\\."), ""),  # any escape not understood above
)
_PARAGRAPH_MACROS = {"PP", "LP", "P", "TP", "IP", "HP", "sp", "Pp", "Lp", "It", "Bl", "El", "SS", "Ss",
                     "TQ", "RS", "RE", "br", "in", "Dl", "D1"}
_NO_FILL_START = {"nf", "EX", "TS", "EQ", "PS", "Bd", "de", "ig"}
_NO_FILL_END = {"fi", "EE", "TE", "EN", "PE", "Ed", ".."}
_FONT_MACROS = {"B", "I", "R", "SM", "SB", "Em", "Sy", "Li", "Ar", "Pa", "Cm", "Ic", "Ev", "Dv",
                "Er", "Va", "Nm", "Nd", "Fn", "Fa", "Ft", "Dq", "Sq", "Ql", "Pq", "Op", "Ux", "At"}
_ALTERNATING_FONT_MACROS = {"BR", "BI", "IB", "RB", "RI", "IR"}
_MACRO_ARGUMENT = re.compile(r'"([^"]*)"|(\S+)')  # roff quoting, escapes left for roff_to_text


def roff_to_text(line: str) -> str:
    """Remove roff escapes from one line of text."""
    for pattern, replacement in _ROFF_ESCAPES:
        line = pattern.sub(replacement, line)
    return line.replace(_LITERAL_BACKSLASH, "\\")


def _macro_text(macro: str, arguments: list[str]) -> str | None:
    if macro in _ALTERNATING_FONT_MACROS:
        return "".join(arguments)
    if macro == "Fl":
        return " ".join("-" + arg for arg in arguments)
    if macro == "Xr" and len(arguments) >= 2:
        return f"{arguments[0]}({arguments[1]})" + "".join(arguments[2:])
    if macro in _FONT_MACROS:
        return " ".join(arg for arg in arguments if arg not in _FONT_MACROS and arg not in ("Fl", "Ns"))
    return None


def man_page_sections(source: str) -> dict[str, list[str]]:
    """Section name -> paragraphs of running text; examples, tables and macros removed."""
    sections: dict[str, list[str]] = {}
    section, paragraph, no_fill = "", [], False

    def flush():
        if paragraph and section:
            sections.setdefault(section, []).append(roff_to_text(" ".join(paragraph)))
        paragraph.clear()

    for line in source.splitlines():
        if line.startswith((".", "'")):
            words = [quoted or bare for quoted, bare in _MACRO_ARGUMENT.findall(line[1:])]
            macro, arguments = (words[0], words[1:]) if words else ("", [])
            if macro in ("SH", "Sh"):
                flush()
                section = " ".join(arguments).upper()
            elif macro in _NO_FILL_START and (macro != "Bd" or "-filled" not in arguments):
                flush()
                no_fill = True
            elif macro in _NO_FILL_END:
                no_fill = False
            elif not no_fill and macro in _PARAGRAPH_MACROS:
                flush()
            elif not no_fill and (text := _macro_text(macro, arguments)) is not None:
                paragraph.append(text)
        elif not no_fill:
            if line.strip():
                paragraph.append(line)
            else:
                flush()
    flush()
    return sections


def man_page_files(root: str) -> list[str]:
    """Gzipped English pages in `root/man*/`; symlinked aliases are left out."""
    paths = glob.glob(os.path.join(root, "man[1-9]*", "*.gz"))
    return sorted(path for path in paths if not os.path.islink(path))


def man_passages(
    root: str, seed: int, per_page: int = 3, pages_per_family: int = 8
) -> Iterator[tuple[str, Passage]]:
    """Each page's NAME line and first DESCRIPTION paragraphs, pages in seeded order (lazily).

    A family (`git-*`, `gcloud_*`, `EVP_*`) gives at most `pages_per_family` pages, so one
    tool with thousands of generated pages cannot crowd out the rest.
    """
    family_pages: dict[str, int] = {}
    for path in stable_order(man_page_files(root), seed, key=os.path.basename):
        name, _, section = os.path.basename(path)[: -len(".gz")].rpartition(".")
        family = re.split(r"[_\-.]", name)[0]
        if family_pages.get(family, 0) >= pages_per_family:
            continue
        sections = man_page_sections(_readable_text(path))
        source, where = f"man:{name}({section})", f"the {name}({section}) manual page"
        name_line = re.sub(r"\s+", " ", " ".join(sections.get("NAME", []))).strip()
        summary = name_line.partition(" - ")[2].strip()
        passages = []
        if 2 <= len(summary.split()) <= 25:
            passages.append(Passage(summary, where, source, "summary", name))
        for text in sections.get("DESCRIPTION", []):
            if (cleaned := clean_paragraph(text)) and len(passages) < per_page:
                passages.append(Passage(cleaned, where, source, "paragraph", name))
        if passages:
            family_pages[family] = family_pages.get(family, 0) + 1
        for passage in passages:
            yield source, passage


# ----- Vim help ----------------------------------------------------------------------

def _vim_section_paragraphs(section: str) -> list[str]:
    paragraphs, current, in_example = [], [], False
    for line in section.splitlines() + [""]:
        if in_example:
            if line.startswith("<") or (line and not line[0].isspace()):
                in_example = False
                if line.startswith("<"):
                    continue
            else:
                continue
        if not line.strip():
            paragraphs.append(current)
            current = []
            continue
        if line.rstrip() == ">" or line.rstrip().endswith(" >"):
            in_example = True  # the example ends the paragraph; its intro stands alone
            paragraphs.append(current + [line.rstrip()[:-1]])
            current = []
            continue
        current.append(line)
    texts = []
    for lines in paragraphs:
        if not lines or any(line[:1].isspace() or "\t" in line.strip() for line in lines):
            continue  # indented blocks and aligned columns are tables or key listings
        text = re.sub(r"\*[^*\s]+\*", "", " ".join(lines))
        texts.append(re.sub(r"\|([^|\s]+)\|", r"\1", text))
    return texts


def vim_help_passages(doc_dir: str, seed: int, per_section: int = 3) -> Iterator[tuple[str, Passage]]:
    """Paragraphs of Vim's help files; a section between `====` rulers is one group."""
    groups: dict[str, list[Passage]] = {}
    for path in sorted(glob.glob(os.path.join(doc_dir, "*.txt"))):
        file_name = os.path.basename(path)
        sections = re.split(r"^[=-]{20,}\s*$", _readable_text(path), flags=re.MULTILINE)
        for index, section in enumerate(sections):
            passages = [
                Passage(cleaned, f"Vim's help file {file_name}", f"vim:{file_name}", topic=file_name)
                for text in _vim_section_paragraphs(section)
                if (cleaned := clean_paragraph(text))
            ]
            if passages:
                groups[f"vim:{file_name}#{index}"] = passages
    yield from _hashed_groups(groups, seed, per_section)


def default_vim_doc_dir() -> str:
    """The newest `/usr/share/vim/vim*/doc` directory (or the usual vim90 path when absent)."""
    candidates = sorted(glob.glob("/usr/share/vim/vim[0-9]*/doc"))
    return candidates[-1] if candidates else "/usr/share/vim/vim90/doc"


# ----- GNU Info ----------------------------------------------------------------------

_SKIPPED_INFO_NODES = re.compile(r"index|copying|license|licence|top$|\(dir\)", re.IGNORECASE)


def _info_node_paragraphs(body: str) -> list[str]:
    texts = []
    for block in re.split(r"\n\s*\n", body):
        lines = [line for line in block.splitlines() if line.strip()]
        if len(lines) < 2 and len(block) < 200:
            continue  # headings and one-liners
        if lines[0].lstrip().startswith("* ") or re.fullmatch(r"[*=\-.]+", lines[-1].strip()):
            continue  # menus and underlined titles
        if all(line.startswith("     ") for line in lines) or any(line.lstrip().startswith("-- ") for line in lines):
            continue  # example blocks and definition headers
        texts.append(" ".join(line.strip() for line in lines))
    return texts


def info_passages(info_dir: str, seed: int, per_node: int = 3) -> Iterator[tuple[str, Passage]]:
    """Paragraphs of Info manuals; one node is one group."""
    groups: dict[str, list[Passage]] = {}
    for path in sorted(glob.glob(os.path.join(info_dir, "*.info*"))):
        manual = os.path.basename(path).split(".info")[0]
        for chunk in _readable_text(path).split("\x1f"):
            header, _, body = chunk.strip("\n").partition("\n")
            node = re.search(r"Node:\s*([^,\n]+)", header)
            if not node or _SKIPPED_INFO_NODES.search(node.group(1).strip()):
                continue
            node_name = node.group(1).strip()
            where = f"the {manual} Info manual (node \u201c{node_name}\u201d)"
            passages = [
                Passage(cleaned, where, f"info:{manual}#{node_name}", topic=manual)
                for text in _info_node_paragraphs(body)
                if (cleaned := clean_paragraph(text))
            ]
            if passages:
                groups[f"info:{manual}#{node_name}"] = passages
    yield from _hashed_groups(groups, seed, per_node)


# ----- fortunes ----------------------------------------------------------------------

def fortune_passages(fortune_dir: str, seed: int) -> Iterator[tuple[str, Passage]]:
    """Quotations from fortune files (the `off/` subdirectory is never read)."""
    groups: dict[str, list[Passage]] = {}
    for path in sorted(glob.glob(os.path.join(fortune_dir, "*"))):
        name = os.path.basename(path)
        if not os.path.isfile(path) or "." in name:  # .dat indexes, .u8 copies
            continue
        for index, entry in enumerate(re.split(r"^%\s*$", _readable_text(path), flags=re.MULTILINE)):
            text = entry.strip()
            if text and clean_paragraph(text, min_words=6, max_words=120, sentence=False):
                groups[f"fortune:{name}#{index}"] = [
                    Passage(text, f"the fortune file '{name}'", f"fortune:{name}", "quote", name)
                ]
    yield from _hashed_groups(groups, seed, 1)
