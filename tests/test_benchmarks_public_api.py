"""benchmarks/ uses hf-lisa's public API only (issue 34 item 4): what a user can import, so that reshaping the CLI's
internals cannot break a benchmark, and a benchmark measures what a user would run.

A name of ``hf_lisa`` is **public** when

* the module it comes from has no component starting with ``_`` (``hf_lisa._lazy`` is private),
* it does not start with ``_`` (dunders such as ``__version__`` excepted),
* it is listed in that module's ``__all__`` (a module without ``__all__`` has no public names), and
* the module is not part of the ``hf-lisa train`` application, :data:`APPLICATION_PACKAGES`: ``hf_lisa.train`` lists
  ``LisaTrainer``, ``apply_method``, its data pipeline... in ``__all__`` for the CLI's own use, but issue 34 calls
  them the CLI's internals (its library face is to move out of it), so a benchmark drives the command instead
  (``hf-lisa train`` in a subprocess).

Every ``import hf_lisa...``/``from hf_lisa... import ...`` in ``benchmarks/*.py`` is checked, at any depth (function
level included), and so is attribute access through an imported module (``hf_lisa.train.run.main``,
``cli.main`` after ``from hf_lisa import cli``). Importing a submodule itself (``from hf_lisa import trainer_callbacks``)
is fine when its path is public; what is then used from it is checked.

No use is exempted any more: the lists of uses waiting for a public name (34 entries at first) emptied as the data
pipeline (``hf_lisa.data``), the trainer (``hf_lisa.trainer``), the method set-up
(``hf_lisa.trainer.methods.setup_method``), model loading (``hf_lisa.models``) and generation exact match
(``hf_lisa.evaluation``) became public. ``python tests/test_benchmarks_public_api.py`` prints every non-public use.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO_ROOT / "benchmarks"

#: packages whose names are not public for benchmarks, whatever their ``__all__`` says (see the module docstring)
APPLICATION_PACKAGES = ("hf_lisa.train",)

# ----------------------------------------------------------------------------------------------------------------------
# What is public
# ----------------------------------------------------------------------------------------------------------------------
#: where a package's source lies when it is not under its import path (pyproject.toml's package-dir)
PACKAGE_DIRS = {"hf_lisa.trainer_callbacks": "trainer_callbacks", "hf_lisa.model_cards": "model_cards"}


def source_file(module: str) -> Optional[Path]:
    """The source of ``module`` in this checkout (``__init__.py`` for a package), found without importing anything:
    the check reads code, so a module that does not import right now (another change under way) is still judged."""
    for prefix, folder in PACKAGE_DIRS.items():
        if module == prefix or module.startswith(prefix + "."):
            base = REPO_ROOT / folder / Path(*module[len(prefix) + 1:].split(".")) if module != prefix \
                else REPO_ROOT / folder
            break
    else:
        base = REPO_ROOT / Path(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def is_module(path: str) -> bool:
    return path.split(".")[0] == "hf_lisa" and source_file(path) is not None


def exported_names(module: str) -> Optional[list[str]]:
    """``module.__all__`` as written (a literal list, as every module of hf-lisa writes it), or ``None``."""
    tree = ast.parse(source_file(module).read_text())
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] \
            if isinstance(stmt, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(stmt.value))
    return None


def module_problem(path: str) -> Optional[str]:
    """Why importing the module ``path`` itself is not public, or ``None``."""
    if any(part.startswith("_") and not part.startswith("__") for part in path.split(".")):
        return "underscore module"
    if any(path == app or path.startswith(app + ".") for app in APPLICATION_PACKAGES):
        return "the hf-lisa train application"
    return None


def name_problem(module: str, name: str) -> Optional[str]:
    """Why ``name`` of ``module`` is not public, or ``None``."""
    problem = module_problem(module)
    if problem:
        return problem
    if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
        return "underscore name"
    if not is_module(module):
        return f"no module {module}"
    exported = exported_names(module)
    if exported is None:
        return f"{module} has no __all__"
    if name not in exported:
        return f"not in {module}.__all__"
    return None


# ----------------------------------------------------------------------------------------------------------------------
# What a benchmark uses
# ----------------------------------------------------------------------------------------------------------------------
def _attribute_chain(node: ast.Attribute) -> Optional[tuple[str, list[str]]]:
    """``a.b.c`` -> ``("a", ["b", "c"])``; ``None`` unless the chain ends at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, parts[::-1]


class _Uses(ast.NodeVisitor):
    """Every hf_lisa name a file uses, as ``(line, "module.name", problem)``; module aliases are scoped per function
    (an import inside a function binds its name for that function and the functions inside it)."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, str]] = [{}]  # local name -> the hf_lisa module it is bound to
        self.found: list[tuple[int, str, str]] = []

    def _report(self, line: int, what: str, problem: Optional[str]) -> None:
        if problem:
            self.found.append((line, what, problem))

    def _bind_imports(self, body: list[ast.stmt]) -> None:
        """Bind the module aliases of every import directly in ``body`` (nested blocks too, not nested functions)."""
        scope = self.scopes[-1]
        for stmt in body:
            for node in _walk_same_scope(stmt):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.split(".")[0] != "hf_lisa":
                            continue
                        if alias.asname:
                            scope[alias.asname] = alias.name
                        else:
                            scope["hf_lisa"] = "hf_lisa"
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] == "hf_lisa":
                    for alias in node.names:
                        if is_module(f"{node.module}.{alias.name}"):
                            scope[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def _scoped(self, node: ast.AST, body: list[ast.stmt]) -> None:
        self.scopes.append({})
        self._bind_imports(body)
        self.generic_visit(node)
        self.scopes.pop()

    def visit_Module(self, node: ast.Module) -> None:
        self._bind_imports(node.body)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "hf_lisa":
                self._report(node.lineno, alias.name, module_problem(alias.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or node.module.split(".")[0] != "hf_lisa":
            return
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            if is_module(full):
                self._report(node.lineno, full, module_problem(full))
            else:
                self._report(node.lineno, full, name_problem(node.module, alias.name))

    def _lookup(self, name: str) -> Optional[str]:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _attribute_chain(node)
        module = chain and self._lookup(chain[0])
        if not module:
            self.generic_visit(node)
            return
        for attr in chain[1]:  # walk down submodules; the first attribute that is not one is a name of the last
            if is_module(f"{module}.{attr}"):
                module = f"{module}.{attr}"
                continue
            self._report(node.lineno, f"{module}.{attr}", name_problem(module, attr))
            break
        # the chain is handled as a whole: do not visit its inner Attribute nodes again


def _walk_same_scope(node: ast.AST) -> Iterator[ast.AST]:
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _walk_same_scope(child)


def non_public_uses(path: Path) -> list[tuple[int, str, str]]:
    uses = _Uses()
    uses.visit(ast.parse(path.read_text(), filename=str(path)))
    return sorted(set(uses.found))


def offenders() -> dict[str, list[tuple[int, str, str]]]:
    found = {}
    for path in sorted(BENCHMARKS.glob("*.py")):
        uses = non_public_uses(path)
        if uses:
            found[path.name] = uses
    return found


def format_offenders(found: dict[str, list[tuple[int, str, str]]]) -> str:
    lines = []
    for name, uses in found.items():
        lines.append(f"benchmarks/{name}:")
        lines.extend(f"  line {line}: {what} ({problem})" for line, what, problem in uses)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------------
def test_benchmarks_use_public_names_only():
    """No benchmark uses a non-public name of hf_lisa."""
    found = offenders()
    assert not found, "benchmarks use non-public names of hf_lisa:\n" + format_offenders(found)


def test_the_checker_sees_each_kind_of_use(tmp_path):
    """The checker itself: each way of reaching a name, public and not, on a file written here."""
    source = tmp_path / "example.py"
    source.write_text(
        "import hf_lisa\n"
        "import hf_lisa.train.run\n"
        "from hf_lisa import LisaConfig, find_blocks, cli, trainer_callbacks\n"
        "from hf_lisa.trainer_callbacks import LisaCallback\n"
        "from hf_lisa.trainer_callbacks.progress import MIN_UPDATE\n"
        "from hf_lisa.blocks import find_blocks as fb\n"
        "from hf_lisa._lazy import lazy_attributes\n"
        "from hf_lisa.train import LisaTrainer\n"
        "def f():\n"
        "    from hf_lisa.optim import memory\n"
        "    hf_lisa.LisaConfig(r=1)\n"
        "    hf_lisa.train.run.main()\n"
        "    hf_lisa.data.load_raw_datasets()\n"
        "    cli.main([])\n"
        "    trainer_callbacks.LisaAdapterCallback\n"
        "    return memory.heap_trim\n"
        "def g(memory):\n"
        "    return memory.heap_trim  # a parameter, not the module bound in f\n"
    )
    found = {what: problem for _, what, problem in non_public_uses(source)}
    assert found == {
        "hf_lisa.train.run": "the hf-lisa train application",
        "hf_lisa.train.run.main": "the hf-lisa train application",
        "hf_lisa.cli.main": "hf_lisa.cli has no __all__",
        "hf_lisa.trainer_callbacks.progress.MIN_UPDATE": "not in hf_lisa.trainer_callbacks.progress.__all__",
        "hf_lisa.blocks.find_blocks": "hf_lisa.blocks has no __all__",
        "hf_lisa._lazy.lazy_attributes": "underscore module",
        "hf_lisa.train.LisaTrainer": "the hf-lisa train application",
        "hf_lisa.optim.memory.heap_trim": "hf_lisa.optim.memory has no __all__",
    }


if __name__ == "__main__":  # `python tests/test_benchmarks_public_api.py`: list every offender, exempted or not
    sys.exit(print(format_offenders(offenders())) or 0)
