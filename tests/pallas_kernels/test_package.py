"""`pallas_kernels` is a leaf package without import cycles.

Each module is imported in a fresh interpreter (a module already imported by the
test process could hide an import), and the package's own imports are read
statically, so a cycle hidden behind `if TYPE_CHECKING:` counts too.
"""

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "pallas_kernels")
MODULES = sorted(f"pallas_kernels.{name[:-3]}" for name in os.listdir(PACKAGE)
                 if name.endswith(".py") and name != "__init__.py")

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "adaflash_jax" or m.startswith("adaflash_jax."))))
"""


def test_every_module_imports_nothing_from_adaflash_jax():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    for name in ["pallas_kernels"] + MODULES:
        out = subprocess.run([sys.executable, "-c", PROBE, name], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "[]", (name, out.stdout)


def package_imports(path: str) -> set[str]:
    """The `pallas_kernels` modules a file imports, anywhere in it (TYPE_CHECKING blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pallas_kernels"):
            if node.module == "pallas_kernels":  # from pallas_kernels import x: x may be a module
                found.update(f"pallas_kernels.{a.name}" for a in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pallas_kernels."))
    return found & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> imported modules), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_inside_the_package():
    graph = {m: package_imports(os.path.join(PACKAGE, m.split(".")[1] + ".py")) for m in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("graph,cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
])
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_type_checking_imports_count(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from pallas_kernels.fused_verify import BlockSizes\n")
    assert package_imports(str(path)) == {"pallas_kernels.fused_verify"}


def test_public_entry_points_are_re_exported():
    import pallas_kernels

    for name in ("block_attention", "block_attention_train", "verify_attention", "verify_head"):
        assert callable(getattr(pallas_kernels, name)) and callable(getattr(pallas_kernels, name + "_reference"))
