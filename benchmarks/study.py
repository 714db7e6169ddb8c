"""The one harness of hf-lisa's training benchmarks, on the public API only; its first study: when does LISA win?

A benchmark is data: a JSON file of ``benchmarks/configs/`` (:func:`load_config`), run by this one harness
(``--config``), the way PEFT's ``method_comparison`` runs its experiment folders. Each run is one process; its record
is appended to a JSONL file as it ends, and the same command continues from the records. A config names its
protocol:

* ``study`` (the default; ``configs/study.json``, issue 37's, and ``configs/levers.json``, LISA's levers on the same
  protocol): presets, learning-rate grids, methods with their options, the memory table; a method is one of
  :data:`KINDS`, built in ``benchmarks/study_run.build``; described below.
* ``side-by-side`` (``configs/bench.json``, ``make bench``; ``configs/peers.json``, ``make bench-peers``): every
  method once under one preset, measured step by step (optimizer state against its closed form, tokens/s, peak
  memory, eval loss, exact match), in one table with ratios against LoRA and full fine-tuning
  (``benchmarks/side_by_side.py``); ``--methods`` and ``--set FIELD=VALUE`` choose methods and preset fields.

Every run is one plain ``transformers.Trainer`` in its own process, built the way a user would build it: PEFT's
``LoraConfig`` for LoRA, ``hf_lisa.trainer_callbacks.LisaCallback`` for full-parameter LISA, ``hf_lisa.LisaConfig``
with ``LisaAdapterCallback`` for the sampled LISA adapter, ``badam.BlockOptimizer``
and transformers' ``optim="galore_adamw"`` for the peers, nothing at all for full fine-tuning. Nothing here imports a
non-public name of ``hf_lisa``.

Protocol of ``configs/study.json`` (``--preset cpu``; ``--preset gpu`` is the same at 1000 steps, batch 16, 16K rows):

* the instruction task (``benchmarks/tasks.py``: 8 kinds of word-list instructions in chat form, each reply
  determined by its instruction), ``T`` = 300 steps of batch 4 (1200 rows, each seen once), 10 warmup steps then
  cosine decay; 128 held-out rows split into a *selection* half and a *report* half; the loss on the reply tokens of
  both halves at steps 30/60/120/300, greedy exact match on the report half at the end;
* each ranked method's own learning-rate grid, ×3 spaced, extended outward while its best rate (lowest selection loss
  at seed 0, step T) sits at the grid's edge, up to :data:`GRID_LIMITS`;
* then seeds 1-4 at that rate (seed 0 chose the rate and is not reported: no winner's curse), reported on the report
  half as a mean with a 95% t-interval, and the difference to LoRA paired by seed (same data order) with its interval;
* diagnostics at one seed, each at its parent's best rate: LoRA r=4 and r=128, q/v-only LoRA r=128, LISA with E+H
  frozen, LISA γ=6;
* BAdam and GaLore at their documented settings; where ``T`` is too short for them (fewer than two switches or
  projection updates) their grid runs but they are marked "not in its regime", get no reported seeds and are not
  ranked;
* the memory table (``--memory``): LoRA, LISA and full at 1024-token rows, batch 1, with and without gradient
  checkpointing: peak RSS and CPU seconds per step.

Results are appended run by run to ``benchmarks/results/study/<name>.jsonl`` (``<config>-<preset>``); running the
same command again (or with ``--resume``) plans what is still missing from what is there, so an interrupted study
continues across sessions. ``--report`` writes ``<name>.md`` from the JSONL alone.

Usage::

    python benchmarks/study.py                       # run (or continue) the CPU study, then write the report
    python benchmarks/study.py --memory              # the memory table
    python benchmarks/study.py --report              # the report from what has run
    python benchmarks/study.py --config benchmarks/configs/levers.json   # another study (make bench-levers)
    python benchmarks/study.py --config benchmarks/configs/bench.json --set eval_every=20   # side by side (make bench)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    # `python benchmarks/study.py`: make `benchmarks` importable (where the checkout is on the path already, e.g.
    # behind a folder laid out as the installed package, gpu_protocol.sh's, that order is kept)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "study"


CONFIG_DIR = Path(__file__).resolve().parent / "configs"
#: the study of issue 37; ``--config`` names another (``benchmarks/configs/``: the format is :func:`load_config`'s)
DEFAULT_CONFIG = CONFIG_DIR / "study.json"
#: the kinds of method a run can build (``benchmarks/study_run.build``)
KINDS = ("lora", "lisa", "lisa-adapter", "full", "badam", "galore")


@dataclass(frozen=True)
class Preset:
    steps: int
    batch: int
    n_train: int
    n_heldout: int  # split in two halves: selection, report
    eval_at: tuple[int, ...]
    warmup: int
    max_length: int
    seeds: tuple[int, ...]  # reported seeds (seed 0 selects the rate)
    jobs: int
    threads: int
    generate_tokens: int = 32
    model: Optional[str] = None  # None: the embedded SmolLM2-135M-Instruct


@dataclass(frozen=True)
class Method:
    """A way to train, as its own docs build it. ``grid``: the first learning rates tried; ``lr``: a fixed rate
    instead (no grid); ``parent``: a diagnostic runs once, at its parent's rate; ``min_steps``: below this T the
    method is out of its regime (not ranked)."""

    name: str
    kind: str  # one of KINDS
    grid: tuple[float, ...]
    options: tuple[tuple[str, Any], ...] = ()
    parent: Optional[str] = None
    min_steps: int = 0
    note: str = ""
    lr: Optional[float] = None

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


@dataclass(frozen=True)
class StudyConfig:
    """One study, read from a JSON file of ``benchmarks/configs/`` (:func:`load_config`)."""

    name: str  # the file's stem: results go to <name>-<preset>.jsonl ("study": study-<preset>.jsonl)
    path: str
    description: str
    presets: dict[str, Preset]
    grids: dict[str, tuple[float, ...]]
    grid_limits: tuple[float, float]
    methods: tuple[dict, ...]  # as written; "{T/10}" and "T/10" are resolved per preset by methods_for
    memory: Optional[dict]
    seeds: Optional[tuple[int, ...]] = None  # replaces every preset's reported seeds
    protocol = "study"

    def preset(self, name: str) -> Preset:
        preset = self.presets[name]
        return preset if self.seeds is None else replace(preset, seeds=self.seeds)

    def methods_for(self, steps: int) -> dict[str, Method]:
        """The methods at ``T`` = ``steps``: ``"T/10"`` (an option's value) is the LISA paper's best ablation ratio,
        K ≈ T/10, and ``{T/10}`` in a name, parent or note is that number."""
        k_long = max(steps // 10, 1)

        def resolve(value: Any) -> Any:
            if value == "T/10":
                return k_long
            return value.replace("{T/10}", str(k_long)) if isinstance(value, str) else value

        found = {}
        for spec in self.methods:
            grid = spec.get("grid")
            found[resolve(spec["name"])] = Method(
                name=resolve(spec["name"]), kind=spec["kind"],
                grid=tuple(self.grids[grid]) if isinstance(grid, str) else tuple(grid or ()),
                options=tuple((k, resolve(v)) for k, v in (spec.get("options") or {}).items()),
                parent=resolve(spec.get("parent")), min_steps=spec.get("min_steps", 0),
                note=resolve(spec.get("note", "")), lr=spec.get("lr"))
        return found

    def memory_runs(self, preset_name: str) -> list["Run"]:
        if not self.memory:
            return []
        return [Run(r["method"], r["lr"], 0, preset_name, {"max_length": self.memory["max_length"],
                                                            "gradient_checkpointing": gc})
                for r in self.memory["runs"] for gc in (False, True)]


@dataclass(frozen=True)
class SideBySideConfig:
    """A side-by-side comparison (``benchmarks/side_by_side.py``), read from its JSON file (:func:`load_config`)."""

    name: str
    path: str
    description: str
    presets: dict  # name -> benchmarks.presets.Preset
    methods: dict  # name -> benchmarks.presets.MethodSpec
    sets: dict[str, tuple[str, ...]]
    results: str  # the results' name: "{date}" and "{machine}" are filled in
    checks: tuple = ()  # claims judged from the results (benchmarks.presets.check_specs)
    protocol = "side-by-side"


#: how a config's methods are run and reported: ``study`` (grids, seeds, intervals: ``study_run``, ``study_report``)
#: or ``side-by-side`` (each method once, measured, ratios against LoRA and full: ``side_by_side``, ``report``)
PROTOCOLS = ("study", "side-by-side")
_CONFIG_KEYS = {"extends", "protocol", "description", "task", "presets", "grids", "grid_limits", "methods", "memory",
                "seeds"}
_SIDE_BY_SIDE_KEYS = {"extends", "protocol", "description", "results", "presets", "sets", "run", "methods", "checks"}
_METHOD_KEYS = {"name", "kind", "grid", "lr", "options", "parent", "min_steps", "note"}


def load_config(path: "str | Path" = DEFAULT_CONFIG) -> "StudyConfig | SideBySideConfig":
    """A study from its JSON file. ``protocol``: ``study`` (the default) or ``side-by-side`` (its keys:
    :func:`benchmarks.presets.side_by_side_settings`, and ``results``, the results' name). A study's keys:
    ``description``; ``task`` (``instructions``: the task a run trains on);
    ``presets`` (name -> :class:`Preset` fields); ``grids`` (name -> the first rates tried); ``grid_limits`` (how far
    a grid may be extended); ``methods`` (a list, in the report's order: ``name``, ``kind`` (one of :data:`KINDS`),
    ``grid`` (a grid's name or a list of rates) or ``lr`` (one fixed rate) or ``parent`` (a diagnostic: one seed at
    its parent's rate), ``options`` (the kind's settings), ``min_steps``, ``note``); ``memory`` (``{"max_length": N,
    "runs": [{"method", "lr"}, ...]}``, or null); ``seeds`` (replaces the presets' reported seeds); ``extends`` (a
    config file beside this one whose keys this file's replace). A wrong key or value is refused, naming it."""
    path = Path(path)

    def fail(message: str) -> None:
        raise ValueError(f"{path}: {message}")

    raw = _raw_config(path)  # its "extends" chain merged: a file's keys replace its base's
    if not isinstance(raw, dict):
        fail("a study config is a JSON object")
    protocol = raw.get("protocol", "study")
    if protocol not in PROTOCOLS:
        fail(f"protocol={protocol!r} is invalid; allowed: {', '.join(PROTOCOLS)}")
    if protocol == "side-by-side":
        return _side_by_side_config(path, raw)
    unknown = sorted(set(raw) - _CONFIG_KEYS)
    if unknown:
        fail(f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_CONFIG_KEYS))}")
    for key in ("presets", "grids", "grid_limits", "methods"):
        if key not in raw:
            fail(f"{key!r} is missing")
    if raw.get("task", "instructions") != "instructions":
        fail(f"task={raw['task']!r} is invalid; allowed: instructions")
    presets = {}
    for name, fields in raw["presets"].items():
        try:
            presets[name] = Preset(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
        except TypeError as err:
            fail(f"presets.{name}: {err}")
    methods = raw["methods"]
    names = [m.get("name") for m in methods]
    for spec in methods:
        where = f"methods[{spec.get('name', '?')}]"
        bad = sorted(set(spec) - _METHOD_KEYS)
        if bad:
            fail(f"{where}: unknown key(s) {', '.join(bad)}; allowed: {', '.join(sorted(_METHOD_KEYS))}")
        if spec.get("kind") not in KINDS:
            fail(f"{where}.kind={spec.get('kind')!r} is invalid; allowed: {', '.join(KINDS)}")
        how = [k for k in ("grid", "lr", "parent") if spec.get(k) is not None]
        if len(how) != 1:
            fail(f"{where}: give exactly one of grid, lr, parent (given: {', '.join(how) or 'none'})")
        if isinstance(spec.get("grid"), str) and spec["grid"] not in raw["grids"]:
            fail(f"{where}.grid={spec['grid']!r} is invalid; allowed: {', '.join(raw['grids'])} or a list of rates")
        if spec.get("parent") is not None and spec["parent"] not in names:
            fail(f"{where}.parent={spec['parent']!r} is invalid; allowed: a method of this config")
    if len(set(names)) != len(names):
        fail(f"method names repeat: {names}")
    seeds = raw.get("seeds")
    return StudyConfig(name=path.stem, path=str(path), description=raw.get("description", ""), presets=presets,
                       grids={k: tuple(v) for k, v in raw["grids"].items()}, grid_limits=tuple(raw["grid_limits"]),
                       methods=tuple(methods), memory=raw.get("memory"),
                       seeds=None if seeds is None else tuple(seeds))


def _raw_config(path: Path, seen: tuple = ()) -> dict:
    """A config file's JSON with its ``extends`` chain merged (a file's keys replace its base's)."""
    if path.resolve() in seen:
        raise ValueError(f"{path}: 'extends' runs in a circle ({' -> '.join(map(str, seen))})")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON study config ({err})") from err
    if isinstance(raw, dict) and "extends" in raw:
        base = _raw_config(path.parent / raw["extends"], (*seen, path.resolve()))
        raw = {**base, **{k: v for k, v in raw.items() if k != "extends"}}
    return raw


def _side_by_side_config(path: Path, raw: dict) -> SideBySideConfig:
    from benchmarks.presets import side_by_side_settings

    unknown = sorted(set(raw) - _SIDE_BY_SIDE_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(sorted(_SIDE_BY_SIDE_KEYS))}")
    presets, methods, sets = side_by_side_settings(raw, str(path))
    return SideBySideConfig(name=path.stem, path=str(path), description=raw.get("description", ""), presets=presets,
                            methods=methods, sets=sets, results=raw.get("results", "{date}-{machine}-" + path.stem),
                            checks=tuple(raw.get("checks") or ()))


#: the study of issue 37 (``benchmarks/configs/study.json``): the defaults of the functions below
CONFIG = load_config()
PRESETS = CONFIG.presets
GRID_LIMITS = CONFIG.grid_limits


def methods_for(steps: int, config: StudyConfig = CONFIG) -> dict[str, Method]:
    return config.methods_for(steps)


@dataclass(frozen=True)
class Run:
    method: str
    lr: float
    seed: int
    preset: str
    memory: Optional[dict] = None  # the memory table's runs: {"max_length": 1024, "gradient_checkpointing": bool}

    @property
    def key(self) -> str:
        extra = "" if self.memory is None else f"|mem{self.memory['max_length']}-gc{int(self.memory['gradient_checkpointing'])}"
        return f"{self.preset}|{self.method}|{self.lr:g}|{self.seed}{extra}"


# ----------------------------------------------------------------------------------------------------------------------
# Planning: what is still missing, from what is there
# ----------------------------------------------------------------------------------------------------------------------
#: a run whose failure is the machine's, not the method's (a broken pipe when the parent restarts, a full disk, a kill
#: by signal), is recorded with ``"infrastructure": true``: it is no result, so it is planned again, at most this many
#: times (then it is left out, and named, so that a persistent failure cannot loop forever)
INFRASTRUCTURE_RETRIES = 2


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_results(path: Path) -> dict[str, dict]:
    """The results by run key; the infrastructure failures are not results (see :data:`INFRASTRUCTURE_RETRIES`)."""
    return {record["key"]: record for record in _records(path) if not record.get("infrastructure")}


def infrastructure_failures(path: Path) -> dict[str, int]:
    """How often each run key failed for the machine's reasons."""
    counts: dict[str, int] = {}
    for record in _records(path):
        if record.get("infrastructure"):
            counts[record["key"]] = counts.get(record["key"], 0) + 1
    return counts


def selection_loss(record: Optional[dict]) -> float:
    """The rate-selection criterion: loss on the selection half at the last step (inf for a failed or diverged run)."""
    if record is None or record.get("error"):
        return math.inf
    value = record["evals"][-1]["selection_loss"]
    return value if math.isfinite(value) else math.inf


def grid_state(method: Method, preset: str, results: dict[str, dict],
               limits: tuple[float, float] = GRID_LIMITS) -> tuple[list[float], Optional[float]]:
    """``(rates still to run at seed 0, best rate or None while undecided)`` for a ranked method's grid (a method
    with a fixed ``lr`` is decided at it)."""
    if method.lr is not None:
        return [], method.lr
    rates = list(method.grid)
    while True:
        missing = [lr for lr in rates if Run(method.name, lr, 0, preset).key not in results]
        if missing:
            return missing, None
        losses = {lr: selection_loss(results[Run(method.name, lr, 0, preset).key]) for lr in rates}
        best = min(rates, key=lambda lr: losses[lr])
        if not math.isfinite(losses[best]):  # every rate failed or diverged: nothing to choose, said in the report
            return [], None
        if best == rates[0] and _ladder(rates[0], up=False) >= limits[0] * 0.99:
            rates.insert(0, _ladder(rates[0], up=False))
        elif best == rates[-1] and _ladder(rates[-1], up=True) <= limits[1] * 1.01:
            rates.append(_ladder(rates[-1], up=True))
        else:
            return [], best


def _ladder(lr: float, up: bool) -> float:
    """The next rate of the ×3-spaced ladder 1, 3, 10, 30, ... × 10^k above (or below) ``lr``."""
    exponent = math.floor(math.log10(lr) + 1e-9)
    mantissa = round(lr / 10 ** exponent)
    if up:
        return float(f"{3 if mantissa == 1 else 1}e{exponent if mantissa == 1 else exponent + 1}")
    return float(f"{1 if mantissa == 3 else 3}e{exponent if mantissa == 3 else exponent - 1}")


def plan(preset_name: str, results: dict[str, dict], config: StudyConfig = CONFIG) -> list[Run]:
    """The runs that can start now, in the order they run: the diagnostics of every decided method, then its seeds,
    then the grids still open. A decided method's comparisons (r=4 against r=128, its interval against LoRA's) can
    then be answered while other grids are still running; the total is the same in any order."""
    preset = config.preset(preset_name)
    methods = config.methods_for(preset.steps)
    grids: list[Run] = []
    best: dict[str, Optional[float]] = {}
    for m in methods.values():
        if m.parent is None:
            missing, best[m.name] = grid_state(m, preset_name, results, config.grid_limits)
            grids += [Run(m.name, lr, 0, preset_name) for lr in missing]
    diagnostics = [Run(m.name, best[m.parent], 0, preset_name) for m in methods.values()
                   if m.parent is not None and best.get(m.parent) is not None]
    # a method out of its regime at this T (fewer than two of its switches or projection updates) is not ranked:
    # its grid runs, for the record, but no reported seeds
    seeds = [Run(m.name, best[m.name], s, preset_name) for m in methods.values()
             if m.parent is None and best[m.name] is not None and preset.steps >= m.min_steps for s in preset.seeds]
    return [run for run in diagnostics + seeds + grids if run.key not in results]


def memory_runs(preset_name: str, config: StudyConfig = CONFIG) -> list[Run]:
    return config.memory_runs(preset_name)


# ----------------------------------------------------------------------------------------------------------------------
# Running: each run in its own process, its record appended under a lock
# ----------------------------------------------------------------------------------------------------------------------
def append_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
        fcntl.flock(f, fcntl.LOCK_UN)


def launch(run: Run, out: Path, model: Optional[str], threads: Optional[int],
           config: "StudyConfig | SideBySideConfig" = CONFIG, extra_args: tuple[str, ...] = (), echo: bool = False) -> None:
    """Run ``run`` in a child process (``study.py --run-one``), which records it in ``out``; a child that ends without
    a record of its own (a crash, a kill) is recorded here. ``echo``: the child's output goes to stderr as it comes
    (the side-by-side protocol), else to a file, kept in the record of a crash (the study)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [sys.executable, str(Path(__file__).resolve()), "--run-one", json.dumps(asdict(run)), "--out", str(out),
               "--config", config.path, "--preset", run.preset, *extra_args]
    if model:
        command += ["--model", model]
    records_before = len(_records(out))
    started = time.time()
    if echo:
        completed = subprocess.run(command, env=env, stdout=sys.stderr, stderr=sys.stderr)
        output = ""
    else:  # the child's output goes to a file, not a pipe: a run outlives its parent's restart (a pipe would break)
        with tempfile.TemporaryFile("w+") as log:
            completed = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            log.seek(0)
            output = log.read()
    recorded = any(record["key"] == run.key for record in _records(out)[records_before:])
    if not recorded:  # the child records its own results and failures; this covers a crash
        record = {"key": run.key, "run": asdict(run), "method": run.method, "ok": False,
                  "error": output[-2000:] or f"the run exited with code {completed.returncode} and wrote no record",
                  "returncode": completed.returncode, "wall_s": time.time() - started}
        if completed.returncode < 0:  # killed by a signal (the session ending, a kill): the machine's, run again
            record.update(infrastructure=True, error=f"killed by signal {-completed.returncode}; " + output[-1800:])
        append_record(out, record)  # an exit status without a record of the child's own: a failed run, a result
    print(f"[study] {run.key}: exit {completed.returncode} after {time.time() - started:.0f} s", flush=True,
          file=sys.stderr if echo else sys.stdout)


def study(preset_name: str, out: Path, model: Optional[str], budget_min: Optional[float], jobs: int,
          memory: bool, config: StudyConfig = CONFIG) -> None:
    preset = config.preset(preset_name)
    deadline = None if budget_min is None else time.time() + 60 * budget_min
    running: dict[Future, str] = {}  # a run starts as soon as a slot frees, planned from the results then recorded
    with ThreadPoolExecutor(jobs) as pool:
        while True:
            results = read_results(out)
            todo = ([r for r in config.memory_runs(preset_name) if r.key not in results] if memory
                    else plan(preset_name, results, config))
            failures = infrastructure_failures(out)
            given_up = [r.key for r in todo if failures.get(r.key, 0) > INFRASTRUCTURE_RETRIES]
            if given_up and not running:
                print(f"[study] left out after {INFRASTRUCTURE_RETRIES + 1} failures of the machine's kind (see "
                      f"their records in {out}): {', '.join(given_up)}", flush=True)
            todo = [r for r in todo if r.key not in given_up and r.key not in running.values()]
            if not todo and not running:
                print(f"[study] nothing left to run in {out}", flush=True)
                return
            out_of_time = deadline is not None and time.time() > deadline
            if out_of_time and not running:
                print(f"[study] budget reached; {len(todo)} run(s) planned, not started", flush=True)
                return
            while todo and len(running) < jobs and not out_of_time:
                run = todo.pop(0)
                running[pool.submit(launch, run, out, model or preset.model, preset.threads, config)] = run.key
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                running.pop(future)
                future.result()


def parse_settings(values: list[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` pairs: a value is read as JSON (``20``, ``true``, ``1e-4``), else as a string."""
    settings = {}
    for item in values:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise ValueError(f"--set {item!r} is invalid; allowed: FIELD=VALUE, a field of the preset")
        try:
            settings[field] = json.loads(value)
        except json.JSONDecodeError:
            settings[field] = value
    return settings


def main(argv: Optional[list[str]] = None) -> Optional[dict]:
    """Run (or continue) a config's runs and write its report; the side-by-side protocol returns its report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="benchmarks/study.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="the study's JSON file (default: benchmarks/configs/study.json; see load_config)")
    parser.add_argument("--preset", default=None,
                        help="a preset of the config (study.json: cpu, gpu, tiny; bench.json: cpu-small, gpu); "
                        "default: the config's first")
    parser.add_argument("--name", default=None, help="results file stem (default: <config name>-<preset>; "
                        "side-by-side: the config's 'results', e.g. <date>-<machine>)")
    parser.add_argument("--results-dir", default=None,
                        help="where results go (default: benchmarks/results/study, side-by-side: benchmarks/results)")
    parser.add_argument("--model", default=None, help="a local model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: the preset's)")
    parser.add_argument("--budget-min", type=float, default=None, help="start no run after this many minutes")
    parser.add_argument("--memory", action="store_true", help="the memory table instead of the study")
    parser.add_argument("--report", action="store_true", help="only write the report from the results so far")
    parser.add_argument("--resume", action="store_true", help="accepted for clarity: every run continues the file")
    parser.add_argument("--methods", default=None,
                        help="side-by-side: comma-separated methods of the config, or one of its sets (default: its "
                        "'run' set)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="settings",
                        help="side-by-side: a preset field for every method, e.g. --set steps=20 "
                        "--set data=train.jsonl "
                        "(repeatable; fields: benchmarks/presets.py Preset)")
    parser.add_argument("--in-process", action="store_true",
                        help="side-by-side: every method in this process (fast start; peak memory is then shared)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, and run nothing")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--exact-match-before", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        config = CONFIG if Path(args.config).resolve() == DEFAULT_CONFIG else load_config(args.config)
    except ValueError as err:
        parser.error(f"--config: {err}")
    preset_name = args.preset or next(iter(config.presets))
    if preset_name not in config.presets:
        parser.error(f"--preset={preset_name!r} is invalid; allowed: {', '.join(sorted(config.presets))} "
                     f"(the presets of {config.path})")
    if config.protocol == "side-by-side":
        given = [flag for flag, value in (("--memory", args.memory), ("--jobs", args.jobs), ("--report", args.report))
                 if value]
        if given:
            parser.error(f"{', '.join(given)}: not an option of the side-by-side protocol ({config.path}); it runs "
                         "one method at a time and writes its report at the end")
        from benchmarks import side_by_side

        try:
            settings = parse_settings(args.settings)
            if args.run_one:
                preset = side_by_side.resolve_preset(config, preset_name, settings, args.model)
                record = side_by_side.run_one(Run(**json.loads(args.run_one)), Path(args.out), config, preset,
                                              args.exact_match_before)
                sys.exit(0 if record["ok"] else 1)
            return side_by_side.run_protocol(
                config, preset_name, settings, args.model, args.methods, Path(args.results_dir or RESULTS_DIR.parent),
                args.name, args.in_process, args.budget_min, "python benchmarks/study.py " + " ".join(argv),
                dry_run=args.dry_run)
        except ValueError as err:
            parser.error(str(err))
    given = [flag for flag, value in (("--methods", args.methods), ("--set", args.settings),
                                      ("--in-process", args.in_process)) if value]
    if given:
        parser.error(f"{', '.join(given)}: options of the side-by-side protocol; {config.path} is a study (its "
                     "methods and presets are the config's)")
    if args.memory and not config.memory:
        parser.error(f"--memory: {config.path} has no memory table")
    if args.run_one:
        from benchmarks.study_run import run_one

        run = json.loads(args.run_one)
        run_one(Run(**run), Path(args.out), args.model, config)
        return None
    name = args.name or f"{config.name}-{preset_name}"
    directory = Path(args.results_dir or RESULTS_DIR)
    out = directory / (f"{name}-memory.jsonl" if args.memory else f"{name}.jsonl")
    if args.dry_run:
        results = read_results(out)
        todo = ([r for r in config.memory_runs(preset_name) if r.key not in results] if args.memory
                else plan(preset_name, results, config))
        print(f"{len(todo)} run(s) can start now ({len(results)} recorded in {out}); more are planned as grids "
              "decide:\n" + "\n".join(f"  {r.key}" for r in todo))
        return None
    if not args.report:
        study(preset_name, out, args.model, args.budget_min, args.jobs or config.preset(preset_name).jobs,
              args.memory, config)
    from benchmarks.study_report import write_report

    report = write_report(directory, name, preset_name, config)
    print(f"[study] wrote {report}", flush=True)
    return None


if __name__ == "__main__":
    report = main()
    if report is not None:
        from benchmarks.side_by_side import exit_status

        sys.exit(exit_status(report))
