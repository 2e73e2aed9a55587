"""The package's layout in figures (issue 22): files over 600 lines, functions over 100 (and 60) lines,
import circles among torchgemma's modules, and imports that go up the layer order.

    python tools/layout.py [--list] [SRC]        # SRC defaults to src/torchgemma

Imports are read from the AST at module level and inside functions alike (a lazy import still ties
two modules together). The layer order is the package's intended one, lowest first; a module may
import its own layer and lower ones.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

# Lowest first. A name is a top-level module or package of torchgemma.
LAYERS = [
    ["config", "notices"],
    ["kernels"],
    ["cache", "model"],
    ["distributed", "placement", "quantization", "acceleration", "weights"],
    ["tokenizer", "replies"],
    ["processing", "generation", "reference"],
    ["embedding", "embedding_media", "info", "debug", "llm"],
    ["serving"],
    ["cli", "__init__", "__main__"],
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, name: str, is_package: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    base = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("torchgemma")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("torchgemma"):
                # `from . import reference` imports the submodule; `from .x import name` imports x
                found |= {f"{target}.{a.name}" for a in node.names} | {target + "#"}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", default="src/torchgemma")
    parser.add_argument("--list", action="store_true", help="name every file, function, circle and import")
    args = parser.parse_args()
    root = Path(args.src).resolve()
    files = sorted(
        p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts
    )

    long_files = [(len(p.read_text().splitlines()), p) for p in files]
    long_files = [(n, p) for n, p in long_files if n > 600]

    long_functions = []
    modules = {}
    for path in files:
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long_functions.append((length, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
        modules[module_name(path, root.parent)] = path

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        found = imports(path, name, path.name == "__init__.py")
        for target in found:
            if target.endswith("#"):  # the module a from-import reads: only if no name is a submodule
                base = target[:-1]
                if any(t.startswith(base + ".") and t in modules for t in found):
                    continue
                target = base
            # the longest known module the import names
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets

    # circles: strongly connected components of more than one module (Tarjan)
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            # a package importing its own submodules (its __init__ re-exports) is not a circle
            real = [m for m in component if not any(o.startswith(m + ".") for o in component)]
            if len(component) > 1 and len(real) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)

    def level(name: str) -> int | None:
        parts = name.split(".")
        return LEVEL.get(parts[1] if len(parts) > 1 else "__init__")

    upward = []
    for source, targets in graph.items():
        for target in targets:
            a, b = level(source), level(target)
            if a is not None and b is not None and b > a:
                upward.append(f"{source} -> {target}")

    print(f"files over 600 lines: {len(long_files)}")
    print(f"functions over 100 lines: {sum(n > 100 for n, _ in long_functions)}")
    print(f"functions over 60 lines: {len(long_functions)}")
    print(f"import circles: {len(circles)}")
    print(f"upward imports: {len(upward)}")
    if args.list:
        for n, p in sorted(long_files, reverse=True):
            print(f"  file {n:5d} {p.relative_to(root)}")
        for n, f in sorted(long_functions, reverse=True):
            print(f"  function {n:4d} {f}")
        for c in circles:
            print("  circle " + " <-> ".join(c))
        for u in sorted(upward):
            print("  upward " + u)


if __name__ == "__main__":
    main()
