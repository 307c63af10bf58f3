"""The shape of the source: no file over 600 lines, no function over 80 (issue 27).

Files and functions that were over the limit when this check came in are listed below with
their size then: they may shrink, never grow, and a new file or function over the limit fails.
When one of them gets under the limit, the test asks for its line here to go - the list only
ever gets shorter. The benchmark scripts are checked too (since 2026-12-04), and the tests (since 2026-12-05); Triton kernel bodies
(``@triton.jit``) are exempt from the function limit, also inside the function that defines them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# path -> lines when the check came in
OVER_FILE: dict[str, int] = {
}

# "path::qualified.name" -> lines when the check came in
OVER_FUNCTION: dict[str, int] = {
}


def source_files() -> list[Path]:
    roots = [REPO / "rlcli", *sorted((REPO / "plugins").glob("*/rlcli_*")), REPO / "benchmarks", REPO / "tests",
             *sorted((REPO / "plugins").glob("*/tests"))]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def _is_triton_kernel(node: ast.AST) -> bool:
    for d in getattr(node, "decorator_list", []):
        text = ast.unparse(d)
        if text.startswith(("triton.jit", "triton.autotune", "triton.heuristics")):
            return True
    return False


def _lines(node: ast.AST) -> int:
    """Lines of a definition, its decorators included."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - start + 1


def _kernels_within(node: ast.AST) -> list[ast.AST]:
    """The outermost Triton kernels defined inside ``node`` (a kernel factory's bodies)."""
    found = []
    for child in ast.iter_child_nodes(node):
        found.extend([child] if _is_triton_kernel(child) else _kernels_within(child))
    return found


def functions(tree: ast.AST):
    """(qualified name, lines) of every function and method, nested ones included."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                if not _is_triton_kernel(child):
                    yield name, _lines(child) - sum(_lines(k) for k in _kernels_within(child))
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def measure() -> tuple[dict[str, int], dict[str, int]]:
    files, funcs = {}, {}
    for p in source_files():
        text = p.read_text()
        files[rel(p)] = len(text.splitlines())
        for name, n in functions(ast.parse(text)):
            funcs[f"{rel(p)}::{name}"] = max(n, funcs.get(f"{rel(p)}::{name}", 0))
    return files, funcs


def check(sizes: dict[str, int], known: dict[str, int], limit: int, what: str) -> list[str]:
    problems = []
    for key, n in sorted(sizes.items()):
        if n <= limit:
            continue
        if key not in known:
            problems.append(f"{key}: {n} lines, over the {limit}-line limit for a {what}")
        elif n > known[key]:
            problems.append(f"{key}: {n} lines, grew past the {known[key]} it had (limit {limit}); shrink it")
    for key, was in sorted(known.items()):
        if sizes.get(key, 0) <= limit:
            problems.append(f"{key}: now within {limit} lines (was {was}); remove its line from "
                            f"tests/test_code_shape.py")
    return problems


def test_no_file_over_600_lines_and_no_function_over_80():
    files, funcs = measure()
    problems = check(files, OVER_FILE, MAX_FILE_LINES, "file") + check(funcs, OVER_FUNCTION, MAX_FUNCTION_LINES,
                                                                       "function")
    assert not problems, "\n".join(problems)


def test_the_measure_sees_methods_nested_functions_and_skips_triton_kernels():
    src = ("class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n"
           "@triton.jit\ndef k():\n    pass\n"
           "def factory():\n    @triton.jit\n    def k2():\n        pass\n    return k2\n")
    assert dict(functions(ast.parse(src))) == {"A.m": 4, "A.m.inner": 2, "factory": 2}
    assert check({"f": 700}, {}, 600, "file") == ["f: 700 lines, over the 600-line limit for a file"]
    assert check({"f": 650}, {"f": 700}, 600, "file") == []
    assert "grew past" in check({"f": 710}, {"f": 700}, 600, "file")[0]
    assert "remove its line" in check({"f": 500}, {"f": 700}, 600, "file")[0]
