"""Compile launch plans for sm_90 the way jax_triton specialises them (arrays 16-byte aligned, integer arguments
of unknown divisibility, those equal to 1 constant) and count the 16-byte global loads and stores in the PTX.

Run as a script (no GPU needed: Triton compiles for a named target); prints one JSON line per launch:
``{"case": ..., "kernel": ..., "v4_loads": n, "v4_stores": n, "narrow_loads": n}``. ``--force-align1`` compiles
with ALIGN=1, to show what the hints change; ``--report`` adds ptxas's registers and spill bytes per thread.
"""

import itertools
import json
import os
import re
import sys

os.environ["LIGER_INTERPRET"] = "0"  # compiled kernels (no launch happens: compile only)
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from liger_core import cross_entropy, fused_add_rms_norm, jsd, kl_div, layer_norm, rms_norm, rope, swiglu  # noqa: E402
from liger_core.launch import ArrayInfo, Buf, Plan  # noqa: E402
from liger_core.reduce import sum_partial_pairs_launch, sum_partials_launch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, run as a script too
from norm_plans import NORM_FAMILIES, norm_forward_plan  # noqa: E402

TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int64": "i64",
                "int32": "i32"}


def bf16(*shape):
    return ArrayInfo.contiguous(shape, "bfloat16")


def norm_forward_cases(x, w, families=NORM_FAMILIES, label="", **overrides):
    """The norm forwards of ``families`` on rows of ``x``'s width (past their held_up_to: the chunked sweeps;
    ``overrides`` for the plans), named "<family> forward, <n> columns<label>"."""
    arrays = {"x": x, "residual": x, "weight": w, "bias": w}
    cases = {}
    for family in families:
        plan = norm_forward_plan(family, x, w, **overrides)
        cases[f"{family} forward, {x.shape[-1]} columns{label}"] = (plan, {n: arrays[n] for n in plan.inputs})
    return cases


DEFAULT_FORWARD_WIDTHS = (16384, 20496, 24576, 28672, 32768, 65536)
DEFAULT_FORWARD_DTYPES = (("bfloat16", "bfloat16"), ("bfloat16", "float32"))  # x's (and the residual's), w's


def default_forward_cases():
    """The norm forwards' default launches around their held/chunked limits, bf16 rows with a bf16 or an fp32
    weight, named "<family> forward, <n> columns, weight <dtype>"."""
    cases = {}
    for n, (x_dtype, w_dtype) in itertools.product(DEFAULT_FORWARD_WIDTHS, DEFAULT_FORWARD_DTYPES):
        x, w = ArrayInfo.contiguous((8, n), x_dtype), ArrayInfo.contiguous((n,), w_dtype)
        cases.update(norm_forward_cases(x, w, label=f", weight {w_dtype}"))
    return cases


def cases():
    x, w = bf16(64, 4096), bf16(4096)
    rstd = ArrayInfo.contiguous((64,), "float32")
    q, k = bf16(1, 16, 32, 128), bf16(1, 16, 8, 128)  # (B, T, H, D): the jax layout
    cos = bf16(1, 16, 128)
    logits, target = bf16(64, 32000), ArrayInfo.contiguous((64,), "int64")
    a = bf16(64, 14336)
    rows = ArrayInfo.contiguous((64,), "float32")
    wide, wide_w = bf16(64, 16384), bf16(16384)
    widest, widest_w = bf16(8, 65536), bf16(65536)
    ragged, ragged_w = bf16(8, 20496), bf16(20496)
    held, held_w = bf16(8, 32768), bf16(32768)
    scalar = ArrayInfo.contiguous((), "float32")
    vocab, vocab_target = bf16(8, 128256), ArrayInfo.contiguous((8,), "int64")
    vocab_w = ArrayInfo.contiguous((128256,), "float32")
    return {
        "rms_norm forward": (rms_norm.forward_plan(x, w, eps=1e-6), {"x": x, "weight": w}),
        "rms_norm backward": (rms_norm.backward_plan(x, x, w, num_sms=132),
                              {"dy": x, "x": x, "weight": w, "rstd": rstd}),
        "layer_norm forward": (layer_norm.forward_plan(x, w, w, eps=1e-6), {"x": x, "weight": w, "bias": w}),
        "swiglu forward": (swiglu.forward_plan(a, a, activation="silu"), {"a": a, "b": a}),
        "swiglu backward": (swiglu.backward_plan(a, a, a, activation="silu", in_place=False),
                            {"dc": a, "a": a, "b": a}),
        "cross_entropy": (cross_entropy.forward_plan(logits, target, reduction="sum"),
                          {"logits": logits, "target": target}),
        "rope, one head group per program": (_with_setting(rope, "_GROUPS_PER_PROGRAM", 1,
                                                           lambda: rope.forward_plan(q, k, cos, cos, head_axis=2)),
                                             {"q": q, "k": k, "cos": cos, "sin": cos}),
        "rope, all head groups per program": (_with_setting(rope, "_MIN_PROGRAMS", 1,
                                                            lambda: rope.forward_plan(q, k, cos, cos, head_axis=2)),
                                              {"q": q, "k": k, "cos": cos, "sin": cos}),
        "kl_div": (kl_div.forward_plan(logits, logits, reduction="sum"), {"input": logits, "target": logits}),
        "kl_div with gradient": (kl_div.forward_plan(logits, logits, reduction="sum", compute_grad=True),
                                 {"input": logits, "target": logits}),
        "kl_div, log target, with gradient": (kl_div.forward_plan(logits, logits, reduction="sum", log_target=True,
                                                                 compute_grad=True),
                                              {"input": logits, "target": logits}),
        # compiled to check they build for sm_90 (their vectorisation is not asserted)
        "layer_norm backward": (layer_norm.backward_plan(x, x, w, w, num_sms=132),
                                {"dy": x, "x": x, "weight": w, "bias": w, "mean": rows, "rstd": rows}),
        "fused_add_rms_norm forward": (fused_add_rms_norm.forward_plan(x, x, w, eps=1e-6),
                                       {"x": x, "residual": x, "weight": w}),
        "fused_add_rms_norm backward": (fused_add_rms_norm.backward_plan(
            x, x, x, w, x_dtype="bfloat16", residual_dtype="bfloat16", num_sms=132),
            {"dy": x, "dh": x, "h": x, "weight": w, "rstd": rows}),
        "cross_entropy backward": (cross_entropy.backward_plan(logits, scalar, reduction="mean"),
                                   {"grad": logits, "grad_output": scalar}),
        "kl_div backward": (kl_div.backward_plan(scalar, logits, logits, reduction="sum"),
                            {"grad_output": scalar, "target": logits}),
        "jsd": (jsd.forward_plan(logits, logits), {"student": logits, "teacher": logits}),
        # wide rows: one 16384-column row a tile, reloaded after the row's reduction instead of held (LayerNorm's
        # default; RMSNorm's held tile spills less than a reload costs, so theirs is asked for)
        "rms_norm backward, 16384 columns": (rms_norm.backward_plan(wide, wide, wide_w, num_sms=132, reload=True),
                                             {"dy": wide, "x": wide, "weight": wide_w, "rstd": rows}),
        "fused_add_rms_norm backward, 16384 columns": (
            fused_add_rms_norm.backward_plan(wide, wide, wide, wide_w, x_dtype="bfloat16",
                                             residual_dtype="bfloat16", num_sms=132, reload=True),
            {"dy": wide, "dh": wide, "h": wide, "weight": wide_w, "rstd": rows}),
        "layer_norm backward, 16384 columns": (
            layer_norm.backward_plan(wide, wide, wide_w, wide_w, num_sms=132),
            {"dy": wide, "x": wide, "weight": wide_w, "bias": wide_w, "mean": rows, "rstd": rows}),
        # rows over their held_up_to: swept in column chunks, twice (a held 65536-column row spilled kilobytes);
        # whole chunks at 65536, a partial last chunk (the masked sweeps) at 20496 (4096-column chunks: the RMSNorms
        # hold such rows by default)
        **norm_forward_cases(widest, widest_w), **norm_forward_cases(ragged, ragged_w, chunk=4096),
        # bf16 rows up to 32768 columns held (16 warps; LayerNorm's from 28672)
        **norm_forward_cases(held, held_w, label=" (held)"),
        **default_forward_cases(),
        # rows over 16384 columns: the backward's row sums, then 4096-column blocks (a whole-row tile spilled)
        "rms_norm backward, 65536 columns": (rms_norm.backward_plan(widest, widest, widest_w, num_sms=132,
                                                                    lagged=False),
                                             {"dy": widest, "x": widest, "weight": widest_w, "rstd": rows}),
        "layer_norm backward, 65536 columns": (
            layer_norm.backward_plan(widest, widest, widest_w, widest_w, num_sms=132),
            {"dy": widest, "x": widest, "weight": widest_w, "bias": widest_w, "mean": rows, "rstd": rows}),
        "fused_add_rms_norm backward, 65536 columns": (
            fused_add_rms_norm.backward_plan(widest, widest, widest, widest_w, x_dtype="bfloat16",
                                             residual_dtype="bfloat16", num_sms=132, lagged=False),
            {"dy": widest, "dh": widest, "h": widest, "weight": widest_w, "rstd": rows}),
        # the same rows through the lagged backward (dy and x read once)
        "rms_norm backward, lagged": (rms_norm.backward_plan(widest, widest, widest_w, num_sms=132, lagged=True),
                                      {"dy": widest, "x": widest, "weight": widest_w, "rstd": rows}),
        "fused_add_rms_norm backward, lagged": (
            fused_add_rms_norm.backward_plan(widest, widest, widest, widest_w, x_dtype="bfloat16",
                                             residual_dtype="bfloat16", num_sms=132, lagged=True),
            {"dy": widest, "dh": widest, "h": widest, "weight": widest_w, "rstd": rows}),
        "sum_partials, weight gradient": (
            Plan(inputs=("partials",), launches=(sum_partials_launch("partials", "dw", 1, 132, 4096, "bfloat16"),),
                 outputs=("dw",)),
            {"partials": ArrayInfo.contiguous((1, 132, 4096), "float32")}),
        "sum_partial_pairs, weight and bias gradients": (
            Plan(inputs=("dw_partial", "db_partial"),
                 launches=(sum_partial_pairs_launch(("dw_partial", "db_partial"), ("dw", "db"), 1, 132, 4096,
                                                    ("bfloat16", "bfloat16")),),
                 outputs=("dw", "db")),
            {"dw_partial": ArrayInfo.contiguous((1, 132, 4096), "float32"),
             "db_partial": ArrayInfo.contiguous((1, 132, 4096), "float32")}),
        # the loss with its gradient on wide rows through the lagged kernel (plain, and every option)
        "cross_entropy, lagged": (cross_entropy.forward_plan(vocab, vocab_target, reduction="sum", lagged=True),
                                  {"logits": vocab, "target": vocab_target}),
        "cross_entropy, lagged, every option": (
            cross_entropy.forward_plan(vocab, vocab_target, vocab_w, label_smoothing=0.1, lse_square_scale=1e-4,
                                       softcap=30.0, return_z_loss=True, lagged=True),
            {"logits": vocab, "target": vocab_target, "weight": vocab_w}),
        "jsd on logits": (jsd.chunk_plan(64, 32000, "bfloat16", "bfloat16", None, beta=0.5, ignore_index=-100,
                                         n_total_rows=64, temperature=2.0, compute_grad=True),
                          {"student": logits, "teacher": logits}),
    }


def _with_setting(module, name, value, build):
    """``build()`` with a module's tuning knob set to ``value`` (plans built then are not cached: the default
    comes back with the caches cleared)."""
    def clear_caches():
        for plan_builder in ("_plan", "forward_plan"):
            if hasattr(getattr(module, plan_builder, None), "cache_clear"):
                getattr(module, plan_builder).cache_clear()

    default = getattr(module, name)
    setattr(module, name, value)
    clear_caches()
    try:
        return build()
    finally:
        setattr(module, name, default)
        clear_caches()


def compile_launch(launch, dtypes, force_align1):
    kernel = launch.kernel
    constexprs = dict(launch.constexprs)
    if force_align1 and "ALIGN" in constexprs:
        constexprs["ALIGN"] = 1
    positional = list(launch.args) + [Buf(o.name) for o in launch.outputs]
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = positional[i]
        if isinstance(value, Buf):
            signature[name] = "*" + TRITON_TYPES[dtypes[value.name]]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    return compiled


def ptxas_report(ptx: str) -> dict:
    """Registers and spill bytes per thread, from Triton's bundled ptxas (``-v``) on the PTX."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True)
    os.unlink(f.name)
    text = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spills.group(1)) if spills else None}


def main():
    force_align1 = "--force-align1" in sys.argv
    report = "--report" in sys.argv
    wanted = [a for a in sys.argv[1:] if not a.startswith("--")]
    for case, (plan, inputs) in cases().items():
        if wanted and case not in wanted:
            continue
        dtypes = {name: info.dtype for name, info in inputs.items()}
        for launch in plan.launches:
            for out in launch.outputs:
                dtypes[out.name] = out.dtype
            if "ALIGN" not in launch.constexprs:
                continue
            compiled = compile_launch(launch, dtypes, force_align1)
            ptx = compiled.asm["ptx"]
            print(json.dumps({
                "case": case, "kernel": launch.kernel.fn.__name__, "align": launch.constexprs["ALIGN"],
                "num_warps": launch.num_warps, "shared_bytes": compiled.metadata.shared,
                **(ptxas_report(ptx) if report else {}),
                "v4_loads": len(re.findall(r"ld\.global[.\w:]*\.v4\.", ptx)),
                "v4_stores": len(re.findall(r"st\.global[.\w:]*\.v4\.", ptx)),
                "narrow_loads": len(re.findall(r"ld\.global[.\w:]*\.b16", ptx)),
                "loads_after_first_barrier": loads_after_first_barrier(ptx),
                "loaded_values_used_before_first_wide_load": loaded_values_used_before_first_wide_load(ptx),
                **transcendental_forms(ptx),
            }), flush=True)


def loads_after_first_barrier(ptx: str) -> int:
    """Global loads that come after the kernel's first ``bar.sync`` (a cross-warp reduction) in program order:
    each waits for that reduction, a round trip added to the program's latency."""
    barrier = ptx.find("bar.sync")
    return 0 if barrier < 0 else len(re.findall(r"ld\.global", ptx[barrier:]))


def transcendental_forms(ptx: str) -> dict:
    """How the kernel's exponentials and logarithms compiled. ``exps_keeping_denormals``: ``ex2.approx.f32``
    without ``.ftz`` (tl.exp: the hardware ex2 plus three instructions per element that keep denormal results);
    ``software_logs``: tl.log / tl.log2's ~25-instruction routine (recognised by its split of the exponent, an
    add of -0x3f2aaaab or -0x3f3504f3 then a mask of 0xff800000); ``hardware_logs``: ``lg2.approx``. A vectorised
    per-element use shows up once per element a thread holds, a per-row one once."""
    return {"exps_keeping_denormals": len(re.findall(r"ex2\.approx\.f32", ptx)),
            "software_logs": len(re.findall(r"add\.s32\s+%r\d+, %r\d+, -10(59760811|60439283);", ptx)),
            "hardware_logs": len(re.findall(r"lg2\.approx", ptx))}


def loaded_values_used_before_first_wide_load(ptx: str) -> int:
    """Instructions before the kernel's first 16-byte global load (in program order) that read a register an
    earlier global load wrote: each waits for that load, so the wide load behind it starts one memory round trip
    late. (PTX puts an instruction's destination first, so its other operands are the ones read.)"""
    first = re.search(r"ld\.global[.\w:]*\.v4\.", ptx)
    loaded, uses = set(), 0
    for line in (ptx[:first.start()] if first else ptx).splitlines():
        line = line.split("//")[0].strip()
        if not line or line.endswith(":"):
            continue
        operands = re.split(r",\s*(?![^{]*})", line.split(None, 1)[1] if " " in line or "\t" in line else "")
        if re.match(r"(@!?%p\d+\s+)?ld\.global", line):
            loaded.update(re.findall(r"%r\w*\d+", operands[0]))
            continue
        if any(set(re.findall(r"%r\w*\d+", o)) & loaded for o in operands[1:]):
            uses += 1
    return uses


if __name__ == "__main__":
    main()
