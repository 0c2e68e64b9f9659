"""A griffe extension for the API pages (mkdocs.yml): graphforge.passes is the folder passes/ at
the repository's top (pyproject.toml maps it with setuptools' package-dir), where griffe, which
reads the source tree without importing it, does not look. Once it has read the graphforge
package, this reads passes/ as its subpackage, so the pages name graphforge.passes as users
import it, and its classes' imports (``from graphforge.passes.loss import Loss``) resolve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

PASSES = Path(__file__).resolve().parents[1] / "passes"


class PackageDir(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name == "graphforge":
            pkg.set_member("passes", _read(loader, "passes", PASSES, pkg))
            loader.expand_exports(pkg["passes"])


def _read(loader: griffe.GriffeLoader, name: str, folder: Path, parent: griffe.Module) -> griffe.Module:
    """The package in ``folder``, its modules and subpackages, read as griffe reads any package."""
    module = _visit(loader, name, folder / "__init__.py", parent)
    for path in sorted(folder.iterdir()):
        if path.suffix == ".py" and path.stem != "__init__":
            module.set_member(path.stem, _visit(loader, path.stem, path, module))
        elif (path / "__init__.py").is_file():
            module.set_member(path.name, _read(loader, path.name, path, module))
    return module


def _visit(loader: griffe.GriffeLoader, name: str, path: Path, parent: griffe.Module) -> griffe.Module:
    code = path.read_text(encoding="utf-8")
    loader.lines_collection[path] = code.splitlines()
    return griffe.visit(
        name,
        filepath=path,
        code=code,
        extensions=loader.extensions,
        parent=parent,
        docstring_parser=loader.docstring_parser,
        docstring_options=loader.docstring_options,
        lines_collection=loader.lines_collection,
        modules_collection=loader.modules_collection,
    )
