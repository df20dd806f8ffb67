"""The package's shape: no import cycles, no module reaching for another's
private names (only `vattn.binding` reaches the C core, `vattn._native`), and
no module past 350 lines outside the benchmarks."""
import ast
from pathlib import Path

import vattn

ROOT = Path(vattn.__file__).parent
MAX_LINES = 350
BINDING = "vattn.binding"  # the one module that calls the C core


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) of every import in the tree, those under `if TYPE_CHECKING:` left out."""
    found = []

    def visit(node):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {target for target, _ in _imports(ast.parse(path.read_text())) if target in modules}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_import_walk_sees_function_level_imports_and_skips_type_checking():
    tree = ast.parse("import a.b\nfrom c.d import e\ndef f():\n    from g import h\n"
                     "if TYPE_CHECKING:\n    import x\nelse:\n    import y\n")
    assert [m for m, _ in _imports(tree)] == ["a.b", "c.d", "g", "y"]


def test_no_import_cycle():
    assert _cycle(_graph()) is None


def test_no_module_imports_private_names():
    modules = _modules()
    for name, path in modules.items():
        for target, names in _imports(ast.parse(path.read_text())):
            if not target.startswith("vattn"):
                continue
            private = [n for n in [target.rsplit(".", 1)[-1], *names] if n.startswith("_") and n != "__version__"]
            if name == BINDING and (target, names) in (("vattn._native", []), ("vattn", ["_native"])):
                continue
            assert not private, f"{name} imports {', '.join(private)} from {target}"


def test_no_module_past_the_line_limit_outside_the_benchmarks():
    long = {name: n for name, path in _modules().items()
            if not name.startswith("vattn.bench") and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
