"""Functions a reader takes in at once: none in graphforge/ or passes/ runs over 80 lines, from its
``def`` to its last line, unless its docstring says why it must be one piece (the words "one piece")."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 80


def long_functions(repo: Path) -> list[str]:
    found = []
    for root in ("graphforge", "passes"):
        for path in sorted((repo / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT and "one piece" not in (ast.get_docstring(node) or "").lower():
                    found.append(f"{path.relative_to(repo)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_the_limit_without_a_reason():
    assert not long_functions(REPO), "split these, or say in the docstring why each must be one piece"


def test_the_check_finds_a_long_function_and_reads_its_reason(tmp_path):
    (tmp_path / "passes").mkdir()
    module = tmp_path / "graphforge" / "inner" / "long.py"
    module.parent.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    module.write_text(f"class A:\n    def long(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n")
    assert long_functions(tmp_path) == [f"graphforge/inner/long.py:2 long ({LIMIT + 1} lines)"]
    module.write_text(f'def long():\n    """One piece: the cases share one loop."""\n{body}\n')
    assert long_functions(tmp_path) == []
    module.write_text(f"def short():\n{body[: body.rindex(chr(10))]}\n")
    assert long_functions(tmp_path) == []
