"""Tables and plots of a side-by-side report (the dict that ``benchmarks/side_by_side.py`` writes as JSON).

Everything here reads the report only, so a saved JSON can be re-rendered::

    import json, benchmarks.report as r
    print(r.render_markdown(json.load(open("benchmarks/results/X.json"))))
"""

from __future__ import annotations

import math
from typing import Optional

MIB = 2**20
GIB = 2**30


# ----------------------------------------------------------------------------------------------------------------------
# Numbers per method
# ----------------------------------------------------------------------------------------------------------------------

def _base_parameters(results: list[dict]) -> str:
    """The model's own parameter count: a full-parameter method's total (an adapter method's includes its adapters)."""
    full = [r["params"]["total"] for r in results if r.get("family") == "full-parameter" and r.get("params")]
    if full:
        return _count(min(full))
    totals = [r["params"]["total"] for r in results if r.get("params")]
    return f"{_count(min(totals))} (with adapters)" if totals else "?"

def peak_memory_bytes(result: dict) -> Optional[int]:
    """CUDA ``max_memory_allocated`` on GPU, else the peak RSS of the training phase."""
    memory = result["memory"]
    if memory.get("cuda"):
        return memory["cuda"].get("max_allocated")
    return memory.get("peak_rss_bytes")


def memory_over_baseline(result: dict) -> Optional[int]:
    """What the floor is compared with: CUDA allocations, or peak RSS minus the RSS before the model was loaded
    (Python, torch and the tokenised data)."""
    memory = result["memory"]
    if memory.get("cuda"):
        return memory["cuda"].get("max_allocated")
    peak, base = memory.get("peak_rss_bytes"), memory.get("rss_before_model_bytes")
    return None if peak is None or base is None else peak - base


def final_eval_loss(result: dict) -> Optional[float]:
    return result["evals"][-1][1] if result.get("evals") else None


def metrics(result: dict) -> dict[str, Optional[float]]:
    """The quantities compared as ratios."""
    return {
        "step_time": result["timing"]["median_step_seconds"],
        "cpu_time": result["timing"].get("median_step_cpu_seconds"),
        "peak_memory": peak_memory_bytes(result),
        "optimizer_state": result["optimizer_state"]["max_bytes"],
        "eval_loss": final_eval_loss(result),
    }


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


# ----------------------------------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------------------------------
def _count(n: Optional[int]) -> str:
    if n is None:
        return "–"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _mib(n: Optional[float]) -> str:
    if n is None:
        return "–"
    digits = 1 if abs(n) >= 100 * MIB else 2 if abs(n) >= MIB else 3
    return f"{n / MIB:.{digits}f}"


def _gib(n: Optional[float]) -> str:
    return "–" if n is None else f"{n / GIB:.2f}"


def _x(value: Optional[float]) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.2f}×" if value >= 0.01 else f"{value:.2g}×"


def _f(value: Optional[float], digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]], align: Optional[list[str]] = None) -> list[str]:
    align = align or ["---"] + ["--:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _switch_steps(result: dict) -> list[int]:
    steps, last, out = result["steps"], None, []
    for r in steps:
        if r["active_blocks"] != last:
            out.append(r["step"])
            last = r["active_blocks"]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------------
def render_markdown(report: dict) -> str:
    """The full results page: settings, main table, ratios, eval loss by step, optimizer-state check, floors, notes."""
    preset = report["preset"]
    results = report["results"]
    ok = [r for r in results if r.get("ok")]
    by_name = {r["method"]: r for r in ok}
    first = ok[0] if ok else {}
    on_gpu = bool(first) and first.get("device") == "cuda"
    mem_label = "peak CUDA alloc. (GiB)" if on_gpu else "peak RSS (GiB)"
    machine = report["machine"]
    lines = [f"# hf-lisa benchmark: `{preset['name']}` preset on {machine['slug']}", ""]
    device_line = first.get("device_name", "?")
    if not on_gpu:
        device_line += f", {machine['cpu_cores']} cores ({first.get('threads', '?')} torch threads)"
    versions = first.get("versions", {})
    k, gamma = preset["lisa_interval_steps"], preset["lisa_activated_layers"]
    lines += [
        f"- **Command:** `{report['command']}` ({report['date']}, {report['total_seconds'] / 60:.1f} min in all)",
        f"- **Machine:** {device_line}; torch {versions.get('torch', '?')}, transformers "
        f"{versions.get('transformers', '?')}, peft {versions.get('peft', '?')}",
        f"- **Model:** {first.get('model', preset['model'])} "
        f"({preset['dtype']}{', bf16 autocast' if preset['bf16'] else ''})"
        f", {_base_parameters(ok)} parameters, "
        f"{first.get('inventory', {}).get('num_blocks', '?')} blocks",
        f"- **Data:** {first.get('data', preset['data'])}: {first.get('train_rows', '?')} training rows, "
        f"fixed eval set of {first.get('eval_rows', '?')} rows (eval loss every {preset['eval_every']} steps and at "
        "step 0)",
        f"- **Same for every method:** seed {preset['seed']}, {preset['steps']} optimizer steps, batch "
        f"{preset['batch_size']} (padded to the longest row, max_seq_length {preset['seq_len']}), AdamW, constant "
        f"learning rate: {preset['lr_full_parameter']:g} for full-parameter methods, {preset['lr_adapter']:g} for "
        f"adapters; LoRA/LISA adapters r={preset['lora_r']}, alpha={preset['lora_alpha']:g} on all linear layers",
        f"- **LISA:** γ = {gamma} blocks, K = {k} steps"
        + (f" (K = 20 is LMFlow's script default and hf-lisa's; the LISA paper's best ablation is K ≈ T/10; this "
           f"preset uses {k} so that {math.ceil(preset['steps'] / k)} active sets occur in {preset['steps']} steps)"
           if k != 20 else ""),
    ]
    applied = [r.get("cpu_allocator", {}).get("applied") for r in ok]
    trims = [r.get("cpu_allocator", {}).get("trims", 0) for r in ok]
    if any(applied):
        lines.append(f"- **CPU allocator:** {applied[0] or 'glibc defaults'} (`hf-lisa train --cpu_allocator "
                     f"{preset.get('cpu_allocator', 'lean')}`)")
    elif any(trims):
        lines.append(f"- **CPU allocator:** glibc, its heap trimmed at the start of each backward pass and before the "
                     f"embeddings' backward (`--cpu_allocator trim`; {max(trims)} trims in the longest run)")
    else:
        lines.append("- **CPU allocator:** glibc's defaults (dynamic mmap threshold; `--cpu-allocator trim` or `lean` "
                     "returns freed memory)")
    chunked = {r.get("chunked_loss") for r in ok}
    if chunked == {True}:
        lines.append("- **Loss:** the causal-LM loss chunk by chunk (`--chunked_loss`, the default)")
    elif chunked == {False}:
        lines.append("- **Loss:** transformers' causal-LM loss over the whole vocabulary at once (`--chunked_loss "
                     "false`)")
    lines += _peer_lines(ok)
    overrides = [f"`{r['method']}` " + ", ".join(f"{k}={v}" for k, v in r["training_overrides"].items())
                 for r in ok if r.get("training_overrides") and not r.get("peer")]
    if overrides:
        lines.append(f"- **Per-method training settings:** {'; '.join(overrides)}")
    if report.get("in_process"):
        lines.append("- **In-process run:** every method ran in one process, so peak memory is shared and not "
                     "comparable between methods.")
    lines.append("")

    # -- main table ----------------------------------------------------------------------------------------------------
    last_eval_step = first.get("evals", [[None]])[-1][0] if first else None
    header = ["method", "trainable params", "s/step (median)", "CPU s/step", "tokens/s", mem_label, "floor (GiB)",
              "measured / floor", "opt. state max (MiB)", "opt. state final (MiB)", f"eval loss @{last_eval_step}",
              "exact match"]
    rows = []
    for r in results:
        if not r.get("ok"):
            rows.append([f"`{r['method']}`", f"failed: {r.get('error', '?')}"] + [""] * (len(header) - 2))
            continue
        trainable = r["params"]["trainable_max"]
        share = trainable / r["params"]["total"] if r["params"]["total"] else 0
        rows.append([
            f"`{r['method']}`",
            f"{_count(trainable)} ({100 * share:.1f}%)",
            _f(r["timing"]["median_step_seconds"], 3),
            _f(r["timing"].get("median_step_cpu_seconds"), 3),
            f"{r['timing']['tokens_per_second']:.0f}",
            _gib(peak_memory_bytes(r)),
            _gib(r["floor"]["total_bytes"]),
            _x(ratio(memory_over_baseline(r), r["floor"]["total_bytes"])),
            _mib(r["optimizer_state"]["max_bytes"]),
            _mib(r["optimizer_state"]["final_bytes"]),
            _f(final_eval_loss(r)),
            _f(r.get("exact_match"), 3) if "exact_match" in r else "–",
        ])
    lines += ["## Memory, speed and quality", ""] + _table(header, rows) + [""]
    notes = [
        "trainable params: the most that train in any one step (for the LISA methods: E+H+γ blocks, or γ blocks' "
        "adapters).",
        "s/step: median over steady-state steps (the first "
        f"{preset['timing_warmup_steps']} steps and steps followed by an evaluation left out), from `on_step_begin` "
        "to `on_step_end`: forward, backward, optimizer step and any block switch. tokens/s: non-padding tokens over "
        "the same steps. CPU s/step: CPU time of all the process's threads over the same steps (median), "
        "which other load on a shared machine disturbs less than wall time.",
        ("peak CUDA alloc.: `torch.cuda.max_memory_allocated` during training." if on_gpu else
         "peak RSS: the process's peak resident memory during training (the kernel's peak mark is reset when "
         "training starts, so loading does not count); each method runs in its own process."),
        "floor: weights + gradients of the trainable set + AdamW state of the trainable set + an activation estimate "
        "(see *Theoretical floor*). measured / floor: " + (
            "peak CUDA allocation over the floor." if on_gpu else
            "(peak RSS − RSS before the model was loaded, i.e. less Python, torch and the data) over the floor."),
    ]
    if "exact_match_before" in first:
        notes.append(f"exact match: greedy generation on {preset['exact_match_samples']} held-out prompts after "
                     f"training; the untrained model scores {first['exact_match_before']:.3f}.")
    lines += [f"- {n}" for n in notes] + [""]

    # -- ratios --------------------------------------------------------------------------------------------------------
    if "lora" in by_name or "full" in by_name:
        header = ["method"]
        refs = [ref for ref in ("lora", "full") if ref in by_name]
        names = {"step_time": "step time", "cpu_time": "CPU time", "peak_memory": "peak memory",
                 "optimizer_state": "optimizer state", "eval_loss": "eval loss"}
        if on_gpu:  # host CPU time says little about a GPU step
            del names["cpu_time"]
        for key, label in names.items():
            header += [f"{label} vs {ref}" for ref in refs]
        rows = []
        for r in ok:
            m = metrics(r)
            row = [f"`{r['method']}`"]
            for key in names:
                row += [_x(ratio(m[key], metrics(by_name[ref])[key])) for ref in refs]
            rows.append(row)
        lines += ["## Ratios (lower is better everywhere)", ""] + _table(header, rows) + [""]

    # -- eval loss at equal steps --------------------------------------------------------------------------------------
    eval_steps = sorted({s for r in ok for s, _ in r["evals"]})
    if eval_steps:
        rows = []
        for r in ok:
            losses = dict((s, v) for s, v in r["evals"])
            rows.append([f"`{r['method']}`"] + [_f(losses.get(s)) for s in eval_steps])
        lines += ["## Eval loss at equal steps", ""] + _table(["method"] + [f"step {s}" for s in eval_steps], rows)
        lines += ["", f"![eval loss]({report.get('files', {}).get('eval_loss_plot', '')})", ""]

    # -- optimizer state -----------------------------------------------------------------------------------------------
    formulas = {
        "full": "every parameter",
        "lisa": "E+H+norm + γ blocks (E+H+γL)",
        "lisa-naive": "E+H+norm + every block activated so far",
        "lora": "every adapter parameter",
        "lisa-adapter": "interpolation scalars + γ blocks' adapters",
        "badam": "BAdam: the active block's AdamW state on its fp32 copy, right after its step (E+H frozen; "
                 "dropped at each switch)",
        "galore": f"GaLore: moments of the rank-{preset['lora_r']} projected gradients + the projection bases "
                  "(attention/MLP linears), AdamW moments of the rest; no step tensor",
    }
    rows = []
    for r in ok:
        steps = r["steps"]
        kind = r["state_kind"]
        state = r["optimizer_state"]
        switches = set(_switch_steps(r))
        formula_ends = [steps[0]["expected_state_bytes"]]
        if steps[-1]["expected_state_bytes"] != formula_ends[0]:
            formula_ends.append(steps[-1]["expected_state_bytes"])
        rows.append([
            f"`{r['method']}`",
            formulas.get(kind, kind) + (f"; {r['state_formula']}" if r.get("state_formula") else ""),
            " → ".join(_mib(v) for v in formula_ends),
            f"{state['steps_equal_to_formula']}/{len(steps)}",
            f"{state['max_abs_diff_from_formula']:,}",
            " → ".join(_mib(s["optimizer_state_bytes"]) for s in steps if s["step"] in switches or s is steps[-1]),
        ])
    inv = first.get("inventory", {})
    lines += ["## Optimizer state: measured against the formula from parameter shapes", ""]
    lines += _table(
        ["method", "formula (AdamW: 2 moments + 4-byte step per tensor)", "formula (MiB)", "steps equal",
         "max |measured − formula| (bytes)", "measured at each switch and at the end (MiB)"],
        rows, ["---", "---", "--:", "--:", "--:", "---"],
    )
    if inv:
        lines += [
            "",
            f"From the shapes: E+H+norm = {_count(inv['outside_base_params'])} parameters "
            f"({_mib(inv['outside_base_state_bytes'])} MiB of AdamW state), one block = {_count(inv['block_params'])} "
            f"({_mib(inv['block_state_bytes'])} MiB), so LISA's E+H+{gamma}L = "
            f"{_mib(inv['outside_base_state_bytes'] + gamma * inv['block_state_bytes'])} MiB; all "
            f"{inv['num_blocks']} blocks + E+H = "
            f"{_mib(inv['outside_base_state_bytes'] + inv['num_blocks'] * inv['block_state_bytes'])} MiB.",
        ]
    lines += ["", f"![optimizer state]({report.get('files', {}).get('optimizer_state_plot', '')})", ""]

    # -- floors --------------------------------------------------------------------------------------------------------
    rows = []
    for r in ok:
        fl = r["floor"]
        probe = fl.get("activation_probe") or {}
        rows.append([
            f"`{r['method']}`", _mib(fl["weights_bytes"]), _mib(fl["grad_bytes"]), _mib(fl["optimizer_state_bytes"]),
            _mib(fl["activation_bytes"]), _mib(fl["total_bytes"]), _mib(memory_over_baseline(r)),
            _x(ratio(memory_over_baseline(r), fl["total_bytes"])),
            (f"{_mib(probe['measured_bytes'])} / {_mib(probe['estimate_bytes'])} (step {probe['step']})"
             if probe else "–"),
        ])
    measured_label = "CUDA peak (MiB)" if on_gpu else "peak RSS − baseline (MiB)"
    lines += ["## Theoretical floor (MiB)", ""]
    lines += _table(["method", "weights", "grads", "AdamW state", "activations (est.)", "floor", measured_label,
                     "measured / floor", "saved by autograd / estimate, one step"], rows)
    if first:
        lines += ["", f"Activation estimate ({first['floor']['activation_dtype_bytes']} bytes per value), the largest "
                  f"over the run's steps: {first['floor']['activation_formula']} The last column checks it in one "
                  "step: the storages autograd saved for the backward pass (parameters excluded, shared storage "
                  "once, via `torch.autograd.graph.saved_tensors_hooks`) against the estimate for that step's batch."]
        if not on_gpu:
            baseline = first["memory"].get("rss_before_model_bytes")
            lines += ["", f"Baseline RSS before the model was loaded (Python, torch, data): {_gib(baseline)} GiB."]
    lines.append("")

    # -- where the time went -------------------------------------------------------------------------------------------
    rows = []
    for r in ok:
        t = r["timing"]
        load = t.get("load_average") or [None, None]
        rows.append([f"`{r['method']}`", _f(t["setup_seconds"], 1), _f(t["train_seconds"], 1),
                     _f(r.get("exact_match_seconds"), 1), _f(t["wall_seconds"], 1),
                     " → ".join(_f(v, 2) for v in load)])
    lines += ["## Where the time went (s)", ""]
    lines += _table(["method", "setup (freezing, sparse-mask calibration)", "training (steps + evals)",
                     "exact-match generation", "process total", "machine load average (start → end)"], rows)
    lines.append("")

    # -- findings ------------------------------------------------------------------------------------------------------
    if report.get("checks"):
        lines += ["## Checks", ""]
        for c in report["checks"]:
            verdict = {True: "**passed**", False: "**failed**"}.get(c.get("passed"), c.get("why", "not judged"))
            measured = f"measured {c['ratio']:.2f}× (at least {c['at_least']:g}× asked), " if "ratio" in c else ""
            lines.append(f"- {c['claim']}: {measured}{verdict}.")
        lines.append("")
    lines += ["## Findings (computed from this run)", ""] + [f"- {s}" for s in findings(report)] + [""]
    return "\n".join(lines)


def _peer_lines(ok: list[dict]) -> list[str]:
    """One line per peer: its package and version, the Trainer, its settings (``benchmarks/peers.py``)."""
    lines = []
    for r in ok:
        peer = r.get("peer")
        if not peer:
            continue
        settings = ", ".join(f"{k}={v}" for k, v in peer["settings"].items())
        lines.append(f"- **Peer `{r['method']}`:** {peer['package']} {peer.get('version') or '?'} in a plain "
                     f"`{peer['trainer']}`, as its docs say: {settings}")
    return lines


def findings(report: dict) -> list[str]:
    """Plain sentences on the headline comparisons, wins and losses alike."""
    ok = {r["method"]: r for r in report["results"] if r.get("ok")}
    out: list[str] = []
    lisa, lora, full, naive = (ok.get(m) for m in ("lisa", "lora", "full", "lisa-naive"))
    if lisa:
        s = lisa["optimizer_state"]
        n = len(lisa["steps"])
        out.append(
            f"`lisa` holds exactly the E+H+γL optimizer state at {s['steps_equal_to_formula']} of {n} steps "
            f"(largest difference {s['max_abs_diff_from_formula']} bytes): deactivated blocks' state is dropped."
        )
    if naive:
        steps = naive["steps"]
        line = (f"`lisa-naive`'s optimizer state grows from {_mib(steps[0]['optimizer_state_bytes'])} to "
                f"{_mib(steps[-1]['optimizer_state_bytes'])} MiB over {len(_switch_steps(naive))} active sets")
        if full:
            share = steps[-1]["optimizer_state_bytes"] / full["optimizer_state"]["max_bytes"]
            line += (f", {100 * share:.0f}% of full "
                     f"fine-tuning's {_mib(full['optimizer_state']['max_bytes'])} MiB; it reaches 100% once every "
                     "block has been sampled")
        out.append(line + ".")
    for name, ref_name in (("lisa", "lora"), ("lisa", "full"), ("lisa", "badam"), ("lisa", "galore"),
                           ("lisa-adapter", "lora"), ("lisa-fused", "lora"),
                           ("lisa-fused", "lisa"), ("lisa-adamw8bit", "lisa"), ("lisa-adamw8bit-eh", "lisa"),
                           ("lisa-fused-8bit", "lora"), ("lisa-fused-8bit", "lisa")):
        a, b = ok.get(name), ok.get(ref_name)
        if not a or not b:
            continue
        ma, mb = metrics(a), metrics(b)
        parts = []
        for key, label in (("step_time", "step time"), ("cpu_time", "CPU time per step"),
                           ("peak_memory", "peak memory"), ("optimizer_state", "optimizer state"),
                           ("eval_loss", f"eval loss at step {a['evals'][-1][0]}")):
            if key == "cpu_time" and a.get("device") == "cuda":
                continue
            rr = ratio(ma[key], mb[key])
            if rr is None:
                continue
            verdict = "better" if rr < 0.995 else "worse" if rr > 1.005 else "equal"
            parts.append(f"{label} {rr:.2f}× ({verdict})")
        out.append(f"`{name}` vs `{ref_name}`: " + ", ".join(parts) + ".")
    dense, sparse = ok.get("lisa-adapter"), ok.get("lisa-adapter-sparse")
    if dense and sparse:
        md, ms = metrics(dense), metrics(sparse)
        out.append(
            f"`lisa-adapter-sparse` vs `lisa-adapter`: step time {_x(ratio(ms['step_time'], md['step_time']))}, peak "
            f"memory {_x(ratio(ms['peak_memory'], md['peak_memory']))}. The sparse path forms M ⊙ (B A) for every "
            "adapted linear (a weight-sized product; by default it joins the base matmul, `fuse_sparse_delta`) and "
            "recomputes it in the backward pass from the packed mask instead of keeping it; the dense path is LoRA's "
            "two thin matmuls."
        )
    probes = [(r["method"], r["floor"].get("activation_probe") or {}) for r in ok.values()]
    devs = [(m, p["measured_bytes"] / p["estimate_bytes"] - 1) for m, p in probes if p.get("estimate_bytes")]
    if devs:
        worst = max(devs, key=lambda d: abs(d[1]))
        out.append(f"The activation estimate matches what autograd saved in the probed step within "
                   f"{100 * abs(worst[1]):.1f}% for every method (largest deviation: `{worst[0]}`).")
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_eval_loss(report: dict, path: str) -> str:
    """Eval loss against the optimizer step, one line per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for r in report["results"]:
        if r.get("ok") and r["evals"]:
            steps, losses = zip(*r["evals"])
            ax.plot(steps, losses, "o-", label=r["method"], markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("eval loss")
    ax.set_title(f"Eval loss ({report['preset']['name']} preset)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_optimizer_state(report: dict, path: str) -> str:
    """Optimizer-state MiB against the optimizer step (log scale), one line per method, with LISA's formula."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for r in report["results"]:
        if not r.get("ok"):
            continue
        steps = [s["step"] for s in r["steps"]]
        ax.step(steps, [s["optimizer_state_bytes"] / MIB for s in r["steps"]], where="post", label=r["method"])
        if r["method"] == "lisa":
            ax.plot(steps, [s["expected_state_bytes"] / MIB for s in r["steps"]], "k:", linewidth=1,
                    label="E+H+γL formula")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("optimizer state (MiB, log scale)")
    ax.set_title("AdamW state held after each step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
