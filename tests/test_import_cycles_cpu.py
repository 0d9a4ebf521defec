"""No import cycle among tpcomm's Python modules, read statically from their
import statements: none among those that run when a module is imported (at
module level, in a class body or an if/try there), and none either when the
imports inside functions, which run when they are called, count too (the
compile backend's lazy import of the inductor pass, which imported the
backend's module back, was such a cycle)."""
import ast
import os
import re

import tpcomm

import source_tree

PACKAGE = os.path.dirname(os.path.abspath(tpcomm.__file__))


def _extensions():
    """The compiled modules setup.py builds (tpcomm._C, tpcomm._fastpath),
    where this is a checkout: named here whether or not they are built."""
    path = os.path.join(source_tree.ROOT, "setup.py")
    if not os.path.exists(path):
        return set()
    return set(re.findall(r'(?:name=|Extension\()"(tpcomm\.\w+)"', open(path).read()))


def _modules():
    """{dotted name: source path, or None for a compiled extension} of every
    module of the package."""
    found = dict.fromkeys(_extensions())
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            stem, _, ext = name.partition(".")
            if ext in ("py", "so") or ext.endswith(".so") or ext.endswith(".pyd"):
                parts = os.path.relpath(os.path.join(folder, stem), PACKAGE).split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(["tpcomm"] + parts)] = os.path.join(folder, name) if ext == "py" else None
    return found


def _import_time_nodes(body):
    """The import statements of `body` that run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _import_time_nodes(getattr(node, field, []))


def _every_node(body):
    """Every import statement of `body`, inside functions too."""
    return (node for top in body for node in ast.walk(top) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _imports(name, path, modules, statements):
    """The package's modules that module `name` imports in `statements`
    (_import_time_nodes or _every_node)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in statements(ast.parse(open(path).read()).body):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
            continue
        base = package
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
        for alias in node.names:  # `from a import b`: b is a module of a, or a name a defines
            target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            if target in modules and target != name:
                out.add(target)
    return out


def _cycle(graph):
    """One cycle of the graph as a list of names (its first repeated last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _graph(statements):
    modules = _modules()
    return {name: _imports(name, path, modules, statements) if path else set() for name, path in modules.items()}


def test_no_import_cycle_between_modules():
    graph = _graph(_import_time_nodes)
    assert "tpcomm.graph_pass" in graph["tpcomm.inductor_pass"]  # the reading sees relative imports
    assert "tpcomm.inductor_pass" not in graph["tpcomm.compile_pass"]  # a lazy import is not read here
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_import_cycle_counting_imports_inside_functions():
    graph = _graph(_every_node)
    assert "tpcomm.inductor_pass" in graph["tpcomm.compile_pass"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
