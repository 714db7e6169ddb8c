"""The test lanes stay honest: a test that starts a process is never in ``make test-fast``.

``make test-fast`` deselects the markers ``slow``, ``distributed`` and ``gguf`` (pyproject.toml). Here every test
whose code starts a process (``subprocess``, ``multiprocessing``), directly or through a helper or fixture of its own
module or a helper of tests/ (``dist_common.launch``), must carry ``slow`` or ``distributed``, or be listed in
``SPAWNS_BUT_FAST`` with the reason. Read from the source (ast) of the test modules, and from the markers of the
items this session collected, those that ``-m`` deselected included (the ``collected_items`` fixture of
tests/conftest.py), so the markers that tests/conftest.py adds count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SPAWNING_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing"}
LANE_MARKERS = {"slow", "distributed"}

#: (test file relative to tests/, test function) -> why it stays in the fast lane although it starts a process
SPAWNS_BUT_FAST: dict[tuple[str, str], str] = {}


def _spawning_functions(tree: ast.Module, helpers: dict[str, set[str]]) -> set[str]:
    """Names of the module's functions (``Class::method`` for methods) that start a process, directly or not.
    ``helpers``: the spawning functions of the helper modules of tests/, by module."""
    names: set[str] = set()
    for node in tree.body:  # `import subprocess`, `from subprocess import run`, `from dist_common import launch`
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name in SPAWNING_MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module in SPAWNING_MODULES | set(helpers):
            names |= {a.asname or a.name for a in node.names
                      if node.module in SPAWNING_MODULES or a.name in helpers[node.module]}
    functions = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            functions |= {f"{node.name}::{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)}
    # the names a function uses, its parameters included: a fixture of the module is reached through its name
    uses = {name: {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {a.arg for a in fn.args.args}
            for name, fn in functions.items()}
    spawning: set[str] = set()
    while True:
        reached = names | {name.split("::")[-1] for name in spawning}
        more = {name for name, used in uses.items() if name not in spawning and used & reached}
        if not more:
            return spawning
        spawning |= more


def spawning_tests() -> dict[tuple[str, str], None]:
    """``(test file relative to tests/, test function)`` of every test that starts a process."""
    helpers = {path.stem: _spawning_functions(ast.parse(path.read_text()), {})  # dist_common, hub_server, ...
               for path in TESTS.rglob("*.py") if not path.name.startswith(("test_", "conftest"))}
    found = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for name in _spawning_functions(ast.parse(path.read_text()), helpers):
            if name.split("::")[-1].startswith("test"):
                found[(path.relative_to(TESTS).as_posix(), name.split("::")[-1])] = None
    return found


def test_the_check_follows_fixtures_and_helpers():
    source = """
import subprocess
from dist_common import launch
from train_fixtures import write_jsonl

@pytest.fixture
def child():
    return subprocess.run(["true"])

def _two_ranks():
    return launch(["torchrun", "--nproc_per_node", "2", "worker.py"])

def test_direct(): subprocess.run(["true"])
def test_through_a_fixture(child): pass
def test_through_a_helper(): _two_ranks()
def test_maths(tmp_path): write_jsonl(tmp_path / "rows.jsonl", [])
"""
    found = _spawning_functions(ast.parse(source), {"dist_common": {"launch"}, "train_fixtures": set()})
    assert {name for name in found if name.startswith("test")} == {
        "test_direct", "test_through_a_fixture", "test_through_a_helper"}
    assert any(path.startswith("distributed/") for path, _ in spawning_tests())  # dist_common.launch, for real


def test_every_test_that_starts_a_process_is_out_of_the_fast_lane(collected_items):
    markers: dict[tuple[str, str], list[set[str]]] = {}
    for item in collected_items:
        if TESTS in item.path.parents:
            key = (item.path.relative_to(TESTS).as_posix(), getattr(item, "originalname", item.name))
            markers.setdefault(key, []).append({m.name for m in item.iter_markers()})
    checked = [key for key in spawning_tests() if key in markers]
    if not checked:
        pytest.skip("none of the tests that start a process was collected: run it with the whole tests folder")
    unmarked = [f"{path}::{name}" for path, name in checked if (path, name) not in SPAWNS_BUT_FAST
                and any(not found & LANE_MARKERS for found in markers[(path, name)])]
    assert not unmarked, (
        "these tests start a process but are in `make test-fast`: mark them @pytest.mark.slow (or distributed), "
        f"or list them in SPAWNS_BUT_FAST with the reason: {unmarked}")


def test_every_exception_still_starts_a_process():
    assert set(SPAWNS_BUT_FAST) <= set(spawning_tests()), "SPAWNS_BUT_FAST names a test that no longer starts one"
