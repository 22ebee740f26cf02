"""The tree's shape rules (docs/development.md, "Layout of the tree"), checked on the source so that a
change breaking one fails CI: no ``nsa_cp`` module over 350 lines (the planner 250); every module in a layer of
docs/design.md's code map, its subpackage, and no import from a layer to a higher one nor any import circle
(lazy imports, inside functions, count too); no benchmark importing another benchmark (a benchmark's parts
belong to it alone; what benchmarks share lives in ``benchmarks/harness.py``)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 350
PLAN_MAX_LINES = 250  # the planner only plans (nsa_cp/planning/plan.py): transports own their routes


def _top_level_imports(path: pathlib.Path, package: str, lazy: bool = False):
    """Module names imported at module level (``lazy``: inside functions too)."""
    tree = ast.parse(path.read_text(), str(path))
    here = package.split(".")
    for node in (ast.walk(tree) if lazy else tree.body):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            yield mod
            yield from (f"{mod}.{alias.name}" for alias in node.names)  # `from . import plan`


def _library_modules():
    mods = {}
    for path in sorted((ROOT / "nsa_cp").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, ".".join(parts) if is_pkg else ".".join(parts[:-1]))
    return mods


def test_no_library_module_is_over_350_lines():
    long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / "nsa_cp").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"
    plan = len((ROOT / "nsa_cp" / "planning" / "plan.py").read_text().splitlines())
    assert plan <= PLAN_MAX_LINES, f"nsa_cp/planning/plan.py has {plan} lines (at most {PLAN_MAX_LINES}: it only plans)"


def test_no_import_circle_among_library_modules_lazy_imports_included():
    mods = _library_modules()
    graph = {name: {m for m in _top_level_imports(path, pkg, lazy=True) if m in mods and m != name}
             for name, (path, pkg) in mods.items()}
    # a package's __init__ re-exporting its children is not a circle through them: drop child -> parent
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert len(state) == len(mods) > 20  # the walk saw every module (the test can see a circle)


# docs/design.md's code map, lowest first: a module imports from its own layer and the ones below only
LAYERS = (
    ("base", ("nsa_cp.envs", "nsa_cp.support", "nsa_cp.errors", "nsa_cp.transports")),
    ("geometry", ("nsa_cp.geometry",)),
    ("row compute", ("nsa_cp.rows",)),
    ("movement", ("nsa_cp.transport",)),
    ("planning", ("nsa_cp.planning",)),
    ("public API", ("nsa_cp.api",)),
    ("integrations", ("nsa_cp.integrations",)),
    ("package", ("nsa_cp", "nsa_cp.__main__")),
)


def _layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{module} is in no layer of docs/design.md's code map"
    return best[0]


def test_every_module_is_in_its_layer_and_imports_only_downward():
    mods = _library_modules()
    upward = []
    for name, (path, pkg) in mods.items():
        here = _layer(name)
        for dep in set(_top_level_imports(path, pkg, lazy=True)):
            if dep in mods and dep != name and not name.startswith(dep + ".") and _layer(dep) > here:
                upward.append(f"{name} ({LAYERS[here][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))
    packages = {prefix for _, prefixes in LAYERS[1:-1] for prefix in prefixes}
    flat = sorted(n for n in mods if n.count(".") == 1 and n not in packages and _layer(n) not in (0, len(LAYERS) - 1))
    assert not flat, f"modules outside their layer's subpackage: {flat}"


def test_no_benchmark_imports_another_benchmark():
    files = {path.stem: path for path in (ROOT / "benchmarks").glob("*.py")}
    entry = {stem for stem, path in files.items() if '__name__ == "__main__"' in path.read_text()}
    imports = {stem: {m for m in _top_level_imports(path, "") if m in files} for stem, path in files.items()}
    crossing = sorted((a, b) for a in files for b in imports[a] if b in entry and b != a)
    assert not crossing, f"benchmarks importing another benchmark: {crossing}"
    owners = {}
    for stem in sorted(entry):  # every part (not harness) is reached from one entry point only
        seen, todo = set(), [stem]
        while todo:
            for dep in imports[todo.pop()] - seen - {"harness"}:
                seen.add(dep)
                todo.append(dep)
        for part in seen:
            owners.setdefault(part, set()).add(stem)
    shared = {part: sorted(who) for part, who in owners.items() if len(who) > 1}
    assert not shared, f"benchmark parts used by more than one benchmark (move them to harness.py): {shared}"
    assert "harness" in files and len(entry) >= 5
