"""The scaling preset's report: the markdown tables, where the ratios cross 1, and the ratio plots
(``benchmarks/scaling.py`` writes them; any saved ``<date>-scaling.json`` can be re-rendered with these)."""

from __future__ import annotations

import statistics
from typing import Optional

GIB = 2**30
#: the ratios reported: (label, numerator, denominator, quantity)
RATIOS = (
    ("LISA/LoRA peak memory", "lisa", "lora", "peak_bytes"),
    ("LISA/LoRA s/step", "lisa", "lora", "median_step_seconds"),
    ("LISA/LoRA CPU s/step", "lisa", "lora", "median_step_cpu_seconds"),
    ("LISA/full peak memory", "lisa", "full", "peak_bytes"),
    ("LISA/full s/step", "lisa", "full", "median_step_seconds"),
    ("LISA/full CPU s/step", "lisa", "full", "median_step_cpu_seconds"),
)


def _index(report: dict) -> dict[tuple, dict]:
    return {(c["shape"], c["seq_len"], c["method"]): c for c in report.get("cells", [])}


def _params(report: dict, shape: str) -> Optional[int]:
    """The base model's parameter count, from the shape's config (:func:`benchmarks.theory.config_shapes`)."""
    from transformers import LlamaConfig

    from benchmarks.theory import config_shapes

    config = report.get("shapes", {}).get(shape)
    return config_shapes(LlamaConfig(**config)).total_params if config else None


def ratio(report: dict, shape: str, seq_len: int, num: str, den: str, quantity: str) -> Optional[float]:
    """Measured ``num``/``den`` of ``quantity`` in one cell of the grid; ``None`` unless both ran."""
    cells = _index(report)
    a, b = cells.get((shape, seq_len, num)), cells.get((shape, seq_len, den))
    if not a or not b or a.get("status") != "ok" or b.get("status") != "ok" or not b.get(quantity):
        return None
    return a[quantity] / b[quantity]


def peak_ratio_bound(report: dict, shape: str, seq_len: int, num: str, den: str) -> Optional[tuple[str, float]]:
    """Where one side of a peak-memory ratio stopped before finishing (aborted or timed out) after the other ran:
    its peak is at least what it reached, so the ratio is bounded. ``("<", r)`` or ``(">", r)``, else ``None``."""
    cells = _index(report)
    a, b = cells.get((shape, seq_len, num)), cells.get((shape, seq_len, den))
    stopped = ("aborted", "timed-out")
    if not a or not b:
        return None
    if a.get("status") == "ok" and b.get("status") in stopped and b.get("peak_bytes_seen"):
        return "<", a["peak_bytes"] / b["peak_bytes_seen"]
    if b.get("status") == "ok" and a.get("status") in stopped and a.get("peak_bytes_seen"):
        return ">", a["peak_bytes_seen"] / b["peak_bytes"]
    return None


def floor_ratio(report: dict, shape: str, seq_len: int, num: str, den: str) -> Optional[float]:
    """``num``/``den`` of the theoretical floors (known for every cell, run or not)."""
    cells = _index(report)
    a, b = cells.get((shape, seq_len, num)), cells.get((shape, seq_len, den))
    if not a or not b or not a.get("floor") or not b.get("floor"):
        return None
    return a["floor"]["total_bytes"] / b["floor"]["total_bytes"]


def _side(value: float) -> str:
    return "above" if value > 1 else "below"


def _crossing(points: list[tuple[str, float]]) -> str:
    """'below 1 throughout' or where the sign of (value - 1) changes along ``points``."""
    if not points:
        return "not measured"
    listed = ", ".join(f"{x}: {v:.2f}" for x, v in points)
    changes = [f"between {a} and {b}" for (a, va), (b, vb) in zip(points, points[1:]) if (va > 1) != (vb > 1)]
    if not changes:
        return f"{_side(points[0][1])} 1 throughout ({listed})"
    return f"crosses 1 {' and '.join(changes)} ({listed})"


def crossings(report: dict) -> list[str]:
    """One line per ratio and model (along row length) and per ratio and row length (along parameter count)."""
    shapes, seq_lens = list(report.get("shapes", {})), report.get("seq_lens", [])
    lines = []
    for label, num, den, quantity in RATIOS:
        lines.append(f"- **{label}**")
        for shape in shapes:
            points = [(str(n), r) for n in seq_lens if (r := ratio(report, shape, n, num, den, quantity)) is not None]
            lines.append(f"  - {shape}, along row length: {_crossing(points)}")
        if len(shapes) > 1:
            for n in seq_lens:
                points = [(s, r) for s in shapes if (r := ratio(report, s, n, num, den, quantity)) is not None]
                lines.append(f"  - rows of {n}, along parameter count: {_crossing(points)}")
        if quantity == "peak_bytes":
            floors = [(f"{s} x {n}", r) for s in shapes for n in seq_lens
                      if (r := floor_ratio(report, s, n, num, den)) is not None]
            if floors:
                low, high = min(floors, key=lambda p: p[1]), max(floors, key=lambda p: p[1])
                lines.append(f"  - theoretical floors: {low[1]:.2f} ({low[0]}) to {high[1]:.2f} ({high[0]})")
            for s in shapes:
                for n in seq_lens:
                    if ratio(report, s, n, num, den, quantity) is None and (
                            bound := peak_ratio_bound(report, s, n, num, den)):
                        stopped = den if bound[0] == "<" else num
                        lines.append(f"  - {s} x {n}: {bound[0]} {bound[1]:.2f}, from the peak {stopped} reached "
                                     "before it was stopped (its own peak is at least that)")
    return lines


def _cell_text(cell: Optional[dict]) -> str:
    if cell is None:
        return "–"
    if cell.get("status") == "ok":
        cpu = cell.get("median_step_cpu_seconds")
        return (f"{cell['peak_bytes'] / GIB:.2f} GiB, {cell['median_step_seconds']:.1f} s"
                + (f" (CPU {cpu:.1f} s)" if cpu is not None and cell.get("device") == "cpu" else ""))
    text = cell.get("reason", cell.get("status", "?"))
    seconds = cell.get("step_seconds") or []
    if cell.get("status") in ("timed-out", "aborted") and cell.get("peak_bytes_seen"):
        text += f"; {cell['peak_bytes_seen'] / GIB:.2f} GiB peak so far"
    if len(seconds) > 1:
        text += f"; {statistics.median(seconds[1:]):.0f} s/step after warm-up"
    return text


def _ratio_text(report: dict, shape: str, n: int, num: str, den: str, quantity: str) -> str:
    """A memory ratio with the floors' ratio beside it, or a wall-time ratio with the CPU-time ratio (CPU runs)."""
    measured = ratio(report, shape, n, num, den, quantity)
    text = "–" if measured is None else f"{measured:.2f}"
    bound = peak_ratio_bound(report, shape, n, num, den) if quantity == "peak_bytes" and measured is None else None
    if bound is not None:
        text = f"{bound[0]} {bound[1]:.2f}"
    if quantity == "peak_bytes":
        floor = floor_ratio(report, shape, n, num, den)
        if floor is not None:
            text += f" (floor {floor:.2f})"
    elif report.get("settings", {}).get("device") == "cpu":
        cpu = ratio(report, shape, n, num, den, "median_step_cpu_seconds")
        if cpu is not None:
            text += f" (CPU {cpu:.2f})"
    return text


def render_markdown(report: dict) -> str:
    """The results as markdown: the grid with ratios, the floor check, where the ratios cross 1."""
    s = report.get("settings", {})
    cells = _index(report)
    shapes, seq_lens, methods = list(report.get("shapes", {})), report.get("seq_lens", []), report.get("methods", [])
    machine = report.get("machine", {})
    device = next((c.get("device_name") or c.get("device") for c in report.get("cells", []) if c.get("status") == "ok"),
                  "?")
    precision = "bf16 autocast (fp32 weights)" if s.get("bf16") else "fp32"
    lines = [
        "# Scaling: full fine-tuning, LoRA and LISA over model shape and row length",
        "",
        f"{report.get('date', '')}, "
        + " then ".join(f"`{c}`" for c in report.get("commands") or [report.get("command", "")]) + "; "
        + (f"GPU {machine['gpu']} ({machine.get('gpu_memory_limit_gib', 0):.0f} GiB usable)" if machine.get("gpu")
           else f"{machine.get('cpu_cores', '?')} CPU cores, {machine.get('memory_gib', '?')} GiB")
        + f"; device {s.get('device', '?')} ({device}), {precision}; runtime {report.get('total_seconds', 0) / 60:.1f}"
        " min.",
        "",
        f"Random-initialised SmolLM2 shapes (`LlamaForCausalLM` from the config, tied E/H, vocabulary 49152); "
        f"{s.get('batch_size', 1)} row of random tokens per step (no padding); {s.get('steps')} AdamW steps per cell, "
        f"the first a warm-up, s/step the median of the others; constant LR {s.get('lr_full_parameter')} "
        f"(full, LISA) and {s.get('lr_adapter')} (LoRA r={s.get('lora_r')}, alpha={s.get('lora_alpha')}, all "
        f"linear layers); LISA: E+H+final norm + γ={s.get('lisa_activated_layers')} blocks through `LisaCallback`, "
        f"K={s.get('lisa_interval_steps')} (no switch inside a cell); "
        + ("the loss chunk by chunk (`--chunked_loss`, hf-lisa train's default). " if s.get("chunked_loss") else
           "transformers' loss over the whole vocabulary at once (measured before `--chunked_loss` existed, or with "
           "it off). ")
        + "Peak = the cell's process RSS during training "
        "(reset when training starts; includes Python/torch and the weights), or CUDA max allocated on a GPU. "
        + ("Cells ran in one process: their peaks overlap." if report.get("in_process") and s.get("device") == "cpu"
           else "Each cell in a fresh process." if not report.get("in_process") else "Cells ran in one process."),
        "",
        "| model | params | row | " + " | ".join(methods) + " | LISA/LoRA memory | LISA/LoRA time | LISA/full memory "
        "| LISA/full time |",
        "|---|---:|---:|" + "---|" * len(methods) + "---:|---:|---:|---:|",
    ]
    for shape in shapes:
        params = _params(report, shape)
        for n in seq_lens:
            row = [shape, f"{params / 1e6:.0f}M" if params else "?", str(n)]
            row += [_cell_text(cells.get((shape, n, m))) for m in methods]
            row += [_ratio_text(report, shape, n, "lisa", den, q) for den in ("lora", "full")
                    for q in ("peak_bytes", "median_step_seconds")]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Cells give peak memory and s/step (wall; on a CPU also the process's CPU time per step). Ratios "
              "are measured; in brackets the floors' ratio (memory) or the CPU-time ratio (time). "
              "'does not fit' cells were not run: their floor alone exceeds the limit.", "",
              "## Where the ratios cross 1", ""] + crossings(report)
    lines += ["", "## Theoretical floor against the measurement", "",
              "Floor = weights + gradients of the trainable set + AdamW state + saved activations "
              "(`benchmarks/theory.py`, `config_floor`, from the config alone). 'Above start' is the peak minus the "
              "process's RSS before the model was built (on a GPU: minus what was allocated before it). "
              "Activations: bytes autograd saved in step 1 (`saved_tensors_hooks`) against the estimate. CPU s/step: "
              "the process's CPU time per step (less sensitive than wall time to other load); load average: the "
              "machine's 1-minute load when the cell started and ended.", "",
              "| model | row | method | floor | weights + grads + state | activations (est.) | peak | above start "
              "| above start / floor | saved activations measured / est. | optimizer state = formula | s/step "
              "| CPU s/step | tokens/s | load average |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for shape in shapes:
        for n in seq_lens:
            for m in methods:
                c = cells.get((shape, n, m))
                if not c or not c.get("floor"):
                    continue
                f = c["floor"]
                static = f["weights_bytes"] + f["grad_bytes"] + f["optimizer_state_bytes"]
                row = [shape, str(n), m, f"{f['total_bytes'] / GIB:.2f}", f"{static / GIB:.2f}",
                       f"{f['activation_bytes'] / GIB:.2f}"]
                if c.get("status") == "ok":
                    start = c.get("rss_before_model_bytes") if c["device"] == "cpu" else \
                        c.get("cuda_allocated_at_start_bytes")
                    above = c["peak_bytes"] - (start or 0)
                    probe = c.get("activation_probe") or {}
                    reserved = (c.get("cuda_peak") or {}).get("max_reserved")
                    peak = f"{c['peak_bytes'] / GIB:.2f}" + (f" ({reserved / GIB:.2f} reserved)" if reserved else "")
                    row += [peak, f"{above / GIB:.2f}", f"{above / f['total_bytes']:.2f}",
                            f"{probe['measured_bytes'] / probe['estimate_bytes']:.3f}" if probe else "–",
                            "yes" if c["optimizer_state_bytes"] == c["expected_state_bytes"] else
                            f"no ({c['optimizer_state_bytes']} vs {c['expected_state_bytes']})",
                            f"{c['median_step_seconds']:.2f}", f"{c.get('median_step_cpu_seconds', float('nan')):.2f}",
                            f"{c.get('tokens_per_second', float('nan')):,.0f}",
                            " → ".join(str(v) for v in c.get("load_average") or [])]
                else:
                    row += ["–", "–", "–", "–", c.get("status", "?"), "–", "–", "–", "–"]
                lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Sizes in GiB. Every number of every cell (per-step times, losses, tokens/s) is in the JSON."]
    return "\n".join(lines) + "\n"


def plot_ratios(report: dict, path: str) -> None:
    """Four panels: LISA/LoRA and LISA/full peak memory and s/step, against parameter count and row length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, seq_lens = list(report.get("shapes", {})), report.get("seq_lens", [])
    quantities = [("peak_bytes", "peak memory"), ("median_step_seconds", "s/step")]
    if report.get("settings", {}).get("device") == "cpu":
        quantities.append(("median_step_cpu_seconds", "CPU s/step"))
    fig, axes = plt.subplots(len(quantities), 2, figsize=(12, 4 * len(quantities)), squeeze=False)
    styles = {"lora": ("-", "o"), "full": ("--", "s")}
    for row, (quantity, what) in enumerate(quantities):
        for col, along in ((0, "params"), (1, "seq_len")):
            ax = axes[row][col]
            for label, num, den, q in RATIOS:
                if q != quantity:
                    continue
                line, marker = styles[den]
                series = seq_lens if along == "params" else shapes
                for key in series:
                    xs, ys, fx, fy = [], [], [], []
                    for point in (shapes if along == "params" else seq_lens):
                        shape, n = (point, key) if along == "params" else (key, point)
                        x = _params(report, shape) if along == "params" else n
                        r = ratio(report, shape, n, num, den, quantity)
                        if r is not None and x:
                            xs.append(x)
                            ys.append(r)
                        fr = floor_ratio(report, shape, n, num, den) if quantity == "peak_bytes" else None
                        if fr is not None and x:
                            fx.append(x)
                            fy.append(fr)
                    name = f"{label.split(' ')[0]}, {key if along == 'seq_len' else f'row {key}'}"
                    if xs:
                        drawn = ax.plot(xs, ys, line, marker=marker, label=name)[0]
                        if fx:
                            ax.plot(fx, fy, ":", color=drawn.get_color(), alpha=0.6)
                    elif fx:
                        ax.plot(fx, fy, ":", marker=marker, alpha=0.6, label=f"{name} (floor only)")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2 if along == "seq_len" else 10)
            ax.set_xlabel("parameters" if along == "params" else "row length (tokens)")
            ax.set_ylabel(f"{what} ratio")
            ax.set_title(f"{what} ratio vs {'parameter count' if along == 'params' else 'row length'}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("LISA / LoRA (solid) and LISA / full (dashed); dotted: theoretical floors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
