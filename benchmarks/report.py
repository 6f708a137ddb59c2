"""The markdown report and PNG plots of a results file: a pure function of the JSON.

``render_files("benchmarks/results/h200-2026-12-03.json")`` writes ``h200-2026-12-03.md`` next to it and the
plots into ``h200-2026-12-03-plots/`` (one PNG per kernel: time and memory against each swept size, one line
per provider; one for the end-to-end training steps). ``python -m benchmarks render <json>`` does the same.
"""

from __future__ import annotations

import json
import os
import re

PROVIDER_ORDER = ("liger_torch", "liger_torch_copy", "liger_jax", "torch_eager", "torch_compile", "liger_kernel",
                  "cut_cross_entropy", "xla", "hf_eager", "hf+liger_torch", "hf+liger_kernel", "flax_xla",
                  "flax+liger_jax")
STATUS_TEXT = {"oom": "OOM", "error": "error", "unavailable": "n/a", "skipped": "skipped"}
# providers that are "ours" and the baseline they are compared with, for the summary lines
BASELINES = {"torch": ("liger_torch", "torch_eager"), "jax": ("liger_jax", "xla")}


def _order(names) -> list[str]:
    names = list(dict.fromkeys(names))
    known = [n for n in PROVIDER_ORDER if n in names]
    return known + sorted(n for n in names if n not in PROVIDER_ORDER)


def _kind(p: dict) -> str:
    return p.get("kind") or "kernel"


def params_of(p: dict) -> dict:
    """A point's named sizes; for files written before points carried them, parsed from the shape label
    (``16384x4096`` -> d0, d1; ``B4 T4096 H32/8 D128`` -> B, T, H, D)."""
    if p.get("params"):
        return p["params"]
    shape = str(p.get("shape", ""))
    if re.fullmatch(r"\d+(x\d+)*", shape):
        return {f"d{i}": int(v) for i, v in enumerate(shape.split("x"))}
    return {k: int(v) for k, v in re.findall(r"([A-Za-z]+)(\d+)", shape)}


def _cell_status(p: dict | None) -> str | None:
    if p is None:
        return ""
    if p.get("status") != "ok":
        return STATUS_TEXT.get(p.get("status"), str(p.get("status")))
    return None


def _fmt_ms(v: float) -> str:
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}" if v < 100 else f"{v:.1f}"


def _fmt_mb(v) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 10 else f"{v:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


# ---------------------------------------------------------------------------------------------------------
# Kernel sections


def _kernel_rows(points):
    """{(pass, shape): {provider: point}} in first-seen order, and the providers in display order."""
    rows: dict = {}
    for p in points:
        rows.setdefault((p.get("pass"), p.get("shape")), {})[p.get("provider")] = p
    return rows, _order(p.get("provider") for p in points)


def _time_cell(p) -> str:
    status = _cell_status(p)
    if status is not None:
        return status
    cell = _fmt_ms(p["median_ms"])
    if p.get("of_floor"):
        cell += f" ({100 * p['of_floor']:.0f}%)"
    return cell


def _memory_cell(p) -> str:
    status = _cell_status(p)
    return status if status is not None else _fmt_mb(p.get("peak_extra_MB"))


def _floor_of(row: dict) -> str:
    for p in row.values():
        if p.get("floor_ms"):
            return _fmt_ms(p["floor_ms"])
    return "-"


def _summary_lines(kernel: str, points: list[dict]) -> list[str]:
    """Ours against the baseline of the same framework, per pass: at the largest shape where both ran, and
    where ours ran and the baseline did not."""
    lines = []
    rows, _ = _kernel_rows(points)
    for framework, (ours, base) in BASELINES.items():
        for pass_ in dict.fromkeys(k[0] for k in rows):
            keys = [k for k in rows if k[0] == pass_ and rows[k].get(ours, {}).get("status") == "ok"
                    and base in rows[k]]
            both = [k for k in keys if rows[k][base].get("status") == "ok"]
            failed = [k for k in keys if rows[k][base].get("status") != "ok"]
            parts = []
            if both:
                k = both[-1]
                a, b = rows[k][ours], rows[k][base]
                text = (f"{pass_} {k[1]}: {ours} {_fmt_ms(a['median_ms'])} ms vs {base} "
                        f"{_fmt_ms(b['median_ms'])} ms ({b['median_ms'] / a['median_ms']:.2f}x)")
                if a.get("peak_extra_MB") is not None and b.get("peak_extra_MB") is not None:
                    text += (f", peak extra memory {_fmt_mb(a['peak_extra_MB'])} vs {_fmt_mb(b['peak_extra_MB'])}"
                             " MB")
                parts.append(text)
            if failed:
                parts.append(f"{pass_}: {base} " + ", ".join(
                    f"{STATUS_TEXT.get(rows[k][base].get('status'), rows[k][base].get('status'))} at {k[1]}"
                    for k in failed[:4]) + f" where {ours} ran")
            if parts:
                lines.append("- " + "; ".join(parts) + ".")
    return lines


def kernel_section(kernel: str, points: list[dict], plot: str | None) -> list[str]:
    rows, providers = _kernel_rows(points)
    lines = [f"## {kernel}", ""]
    if plot:
        lines += [f"![{kernel}: time and memory against the swept size]({plot})", ""]
    lines += _summary_lines(kernel, points)
    if lines[-1] != "":
        lines.append("")
    lines += ["Median ms (fraction of the floor reached); floor = bytes that must move / copy bandwidth, or "
              "flops / matmul rate, whichever is larger. torch times are device time with the host running ahead "
              "(as in a training step); the host time of one call is in the last table.", ""]
    lines += _table(["pass", "shape", "floor ms"] + providers,
                    [[pass_, shape, _floor_of(row)] + [_time_cell(row.get(n)) for n in providers]
                     for (pass_, shape), row in rows.items()])
    lines += ["", "Peak memory above the inputs, MB (jax: XLA's temporaries + outputs).", ""]
    lines += _table(["pass", "shape"] + providers,
                    [[pass_, shape] + [_memory_cell(row.get(n)) for n in providers]
                     for (pass_, shape), row in rows.items()])
    long_rows = []
    for p in points:
        if p.get("status") == "ok":
            rate = (f"{p['GBps']} GB/s" if p.get("GBps") else "") + (
                f" {p['TFLOPs']} TFLOP/s" if p.get("TFLOPs") else "")
            long_rows.append([p.get("pass"), p.get("shape"), p.get("dtype"), p.get("provider"), "ok",
                              f"{_fmt_ms(p['median_ms'])} ({_fmt_ms(p['p20_ms'])}-{_fmt_ms(p['p80_ms'])})",
                              p.get("reps", ""), rate.strip(), p.get("floor_ms", ""), p.get("of_floor", ""),
                              _fmt_mb(p.get("peak_extra_MB")), _fmt_ms(p["host_ms"]) if p.get("host_ms") else ""])
        else:
            long_rows.append([p.get("pass"), p.get("shape"), p.get("dtype"), p.get("provider"), p.get("status"),
                              "", "", "", "", "", "", ""])
    lines += ["", "<details><summary>all points (median, p20-p80; host ms: host time of one call, torch)</summary>",
              ""]
    lines += _table(["pass", "shape", "dtype", "provider", "status", "median ms (p20-p80)", "reps", "rate",
                     "floor ms", "of floor", "peak extra MB", "host ms"], long_rows)
    lines += ["", "</details>", ""]
    return lines


# ---------------------------------------------------------------------------------------------------------
# End-to-end sections


def _gib(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _e2e_cell(p) -> str:
    status = _cell_status(p)
    if status is not None:
        return status
    tps = p.get("tokens_per_s") or 0
    rate = f"{tps / 1e3:.1f}k" if tps >= 1000 else f"{tps:.0f}"
    return f"{rate} tok/s, {_gib(p.get('peak_GiB'))} GiB"


def e2e_section(points: list[dict], plot: str | None) -> list[str]:
    steps = [p for p in points if _kind(p) == "e2e_step"]
    longest = [p for p in points if _kind(p) == "e2e_longest"]
    lines = ["## End-to-end training step", ""]
    if plot:
        lines += [f"![end-to-end: tokens/s and peak memory against sequence length]({plot})", ""]
    dtypes = "/".join(sorted({str(p.get("dtype")) for p in points if p.get("dtype")})) or "bf16"
    lines += [f"One training step (forward, backward, AdamW) of a Llama-family model, {dtypes}, random weights and "
              "random tokens; HF: transformers with sdpa attention, fused AdamW, no gradient checkpointing; "
              "Flax: `liger_jax.models.LlamaForCausalLM` (attention through `jax.nn.dot_product_attention`, cuDNN on "
              "the GPU) with optax AdamW. Cells: tokens/s "
              "(median step), peak memory (torch: max allocated during the timed steps, parameters and "
              "optimizer state included; jax: XLA's compiled-program memory, arguments + temporaries + "
              "outputs - donated).", ""]
    rows: dict = {}
    for p in steps:
        rows.setdefault((p.get("model"), p.get("shape")), {})[p.get("provider")] = p
    providers = _order(p.get("provider") for p in steps)
    if rows:
        lines += _table(["model", "batch x seq"] + providers,
                        [[m, s] + [_e2e_cell(row.get(n)) for n in providers] for (m, s), row in rows.items()])
        lines.append("")
    if longest:
        lines += ["Longest sequence that fits (batch 1; doubling, then bisection; the peak memory there; the "
                  "shortest length that ran out of memory).", ""]
        rows = []
        for p in longest:
            if p.get("status") != "ok":
                rows.append([p.get("model"), p.get("provider"), STATUS_TEXT.get(p.get("status"), p.get("status")),
                             "", "", ""])
                continue
            fit = p.get("longest_fit") or 0
            fit_text = (f">= {fit}" if p.get("first_oom") is None and fit else str(fit) if fit else "none")
            rows.append([p.get("model"), p.get("provider"), fit_text, _gib(p.get("peak_GiB")),
                         p.get("first_oom") or "-", len(p.get("trials") or [])])
        lines += _table(["model", "provider", "longest seq", "peak GiB there", "first OOM", "trials"], rows)
        lines.append("")
    return lines


# ---------------------------------------------------------------------------------------------------------
# Plots


def sweep_panels(points: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """(axis, fixed sizes, points) for each size that varies among ``points``: the points where all other sizes
    take their most common combination. One panel against the first size when nothing varies."""
    if not points:
        return []
    keys = list(dict.fromkeys(k for p in points for k in params_of(p)))
    varying = [k for k in keys if len({params_of(p).get(k) for p in points}) > 1]
    panels = []
    for axis in varying:
        groups: dict = {}
        for p in points:
            fixed = tuple((k, v) for k, v in params_of(p).items() if k != axis)
            groups.setdefault(fixed, []).append(p)
        fixed, group = max(groups.items(), key=lambda kv: len({params_of(p).get(axis) for p in kv[1]}))
        if len({params_of(p).get(axis) for p in group}) > 1 or len(varying) == 1:
            panels.append((axis, dict(fixed), group))
    if not panels:
        panels.append((keys[0] if keys else "point", {}, points))
    return panels


def _x_of(p: dict, axis: str):
    v = params_of(p).get(axis)
    return v if isinstance(v, (int, float)) else None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLORS = {"liger_torch": "tab:blue", "liger_torch_copy": "tab:cyan", "liger_jax": "tab:orange",
          "torch_eager": "tab:red", "torch_compile": "tab:purple", "liger_kernel": "tab:green",
          "cut_cross_entropy": "tab:olive", "xla": "tab:brown", "hf_eager": "tab:red", "hf+liger_torch": "tab:blue",
          "hf+liger_kernel": "tab:green", "flax_xla": "tab:brown", "flax+liger_jax": "tab:orange"}


def _color(provider: str):
    """One colour per provider across every panel of every plot (ours blue/orange, eager red)."""
    return COLORS.get(provider, ("tab:gray", "tab:pink")[sum(map(ord, provider)) % 2])


def _draw(ax, group, axis, value_of, ylabel, title, log_y=True):
    drawn = False
    for provider in _order(p.get("provider") for p in group):
        pts = sorted((p for p in group if p.get("provider") == provider and _x_of(p, axis) is not None),
                     key=lambda p: _x_of(p, axis))
        ok = [(_x_of(p, axis), value_of(p)) for p in pts if p.get("status") == "ok" and value_of(p) is not None]
        failed = [p for p in pts if p.get("status") != "ok"]
        label = provider
        if failed and not ok and len({p["status"] for p in failed}) == 1:
            label += f" ({STATUS_TEXT.get(failed[0]['status'], failed[0]['status'])})"
        elif failed:
            label += " (" + ", ".join(f"{STATUS_TEXT.get(p['status'], p['status'])} at {_x_of(p, axis)}"
                                      for p in failed[:3]) + ("..." if len(failed) > 3 else "") + ")"
        if ok:
            ax.plot([x for x, _ in ok], [y for _, y in ok], marker="o", label=label, color=_color(provider))
            drawn = True
        elif failed:
            ax.plot([], [], marker="x", linestyle="none", label=label, color=_color(provider))
    xs = sorted({_x_of(p, axis) for p in group if _x_of(p, axis)})
    if xs and min(xs) > 0 and (len(xs) < 2 or max(xs) / min(xs) >= 4):
        ax.set_xscale("log", base=2)
    if xs:
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs], rotation=30, fontsize=7)
    values = [value_of(p) for p in group if p.get("status") == "ok" and value_of(p) is not None]
    if log_y and drawn and values and max(values) > 0:
        if ylabel.endswith("MB"):  # zeros happen (in-place ops): symmetric log, linear below 1 MB
            ax.set_yscale("symlog", linthresh=1.0)
        elif min(values) > 0:
            ax.set_yscale("log")
    import matplotlib.ticker

    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    if ax.get_yscale() == "log":  # labelled ticks at 1-2-5 steps, also when the range is under a decade
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.margins(y=0.08)
    if drawn and values and min(values) >= 0 and ax.get_yscale() != "log":
        ax.set_ylim(bottom=0)
    ax.set_xlabel(axis)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot_kernel(kernel: str, points: list[dict], path: str) -> str | None:
    panels = []
    for pass_ in dict.fromkeys(p.get("pass") for p in points):
        for axis, fixed, group in sweep_panels([p for p in points if p.get("pass") == pass_]):
            panels.append((pass_, axis, fixed, group))
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.8 * len(panels)), squeeze=False)
    for row, (pass_, axis, fixed, group) in enumerate(panels):
        where = ", ".join(f"{k}={v}" for k, v in fixed.items())
        title = f"{kernel} {pass_} vs {axis}" + (f" ({where})" if where else "")
        _draw(axes[row][0], group, axis, lambda p: p.get("median_ms"), "median ms", title)
        _draw(axes[row][1], group, axis, lambda p: p.get("peak_extra_MB"), "peak extra MB", title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_e2e(points: list[dict], path: str) -> str | None:
    steps = [p for p in points if _kind(p) == "e2e_step"]
    models = list(dict.fromkeys(p.get("model") for p in steps))
    if not models:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.8 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        group = [dict(p, params={"seq": p.get("seq")}) for p in steps if p.get("model") == model]
        _draw(axes[row][0], group, "seq", lambda p: p.get("tokens_per_s"), "tokens/s", f"{model}: throughput",
              log_y=False)
        _draw(axes[row][1], group, "seq", lambda p: p.get("peak_GiB"), "peak GiB", f"{model}: peak memory",
              log_y=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------
# The report


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _header(results: dict) -> list[str]:
    env = results.get("environment", {})
    machine = {**env, **(results.get("machine") or {})}
    ceilings = results.get("ceilings") or {}
    gpu = machine.get("gpu") or "CPU (smoke run: Triton interpreter, numbers test the code path only)"
    lines = [f"# Benchmarks: {gpu}, {env.get('date')}", ""]
    facts = [f"{k} {machine[k]}" for k in ("gpu_memory_GiB", "gpu_memory", "sm_count", "l2_MB", "driver", "cuda",
                                           "sm_clock_max", "cpu_count", "python") if machine.get(k)]
    if facts:
        lines += ["Machine: " + ", ".join(facts) + ".", ""]
    versions = [f"{k} {env[k]}" for k in ("torch", "triton", "jax", "jaxlib", "flax", "optax", "transformers",
                                          "liger-kernel", "cut-cross-entropy", "jax-triton", "liger_kernel",
                                          "cut_cross_entropy", "jax_triton") if env.get(k)]
    if versions:
        lines += ["Versions: " + ", ".join(versions) + ".", ""]
    if ceilings:
        lines += [f"Ceilings measured in the same run: copy {ceilings.get('copy_GBps')} GB/s (bytes read + "
                  f"written), bf16 matmul {ceilings.get('bf16_matmul_TFLOPs') or ceilings.get('matmul_TFLOPs')} "
                  "TFLOP/s." + (f" The jax timer on an XLA elementwise op of the same bytes: "
                                f"{ceilings['jax_copy_GBps']} GB/s (the jax columns' timing method, for "
                                "comparing them with the torch ones)." if ceilings.get("jax_copy_GBps") else ""),
                  ""]
    runs = results.get("runs") or []
    if runs:
        lines += ["Runs merged into this file: " + "; ".join(
            f"{r.get('started', '?')} `{' '.join(r.get('argv') or [])}`" for r in runs) + ".", ""]
        # a note added to a run afterwards (e.g. that a later run superseded some of its columns)
        lines += [f"Note on the run of {r.get('started', '?')}: {r['note']}" for r in runs if r.get("note")]
        if any(r.get("note") for r in runs):
            lines.append("")
    if ceilings.get("device", "cuda") == "cuda":
        donated = any(r.get("jax_inputs") for r in runs)
        chained = ["chained" in (r.get("jax_inputs") or "") for r in runs]
        small = {(True,): "inputs that fit in L2 copied and called in turn by one program (per call: the program's "
                          "time over its calls)",
                 (False,): "inputs rotated when they fit in L2",
                 (False, True): "inputs that fit in L2 rotated between calls, or (runs whose `jax_inputs` say "
                                "chained) called in turn by one program"}[tuple(sorted(set(chained or [False])))]
        timing = ("torch timed with CUDA events, L2 flushed before every repetition, ~25 ms warm-up, median of "
                  ">= 10 repetitions (p20-p80 in the detail tables); jax with a host clock around queued calls, "
                  + small + (
                      ", larger inputs donated where that removes a copy from the program (each call a fresh "
                      "copy, so an op writing over an operand is not charged with XLA's defensive copy)."
                      if donated else "."))
    else:
        timing = "host clock, one to three repetitions (a smoke run: it tests the code path, not the kernels)."
    lines += [f"Method: {timing} Fresh random inputs (never zeros). Memory: peak allocated above the inputs. A "
              "provider that fails at a point is shown as OOM / error / n/a (not installed) / skipped. A jax "
              "fwd+bwd is one program of the forward and its vjp with the incoming gradient as an argument, so "
              "XLA may fuse across the two (a norm's forward with its backward's row sums; SwiGLU's forward "
              "output recomputed, not written), which a layer inside a model cannot: there XLA can pass the "
              "floor, which counts the tensors of the two passes run apart.", ""]
    return lines


def frontend_section(points: list[dict], ceilings: dict) -> list[str]:
    """The jax frontend against the torch frontend, same kernel, pass and shape. The two are timed differently
    (CUDA events; a host clock around queued calls), so a second ratio divides out what each timer gives for a
    plain copy in the same run (each point's run's ceilings where the file merges several runs)."""
    rows = []
    for (pass_, shape, kernel), pair in _frontend_pairs(points).items():
        torch_p, jax_p = pair.get("liger_torch"), pair.get("liger_jax")
        if not (torch_p and jax_p and torch_p.get("status") == jax_p.get("status") == "ok"):
            continue
        ratio = jax_p["median_ms"] / torch_p["median_ms"]
        run_ceilings = jax_p.get("ceilings") or ceilings
        copy, jax_copy = run_ceilings.get("copy_GBps"), run_ceilings.get("jax_copy_GBps")
        adjusted = f"{ratio * jax_copy / copy:.2f}" if copy and jax_copy else "-"
        rows.append([kernel, pass_, shape, _fmt_ms(torch_p["median_ms"]), _fmt_ms(jax_p["median_ms"]),
                     f"{ratio:.2f}", adjusted])
    if not rows:
        return []
    return ["## JAX frontend against torch frontend", "",
            "Same kernel, pass and shape; ms (median). Timer-adjusted: the ratio times (jax timer's copy GB/s / "
            "torch timer's copy GB/s) from the same run, so that what the two timing methods add is divided out.",
            "", *_table(["kernel", "pass", "shape", "liger_torch", "liger_jax", "jax / torch",
                         "timer-adjusted"], rows), ""]


def _frontend_pairs(points):
    pairs: dict = {}
    for p in points:
        if _kind(p) == "kernel" and p.get("provider") in ("liger_torch", "liger_jax"):
            pairs.setdefault((p.get("pass"), p.get("shape"), p.get("kernel")), {})[p["provider"]] = p
    return pairs


def render_markdown(results: dict, plots: dict | None = None) -> str:
    """The report of ``results`` (the parsed JSON); ``plots``: {section: relative PNG path} to link."""
    plots = plots or {}
    points = results.get("points") or []
    lines = _header(results)
    e2e = [p for p in points if _kind(p) in ("e2e_step", "e2e_longest")]
    kernels = list(dict.fromkeys(p.get("kernel") for p in points if _kind(p) == "kernel"))
    sections = (["End-to-end training step"] if e2e else []) + kernels
    if len(sections) > 1:
        lines += ["Contents: " + ", ".join(f"[{s}](#{s.lower().replace(' ', '-')})" for s in sections), ""]
    if e2e:
        lines += e2e_section(e2e, plots.get("e2e"))
    for kernel in kernels:
        lines += kernel_section(kernel, [p for p in points if _kind(p) == "kernel" and p.get("kernel") == kernel],
                                plots.get(kernel))
    lines += frontend_section(points, results.get("ceilings") or {})
    failures = [p for p in points if p.get("status") in ("error", "oom") and p.get("error")]
    if failures:
        lines += ["## Failures", ""]
        for p in failures:
            what = " ".join(str(p.get(k)) for k in ("kernel", "model", "pass", "shape", "provider") if p.get(k))
            err = str(p.get("error")).replace("\n", " ").replace("|", "/")[:200]
            lines.append(f"- {what}: {p['status']}: {err}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def section_of(p: dict) -> str:
    """The report section (and plot) a point belongs to: ``e2e`` or its kernel."""
    return "e2e" if _kind(p).startswith("e2e") else str(p.get("kernel"))


def render_plots(results: dict, plot_dir: str, changed=None) -> dict:
    """Write the PNGs of ``results`` into ``plot_dir``; returns {section: path}. ``changed``: the sections to
    draw (None: all); the others keep the PNG already there, if any."""
    points = results.get("points") or []
    os.makedirs(plot_dir, exist_ok=True)
    out = {}
    for section in dict.fromkeys(section_of(p) for p in points):
        path = os.path.join(plot_dir, _slug(section) + ".png")
        if changed is not None and section not in changed:
            if os.path.exists(path):
                out[section] = path
            continue
        if section == "e2e":
            drawn = plot_e2e([p for p in points if _kind(p) == "e2e_step"], path)
        else:
            drawn = plot_kernel(section, [p for p in points if _kind(p) == "kernel" and p.get("kernel") == section],
                                path)
        if drawn:
            out[section] = path
    return out


def render_files(json_path: str, md_path: str | None = None, plots: bool = True, changed=None) -> str:
    """Render ``json_path`` into ``<stem>.md`` and ``<stem>-plots/``; returns the markdown's path. A failing
    plot (matplotlib missing, say) leaves the report without it. ``changed``: see :func:`render_plots`."""
    with open(json_path) as f:
        results = json.load(f)
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    md_path = md_path or stem + ".md"
    links = {}
    if plots:
        try:
            written = render_plots(results, stem + "-plots", changed)
            base = os.path.dirname(os.path.abspath(md_path))
            links = {k: os.path.relpath(os.path.abspath(v), base) for k, v in written.items()}
        except Exception as err:  # the tables matter more than the pictures
            print(f"plots not written: {type(err).__name__}: {err}")
    with open(md_path, "w") as f:
        f.write(render_markdown(results, links))
    return md_path


def console_summary(points: list[dict]) -> str:
    """A few lines for the terminal: ours against the baseline per kernel, the end-to-end cells, and how
    many points did not run."""
    lines = []
    for p in points:
        if _kind(p) == "e2e_step":
            lines.append(f"e2e {p.get('model')} {p.get('shape')} {p.get('provider')}: {_e2e_cell(p)}")
        elif _kind(p) == "e2e_longest":
            lines.append(f"e2e {p.get('model')} longest {p.get('provider')}: "
                         f"{p.get('longest_fit') if p.get('status') == 'ok' else p.get('status')}"
                         + (f" (first OOM {p['first_oom']})" if p.get("first_oom") else ""))
    for kernel in dict.fromkeys(p.get("kernel") for p in points if _kind(p) == "kernel"):
        pts = [p for p in points if _kind(p) == "kernel" and p.get("kernel") == kernel]
        counts = {}
        for p in pts:
            counts[p.get("status")] = counts.get(p.get("status"), 0) + 1
        lines.append(f"{kernel}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        lines += ["  " + line for line in _summary_lines(kernel, pts)]
    return "\n".join(lines)
