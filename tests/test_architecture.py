"""The package's structure, read from its source with ast (nothing is imported).

* No import cycles among commkit's modules. Every import statement counts, at
  module level and inside functions alike, so a cycle hidden behind an import
  inside a function is still a cycle. The known exceptions are the explicit
  allow-list :data:`KNOWN_CYCLE_EDGES`, each entry naming the change that removes it.
* mpi4py and cupy are imported at module level only in ``commkit/transports/``
  and ``commkit/compat/`` (docs/architecture.md: the transports are the only
  modules that import them; elsewhere only inside functions, so that importing
  commkit needs neither).
* No module reads another module's private names (``other._name``, ``from other
  import _name``), apart from the allow-list :data:`KNOWN_PRIVATE_ACCESS`; nor
  does a script of :data:`SCRIPT_DIRS` (benchmarks/, which imports commkit's
  modules by name: what it needs of them is public API too). A private module
  (``commkit._units``) may be imported; its public names may be read.

What counts as an import of module M:

* ``import commkit.a.b`` and ``from commkit.a import b`` where ``commkit.a.b`` is a
  module: an edge to that module; ``from commkit.a import name`` for any other
  name: an edge to ``commkit.a`` (the package's ``__init__`` when ``a`` is a
  package). Relative imports are resolved against the importing module's package.
* The packages that contain M are not edges of an import of M: Python imports
  them first, every time, and a package's ``__init__`` importing its own modules
  is how it shows its public names.
* Imports under ``if TYPE_CHECKING:`` never run, and do not count.
* ``importlib.import_module`` with a computed name (the algorithm registry
  loading its modules and plugins) is not an import statement, and is not seen.
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys

import pytest

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(REPO_DIR, "commkit")
# Folders of scripts outside the package that import commkit by name and are held to its rule on private names.
SCRIPT_DIRS = ("benchmarks",)

# Edges (importer, imported) that close a cycle today. Each one stays here only until the change
# named beside it lands; test_every_allowed_edge_still_closes_a_cycle fails once it no longer does,
# so that the entry is removed with the fix.
KNOWN_CYCLE_EDGES: dict = {}

# Private names read across modules today: (reader, "module.name"), the reader a module's dotted name or a
# script's path from the repository root. Each is a name another module needs, so it should be public (or move
# to where it is used).
KNOWN_PRIVATE_ACCESS: dict = {}

# The optional libraries only the transports and the compatibility face may import at module level.
TRANSPORT_LIBRARIES = ("mpi4py", "cupy", "cupyx")
MAY_IMPORT_TRANSPORT_LIBRARIES = ("commkit.transports", "commkit.compat")


def _may_import_transport_libraries(name: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in MAY_IMPORT_TRANSPORT_LIBRARIES)


# -- reading the package ----------------------------------------------------------------------------------------------


def _modules() -> dict:
    """Every module of the package: dotted name -> (path, is_package)."""
    found = {}
    root = os.path.dirname(PACKAGE_DIR)
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            parts = os.path.relpath(path, root)[:-3].split(os.sep)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _scripts() -> dict:
    """Every script of :data:`SCRIPT_DIRS`: its path from the repository root -> its absolute path."""
    found = {}
    for top in SCRIPT_DIRS:
        for folder, dirs, files in os.walk(os.path.join(REPO_DIR, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for file in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, file)
                found[os.path.relpath(path, REPO_DIR).replace(os.sep, "/")] = path
    return found


SCRIPTS = _scripts()


@functools.lru_cache(maxsize=None)
def _parse_file(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _parse(name: str) -> ast.Module:
    """The syntax tree of a module of the package (by dotted name) or of a script (by its path in SCRIPTS)."""
    return _parse_file(MODULES[name][0] if name in MODULES else SCRIPTS[name])


def _where(reader: str) -> str:
    """A module's or a script's path from the repository root."""
    return os.path.relpath(MODULES[reader][0], REPO_DIR) if reader in MODULES else reader


def _is_type_checking(node) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree, in_function=False):
    """(node, in_function) for every node, but those under ``if TYPE_CHECKING:`` (its ``else`` runs, and counts)."""
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking(node):
            for child in node.orelse:
                yield child, in_function
                yield from _statements(child, in_function)
            continue
        yield node, in_function
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _statements(node, inner)


def _base(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (its relative dots resolved)."""
    if not node.level:
        return node.module or ""
    path, is_package = MODULES[importer]
    package = importer if is_package else importer.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise AssertionError(f"{path}:{node.lineno}: a relative import reaches above the commkit package")
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known(name: str) -> str | None:
    """``name`` if it is a module of the package, else the closest enclosing one; None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(importer: str):
    """(imported module, line, in_function) for each import of a commkit module by ``importer``."""
    for node, in_function in _statements(_parse(importer)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(importer, node)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            target = _known(name) if name.split(".")[0] == "commkit" else None
            if target is not None and target != importer:
                yield target, node.lineno, in_function


@functools.lru_cache(maxsize=1)
def import_graph() -> dict:
    """importer -> {imported: (line, in_function)} over the whole package.

    Of several imports of one module, the first at module level is kept, else the first inside a function.
    """
    graph = {}
    for name in MODULES:
        edges = graph.setdefault(name, {})
        for target, line, in_function in imports(name):
            if target not in edges or (edges[target][1] and not in_function):
                edges[target] = (line, in_function)
    return graph


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_cycle(graph, component) -> list[str]:
    """A closed path through the first module of ``component``, within it (breadth first: a shortest one)."""
    start, members = component[0], set(component)
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if w in members and w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{component} is not a cycle")


def _describe(graph, path) -> str:
    steps = []
    for a, b in zip(path, path[1:]):
        line, in_function = graph[a][b]
        where = os.path.relpath(MODULES[a][0], os.path.dirname(PACKAGE_DIR))
        steps.append(f"{a} -> {b} ({where}:{line}{', inside a function' if in_function else ''})")
    return "\n    ".join(steps)


def _without(graph, edges) -> dict:
    return {a: {b: v for b, v in targets.items() if (a, b) not in edges} for a, targets in graph.items()}


def _reaches(graph, source, target) -> bool:
    seen, todo = {source}, [source]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w == target:
                return True
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


# -- the reader itself ------------------------------------------------------------------------------------------------


def test_the_reader_sees_every_kind_of_import():
    """A check that reads nothing passes anything: the package's known imports must be found."""
    graph = import_graph()
    assert len(MODULES) > 40 and "commkit.transports.mpi" in MODULES and "commkit.compat.mpi4py" in MODULES
    assert graph["commkit.transports.mpi"]["commkit.transports.base"][1] is False  # from .base import ...
    assert "commkit.schedule" in graph["commkit.algorithms.naive"]                  # from ..schedule import ...
    assert "commkit.algorithms" in graph["commkit.algorithms.naive"]                # from . import algorithm
    assert "commkit._events" in graph["commkit.tracing"]                            # from ._events import ...
    assert "commkit.plot" in graph["commkit.tracing"]                               # from . import plot
    inside = {(a, b) for a, targets in graph.items() for b, (_, in_function) in targets.items() if in_function}
    assert inside, "no import inside a function was found"
    # mesh imports Communicator only under TYPE_CHECKING, which never runs.
    assert "commkit.communicator" not in graph["commkit.mesh"]


def test_resolving_relative_imports():
    node = ast.parse("from ..schedule import Copy").body[0]
    assert _base("commkit.algorithms.naive", node) == "commkit.schedule"
    node = ast.parse("from . import algorithm").body[0]
    assert _base("commkit.algorithms.naive", node) == "commkit.algorithms"
    assert _base("commkit.algorithms", node) == "commkit.algorithms"
    node = ast.parse("from .base import Status").body[0]
    assert _base("commkit.transports", node) == "commkit.transports.base"


def test_a_cycle_is_found_and_described():
    graph = {"a": {"b": (3, False)}, "b": {"c": (5, True)}, "c": {"a": (7, False)}, "d": {"a": (1, False)}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _cycles(_without(graph, {("b", "c")})) == []


# -- the rules --------------------------------------------------------------------------------------------------------


def test_no_import_cycles():
    graph = import_graph()
    cycles = _cycles(_without(graph, KNOWN_CYCLE_EDGES))
    if cycles:
        shown = [_describe(graph, _one_cycle(_without(graph, KNOWN_CYCLE_EDGES), c)) for c in cycles]
        pytest.fail(f"{len(cycles)} import cycle(s) among commkit's modules:\n  "
                    + "\n  ".join(f"{', '.join(c)}:\n    {s}" for c, s in zip(cycles, shown)))


def test_every_allowed_edge_still_closes_a_cycle():
    """An allow-list entry whose fix has landed must go, so the list shrinks with the fixes."""
    graph = import_graph()
    stale = [f"{a} -> {b}" for a, b in KNOWN_CYCLE_EDGES if b not in graph.get(a, {}) or not _reaches(graph, b, a)]
    assert not stale, f"these KNOWN_CYCLE_EDGES no longer close a cycle: remove them: {stale}"


def _transport_imports(name: str):
    """(library module, line) for each module-level import of mpi4py or cupy by ``name``."""
    for node, in_function in _statements(_parse(name)):
        if in_function:
            continue
        if isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            imported = [node.module or ""]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("__import__", "import_module")):
            imported = [str(node.args[0].value)]
        else:
            continue
        for module in imported:
            if module.split(".")[0] in TRANSPORT_LIBRARIES:
                yield module, node.lineno


def test_transport_libraries_are_imported_at_module_level_only_by_transports_and_compat():
    offenders = [f"{os.path.relpath(MODULES[name][0], PACKAGE_DIR)}:{line} imports {module}"
                 for name in MODULES if not _may_import_transport_libraries(name)
                 for module, line in _transport_imports(name)]
    assert not offenders, ("only commkit/transports/ and commkit/compat/ may import mpi4py or cupy at module level "
                           "(elsewhere, inside the function that needs it):\n  " + "\n  ".join(offenders))


def test_no_module_outside_transports_and_compat_imports_them_through_another():
    """What a module imports at module level runs when it is imported: that must not reach mpi4py or cupy either."""
    graph = import_graph()

    def loaded(name):  # a module and the packages Python imports before it
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]

    direct = {name for name in MODULES if any(_transport_imports(name))}
    offenders = []
    for start in sorted(MODULES):
        if _may_import_transport_libraries(start):
            continue
        parents, todo = {m: None for m in loaded(start)}, loaded(start)
        while todo:
            v = todo.pop()
            if v in direct:
                chain = [v]
                while parents[chain[-1]] is not None:
                    chain.append(parents[chain[-1]])
                offenders.append(" -> ".join(chain[::-1]))
                break
            for w, (_, in_function) in graph[v].items():
                for m in loaded(w):
                    if not in_function and m not in parents:
                        parents[m] = v
                        todo.append(m)
    assert not offenders, ("importing these modules imports mpi4py or cupy, through the modules they import at "
                           "module level:\n  " + "\n  ".join(sorted(set(offenders))))


def _module_of(node, aliases) -> str | None:
    """The commkit module an expression names: a name bound by an import, or a module attribute of one."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _module_of(node.value, aliases)
        if base is not None and f"{base}.{node.attr}" in MODULES:
            return f"{base}.{node.attr}"
    return None


def _private_reads(reader: str, tree=None):
    """("module.name", line) for each private name of another commkit module that ``reader`` reads.

    ``reader`` is a module of the package (dotted name) or a script (its path
    in :data:`SCRIPTS`; a script's relative imports are of its own folder, not
    of commkit). ``tree``, when given, is read instead of the reader's file.
    """
    tree = _parse(reader) if tree is None else tree
    aliases = {}  # local name -> commkit module it is bound to
    for node, _ in _statements(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level and reader not in MODULES:
                continue
            base = _base(reader, node)
            if base.split(".")[0] != "commkit":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__") and _known(base) != reader:
                    yield full, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "commkit":
                    aliases[alias.asname or "commkit"] = alias.name if alias.asname else "commkit"
    for node, _ in _statements(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            module = _module_of(node.value, aliases)
            full = f"{module}.{node.attr}"
            if module is not None and full not in MODULES and module != reader:
                yield full, node.lineno


def _reads_of(source: str, reader: str = "benchmarks/example.py") -> set:
    return {full for full, _ in _private_reads(reader, ast.parse(source))}


def test_the_reader_sees_private_names_read_by_a_script():
    """Each way a script reaches a module's private name is seen; a private module's public names are not."""
    assert "benchmarks/_tasks.py" in SCRIPTS and "benchmarks/compare.py" in SCRIPTS
    assert _reads_of("from commkit import bench\nbench._Case") == {"commkit.bench._Case"}
    assert _reads_of("def f():\n    from commkit import bench as b\n    return b._x") == {"commkit.bench._x"}
    assert _reads_of("import commkit as ck\nck.bench._Case") == {"commkit.bench._Case"}
    assert _reads_of("import commkit.bench\ncommkit.bench._Case") == {"commkit.bench._Case"}
    assert _reads_of("from commkit.bench import _Case") == {"commkit.bench._Case"}
    assert _reads_of("import commkit\ncommkit._private()") == {"commkit._private"}
    assert _reads_of("from commkit._units import format_bytes\nimport commkit._units as u\nu.format_bytes") == set()
    # The script's own names and its folder's modules are not commkit's.
    assert _reads_of("import _report\n_report._ratio\nfrom . import _tasks\nself._x\nbench._Case") == set()


def test_no_private_names_read_across_modules():
    found = {(reader, full): line for reader in [*MODULES, *SCRIPTS] for full, line in _private_reads(reader)}
    new = sorted(f"{_where(r)}:{line} reads {full}"
                 for (r, full), line in found.items() if (r, full) not in KNOWN_PRIVATE_ACCESS)
    assert not new, ("private names read from another module (make them public, or move them); benchmarks/ "
                     "counts as outside the package:\n  " + "\n  ".join(new))
    stale = sorted(f"{r} reads {full}" for r, full in KNOWN_PRIVATE_ACCESS if (r, full) not in found)
    assert not stale, f"these KNOWN_PRIVATE_ACCESS entries were fixed: remove them: {stale}"


def test_importing_commkit_leaves_the_simulator_and_drawing_for_their_first_use():
    """Every rank a job starts imports commkit: the simulator (commkit.cost, commkit.sim) and drawing
    (commkit.plot) load when a program first uses them, and ``ck.cost`` still reaches the module."""
    code = ("import sys, commkit as ck\n"
            "print(sorted(m for m in ('commkit.cost', 'commkit.sim', 'commkit.plot', 'matplotlib') if m in sys.modules))\n"
            "print(ck.cost.ALPHA > 0, 'commkit.sim' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO_DIR)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "True True"], result.stdout
