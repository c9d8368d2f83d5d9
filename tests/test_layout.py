"""The package layout's rules (docs/design.md): no import cycles between modules or packages, layers that only
import downward, at most 8 top-level modules, none over 700 lines; and `python -m hybridmoe` works."""
import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "hybridmoe"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _edges(mods) -> set[tuple[str, str]]:
    """(importer, imported) for every import of one package module by another, lazy imports included."""
    edges = set()
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                if t in mods and t != m and not m.startswith(t + "."):
                    edges.add((m, t))
    return edges


def _cycles(nodes, edges) -> list[set]:
    graph = {n: {b for a, b in edges if a == n} for n in nodes}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def _package(m: str) -> str:
    return m.split(".")[1] if m.count(".") >= 1 else m


def test_no_import_cycles_and_layers_import_downward():
    mods = _modules()
    edges = _edges(mods)
    assert _cycles(list(mods), edges) == []
    pkg_edges = {(_package(a), _package(b)) for a, b in edges if _package(a) != _package(b)}
    assert _cycles({p for e in pkg_edges for p in e}, pkg_edges) == []
    bad = sorted((a, b) for a, b in pkg_edges if (a in ("perf", "placement") and b == "runtime")
                 or (a == "models" and b == "kernels") or (b == "serve" and a != "commands"))
    assert bad == []


def test_small_top_level_and_small_modules():
    mods = _modules()
    top = [m for m, p in mods.items() if m.count(".") == 1 and p.name != "__init__.py"]
    assert len(top) <= 8, sorted(top)
    long = {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > 700}
    assert long == {}


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "hybridmoe", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "sweep-bench" in r.stdout, r.stderr
