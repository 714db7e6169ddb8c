"""The package's shape: no import circle, each subpackage imports on its own, one namespace, no 0.1 aliases.

Static checks read the source with ``ast`` (cheap); one subprocess per subpackage proves it imports alone.
"""

from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
import tempfile
import tomllib
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the import namespace `hf_lisa` -> the folders it is installed from (see pyproject.toml [tool.setuptools])
ROOTS = {"hf_lisa": REPO / "hf_lisa", "hf_lisa.trainer_callbacks": REPO / "trainer_callbacks",
         "hf_lisa.model_cards": REPO / "model_cards"}
# modules allowed over the size budget, each with its one job
LINE_BUDGET = 500
OVER_BUDGET: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if prefix == "hf_lisa" and any(name.startswith(p) for p in ROOTS if p != "hf_lisa"):
                continue
            found[name] = path
    return found


MODULES = _modules()


def _package_of(name: str) -> str:
    path = MODULES[name]
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = _package_of(module).split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    names = [f"{target}.{alias.name}" for alias in node.names]
    return [n for n in names if n in MODULES] or ([target] if target in MODULES else [])


def _import_edges(in_functions: bool = False) -> dict[str, set[str]]:
    """Module -> hf_lisa modules it imports when it is imported (module level), or anywhere in it, functions included
    (``in_functions``)."""
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        deps: set[str] = set()
        for node in tree.body:
            nodes = [node]
            if isinstance(node, ast.If) or in_functions:  # e.g. a TYPE_CHECKING block; every function's imports
                nodes = list(ast.walk(node))
            for sub in nodes:
                if isinstance(sub, ast.ImportFrom):
                    deps.update(_resolve(name, sub))
                elif isinstance(sub, ast.Import):
                    deps.update(a.name for a in sub.names if a.name in MODULES)
        # importing a submodule first imports its parent packages
        deps.discard(name)
        edges[name] = {d for d in deps if not name.startswith(d + ".")}
    return edges


def _first_cycle(edges: dict[str, set[str]]):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


@pytest.mark.parametrize("in_functions", [False, True], ids=["module-level", "function-level-too"])
def test_no_import_cycle_between_modules(in_functions):
    """No circle, not even through an import deferred into a function (a deferred import that closes a circle only
    hides it). A package's ``__init__`` re-exporting its submodules is not an edge back to it: importing a submodule
    imports its parent first, by Python's rules, and that is not an import the submodule chose."""
    edges = _import_edges(in_functions)
    for name in edges:  # a module's edge to its own package's __init__ (or an ancestor's) is Python's, not a choice
        edges[name] = {d for d in edges[name] if not name.startswith(d + ".")}
    cycle = _first_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


#: string constants equal to a method's name that are not a method (value, module): why
NOT_A_METHOD = {
    ("full", "hf_lisa.hub.staging"): "the kind of weights a folder holds (full weights vs an adapter)",
    ("full", "hf_lisa.export.merged"): "the kind of weights a folder holds",
    ("full", "hf_lisa.distributed.ddp"): "the bytes a full gradient all-reduce would send",
    ("full", "hf_lisa.distributed.configure"): "the bytes a full gradient all-reduce would send",
    ("lora", "hf_lisa.export.cli"): "the export format `hf-lisa export lora`",
    ("lora", "hf_lisa.export"): "the submodule hf_lisa.export.lora (the LoRA export format)",
    ("lisa", "hf_lisa.hub.card"): "the card's library tag",
    ("lisa", "hf_lisa.train.outputs"): "the key of the LISA settings in training_summary.json",
    ("lisa", "hf_lisa.demo"): "the key of the LISA settings in training_summary.json",
    ("lisa", "hf_lisa.hub.summary"): "the key of the LISA settings in training_summary.json",
    ("lisa", "hf_lisa.tuner"): "PEFT's registry name of the LISA peft type",
    ("full", "hf_lisa.integrations.llamafactory"): "LLaMA-Factory's finetuning_type value (its own vocabulary)",
    ("lora", "hf_lisa.integrations.llamafactory"): "LLaMA-Factory's default finetuning_type (its own vocabulary)",
}


def test_method_names_are_spelled_only_in_the_registry():
    from hf_lisa.methods import METHODS

    found = []
    for name, path in MODULES.items():
        if name == "hf_lisa.methods":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in METHODS and id(node) not in docstrings
                    and (node.value, name) not in NOT_A_METHOD):
                found.append(f"{name}:{node.lineno} {node.value!r}")
    assert not found, f"method names outside hf_lisa/methods.py (ask the registry): {found}"


# the layers of docs/architecture.md, lowest first: a module may import (at any depth, functions included) only from
# its own layer or a lower one; the root package `hf_lisa` re-exports and is exempt
LAYERS = (
    ("hf_lisa.blocks", "hf_lisa.tuner.peft_type", "hf_lisa.errors", "hf_lisa.models", "hf_lisa.methods", "hf_lisa.option_names",
     "hf_lisa.option_aliases", "hf_lisa._lazy", "hf_lisa.renamed"),
    ("hf_lisa.tuner",),
    ("hf_lisa.optim",),
    ("hf_lisa.scheduler",),
    ("hf_lisa.distributed",),
    ("hf_lisa.trainer_callbacks",),
    ("hf_lisa.trainer",),
    ("hf_lisa.hub", "hf_lisa.model_cards"),
    ("hf_lisa.data", "hf_lisa.evaluation"),
    ("hf_lisa.train", "hf_lisa.cli", "hf_lisa.demo", "hf_lisa.demo_task", "hf_lisa.export", "hf_lisa.generate",
     "hf_lisa.generate_file", "hf_lisa.generate_guards", "hf_lisa.chat", "hf_lisa.integrations"),
)


def _layer(module: str) -> int:
    matches = [(len(prefix), i) for i, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer of LAYERS (and docs/architecture.md)"
    return max(matches)[1]


def test_each_module_imports_only_from_its_layer_or_below():
    upward = []
    for name, path in MODULES.items():
        if name == "hf_lisa":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                deps = _resolve(name, node)
            elif isinstance(node, ast.Import):
                deps = [a.name for a in node.names if a.name in MODULES]
            else:
                continue
            for dep in deps:
                if not name.startswith(dep + ".") and _layer(dep) > _layer(name):
                    upward.append(f"{name} -> {dep}")
    assert not upward, f"imports against the layering of docs/architecture.md: {upward}"


SUBPACKAGES = ["hf_lisa.tuner", "hf_lisa.optim", "hf_lisa.scheduler", "hf_lisa.distributed", "hf_lisa.data", "hf_lisa.train", "hf_lisa.trainer", "hf_lisa.hub",
               "hf_lisa.trainer_callbacks", "hf_lisa.cli", "hf_lisa.integrations"]
@pytest.fixture(scope="module")
def fresh_interpreters():
    """Every fresh-interpreter import check of this module, started at once (each is a cold import of torch,
    transformers and peft, mostly single-threaded): ``{key: (returncode, stderr)}``."""
    jobs = {module: (f"import warnings; warnings.simplefilter('error', FutureWarning); import {module}", "/")
            for module in SUBPACKAGES}
    with contextlib.ExitStack() as stack:
        running = {}
        for key, (code, cwd) in jobs.items():
            stderr = stack.enter_context(tempfile.TemporaryFile("w+"))  # a file: a full pipe would stall the child
            running[key] = (subprocess.Popen([sys.executable, "-c", code], cwd=cwd, stdout=subprocess.DEVNULL,
                                             stderr=stderr), stderr)
        results = {}
        for key, (process, stderr) in running.items():
            process.wait(timeout=300)
            stderr.seek(0)
            results[key] = (process.returncode, stderr.read())
    return results


@pytest.mark.slow  # fresh interpreters, each a cold import of torch, transformers and peft (~70 s together)
@pytest.mark.parametrize("module", SUBPACKAGES)
def test_each_subpackage_imports_on_its_own(module, fresh_interpreters):
    returncode, stderr = fresh_interpreters[module]
    assert returncode == 0, stderr[-2000:]


def test_pyproject_installs_every_package():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(config["packages"])
    expected = {_package_of(name) for name in MODULES}
    assert expected <= packages, f"not installed: {sorted(expected - packages)}"
    assert config["package-dir"] == {"hf_lisa.trainer_callbacks": "trainer_callbacks",
                                     "hf_lisa.model_cards": "model_cards"}


def test_modules_stay_within_the_line_budget():
    over = {}
    for name, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        if lines > LINE_BUDGET and name not in OVER_BUDGET:
            over[name] = lines
    assert not over, f"modules over {LINE_BUDGET} lines without a stated reason: {over}"


def test_the_0_1_names_are_gone():
    """0.1 was never released: its module paths and the generic top-level names are not importable aliases."""
    import importlib

    import hf_lisa  # noqa: F401

    for old in ("hf_lisa.config", "hf_lisa.loading", "hf_lisa.registration"):  # (hf_lisa.data is the data pipeline now)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not {"trainer_callbacks", "model_cards"} & set(config["packages"])
    assert "ignore::FutureWarning" not in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["filterwarnings"]


def test_no_warning_on_the_canonical_paths():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        import hf_lisa.trainer_callbacks  # noqa: F401
        from hf_lisa import model_cards

        assert model_cards.template_path().endswith(".md.j2")


@pytest.mark.slow  # pip wheel, pip install, a fresh interpreter
def test_built_wheel_installs_one_namespace(tmp_path):
    """What users get from the wheel (not the editable checkout): the mapped folders land inside ``hf_lisa``."""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), str(REPO)], check=True,
                   timeout=300, capture_output=True)
    (wheel,) = wheel_dir.glob("hf_lisa-*.whl")
    subprocess.run(pip + ["install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=300,
                   capture_output=True)
    code = (
        "import sys, warnings\n"
        f"sys.path.insert(0, {str(target)!r})\n"
        "import hf_lisa, hf_lisa.trainer_callbacks, hf_lisa.model_cards\n"
        f"assert hf_lisa.__file__.startswith({str(target)!r}), hf_lisa.__file__\n"
        "assert hf_lisa.model_cards.template_path().endswith('model_card.md.j2')\n"
        "import importlib.resources\n"
        "assert importlib.resources.files('hf_lisa').joinpath('train_help.txt').is_file()\n"
        "from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('trainer_callbacks') is None\n"
        "assert importlib.util.find_spec('model_cards') is None\n"
        "print(hf_lisa.__version__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    import hf_lisa

    assert result.stdout.strip() == hf_lisa.__version__


def test_architecture_doc_maps_every_module():
    text = (REPO / "docs" / "architecture.md").read_text()
    missing = [str(path.relative_to(REPO)) for path in MODULES.values() if f"`{path.relative_to(REPO)}`" not in text]
    assert not missing, f"docs/architecture.md does not map {missing}"


def _unit(module: str) -> str:
    """The subpackage a module belongs to (``hf_lisa.hub`` for ``hf_lisa.hub.staging``), or the leaf module itself."""
    parts = module.split(".")
    if parts[:2] == ["hf_lisa", "trainer_callbacks"]:
        return "hf_lisa.trainer_callbacks"
    return ".".join(parts[:2])


def test_names_imported_across_subpackages_are_public():
    """Issue 34: an underscore means "only this subpackage uses it". A name another subpackage (or a leaf module)
    imports is part of what its owner offers, and is spelled without one."""
    private = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = _package_of(name).split(".")
                target = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("hf_lisa") or _unit(target) == _unit(name):
                continue
            private += [f"{name} imports {target}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not private, private
