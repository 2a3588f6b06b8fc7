"""Coding prompts derived from the Python standard library's own sources.

The stdlib is parsed with `ast`, never imported: importing arbitrary modules has side
effects (`antigravity` opens a browser, `this` prints) and depends on the platform,
while parsing is deterministic for a given Python version. Each documented public
function, class or method becomes one task, phrased with one of several templates.
A module is the split group: all tasks about `email.utils` land in the same split.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sysconfig
import tokenize
from collections.abc import Iterator

from .records import PromptRecord, stable_choice, stable_order

# Directories that hold tests, tools or vendored code rather than the documented library.
_SKIPPED_DIRS = frozenset({
    "__pycache__", "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "ensurepip",
    "pydoc_data", "site-packages", "dist-packages",
})
_MAX_TASKS_PER_MODULE = 32
_MAX_SIGNATURE_CHARS = 100

_FUNCTION_TEMPLATES = (
    "Write a Python function `{name}({signature})` that does the following: {summary}",
    "Implement `{name}({signature})` from scratch in pure Python, without importing `{module}`. "
    "Specification: {summary}",
    "Explain what `{qualified}` does and give a short example of calling it. "
    "Its documentation begins: \"{summary}\"",
    "Write pytest unit tests for `{qualified}` that cover normal use and edge cases. "
    "It is documented as: {summary}",
    "Add type hints and a complete docstring to a function `def {name}({signature}):` "
    "whose purpose is: {summary}",
    "What can go wrong when calling `{qualified}({signature})`? List the likely error cases "
    "and how to handle them. For reference: {summary}",
    "Write a short script that uses `{qualified}` to solve a realistic task, with comments. "
    "({summary})",
)
_METHOD_TEMPLATES = (
    "The method `{owner}.{name}({signature})` in Python's `{module}` module is documented as: "
    "{summary} Write a minimal version of the class that implements this method.",
    "Explain when you would call `{qualified}()` and show an example. Its docstring says: {summary}",
    "Write a method `{name}` with parameters `({signature})` for a class `{owner}` that does "
    "the following: {summary}",
    "Write pytest tests for the method `{qualified}`, documented as: {summary}",
    "How would you implement `{owner}.{name}` so that it does the following? {summary} "
    "Discuss the design, then write the code.",
)
_CLASS_TEMPLATES = (
    "Design a Python class `{name}` with this purpose: {summary} Include `__init__` and two "
    "useful methods, with docstrings.",
    "Explain the role of `{qualified}` in the standard library and when you would use it. "
    "Its documentation begins: \"{summary}\"",
    "Write a small program that demonstrates `{qualified}`. ({summary})",
)


@dataclasses.dataclass(frozen=True)
class DocumentedApi:
    """One documented public function, class or method found in a stdlib file."""

    module: str
    qualified: str  # module.Class.method
    name: str
    owner: str | None  # enclosing class of a method
    kind: str  # "function" | "class" | "method"
    signature: str
    summary: str


def stdlib_source_dir() -> str:
    """Where this interpreter's pure-Python standard library lives."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_module_files(root: str | None = None) -> list[tuple[str, str]]:
    """Sorted `(module_name, path)` for public stdlib modules that exist as `.py` sources."""
    root = root or stdlib_source_dir()
    modules = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(
            d for d in subdirs
            if d not in _SKIPPED_DIRS and not d.startswith(("_", ".", "test")) and d.isidentifier()
        )
        package = os.path.relpath(directory, root).replace(os.sep, ".")
        if package != "." and not os.path.isfile(os.path.join(directory, "__init__.py")):
            continue
        for file_name in sorted(files):
            stem = file_name[:-3]
            if not file_name.endswith(".py") or (stem.startswith("_") and stem != "__init__"):
                continue
            if stem.startswith("test") or not stem.isidentifier():
                continue
            parts = [] if package == "." else package.split(".")
            if stem != "__init__":
                parts.append(stem)
            if parts:
                modules.append((".".join(parts), os.path.join(directory, file_name)))
    return sorted(modules)


def first_sentence(docstring: str) -> str:
    """The docstring's first sentence (or its first paragraph, when it has no full stop)."""
    paragraph = re.split(r"\n\s*\n", docstring.strip(), maxsplit=1)[0]
    paragraph = re.sub(r"\s+", " ", paragraph).strip()
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match.group(1) if match else paragraph


def _usable_summary(summary: str) -> bool:
    words = summary.split()
    return 4 <= len(words) <= 60 and summary[0].isalpha() and ">>>" not in summary


def _signature(function: ast.FunctionDef | ast.AsyncFunctionDef, *, drop_first: bool) -> str:
    arguments = function.args
    if drop_first:
        arguments = ast.arguments(
            posonlyargs=arguments.posonlyargs[1:] if arguments.posonlyargs else [],
            args=arguments.args if arguments.posonlyargs else arguments.args[1:],
            vararg=arguments.vararg, kwonlyargs=arguments.kwonlyargs,
            kw_defaults=arguments.kw_defaults, kwarg=arguments.kwarg, defaults=arguments.defaults,
        )
        if len(arguments.defaults) > len(arguments.posonlyargs) + len(arguments.args):
            return "..."
    text = ast.unparse(arguments)
    return text if len(text) <= _MAX_SIGNATURE_CHARS else "..."


def documented_api(module: str, path: str) -> list[DocumentedApi]:
    """Public, documented top-level functions, classes and their methods in one file."""
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        return []
    function_types = (ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for node in tree.body:
        if not isinstance(node, (*function_types, ast.ClassDef)) or node.name.startswith("_"):
            continue
        docstring = ast.get_docstring(node)
        if isinstance(node, function_types):
            if docstring:
                found.append(DocumentedApi(module, f"{module}.{node.name}", node.name, None, "function",
                                           _signature(node, drop_first=False), first_sentence(docstring)))
            continue
        if docstring:
            found.append(DocumentedApi(module, f"{module}.{node.name}", node.name, None, "class", "",
                                       first_sentence(docstring)))
        for member in node.body:
            if not isinstance(member, function_types) or member.name.startswith("_"):
                continue
            member_doc = ast.get_docstring(member)
            if member_doc:
                is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in member.decorator_list)
                found.append(DocumentedApi(
                    module, f"{module}.{node.name}.{member.name}", member.name, node.name, "method",
                    _signature(member, drop_first=not is_static), first_sentence(member_doc)))
    return [api for api in found if _usable_summary(api.summary)]


def module_docstring(path: str) -> str | None:
    """A module's docstring, read with `tokenize` (far cheaper than parsing the whole file)."""
    try:
        with open(path, "rb") as handle:
            for token in tokenize.tokenize(handle.readline):
                if token.type in (tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                    continue
                if token.type == tokenize.STRING:
                    value = ast.literal_eval(token.string)
                    return value if isinstance(value, str) else None
                return None
    except (SyntaxError, ValueError, OSError, tokenize.TokenError):
        return None
    return None


def code_prompt(api: DocumentedApi, seed: int) -> str:
    """Render one API item with a template chosen by a stable hash of the item."""
    templates = {"function": _FUNCTION_TEMPLATES, "method": _METHOD_TEMPLATES, "class": _CLASS_TEMPLATES}
    template = stable_choice(templates[api.kind], seed, api.qualified)
    return template.format(**dataclasses.asdict(api))


def code_records(seed: int, root: str | None = None) -> Iterator[tuple[str, PromptRecord]]:
    """`(module, record)` pairs, modules in seeded order; one docstring summary is used once."""
    modules = stdlib_module_files(root)
    if not modules:
        raise FileNotFoundError(
            f"no Python standard-library sources under {root or stdlib_source_dir()}; "
            "the code domain is derived from them"
        )
    used_summaries: set[str] = set()
    for module, path in stable_order(modules, seed, key=lambda item: item[0]):
        apis = stable_order(documented_api(module, path), seed, key=lambda api: api.qualified)
        emitted = 0
        for api in apis:
            summary_key = api.summary.lower()
            if summary_key in used_summaries:  # e.g. posixpath.join vs ntpath.join
                continue
            used_summaries.add(summary_key)
            yield module, PromptRecord(code_prompt(api, seed), "code", api.qualified)
            emitted += 1
            if emitted >= _MAX_TASKS_PER_MODULE:
                break
