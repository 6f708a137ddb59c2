"""The row kernels compile to 16-byte loads and stores also where the launcher does not tell Triton that their
integer arguments are multiples of 16 (jax_triton: its integers have no divisibility attribute), thanks to the
ALIGN hints (liger_core.tl_math.aligned). Compiled for sm_90 in a subprocess; no GPU needed."""

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ptx_worker.py")


def compile_all(tmp_path, *flags, reductions=False):
    """One record per launch with an ALIGN hint of the worker's cases (``flags``: case names, options); the
    partial-sum reductions a plan ends with only with ``reductions`` (tests of the row kernels leave them out)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LIGER_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = subprocess.run([sys.executable, WORKER, *flags], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        if "ptxas" in out.stderr and ("not found" in out.stderr or "No such file" in out.stderr):
            pytest.skip("this Triton build has no ptxas to compile for sm_90")
        raise AssertionError(out.stderr[-3000:])
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if reductions or not r["kernel"].startswith("_sum_partial")]


VECTORISED = {"rms_norm forward", "rms_norm backward", "layer_norm forward", "swiglu forward", "swiglu backward",
              "cross_entropy", "rope, one head group per program", "rope, all head groups per program",
              "kl_div", "kl_div with gradient", "cross_entropy, lagged"}


def test_row_kernels_use_16_byte_accesses_under_jax_triton_specialisation(tmp_path):
    """Every kernel with alignment hints compiles for sm_90; the main row kernels load and store 16 bytes at a
    time (cross_entropy: plus one 2-byte load, the target's logit)."""
    rows = compile_all(tmp_path)
    assert {r["case"] for r in rows} >= VECTORISED | {"layer_norm backward", "fused_add_rms_norm backward", "jsd"}
    for r in rows:
        assert r["align"] == 16, r
        if r["case"] in VECTORISED:
            assert r["v4_loads"] > 0 and r["narrow_loads"] <= 1, r
        if r["case"] == "kl_div with gradient":  # the gradient written in the forward's sweep
            assert r["v4_stores"] > 0, r
    # Without the hints the same kernels load 2 bytes at a time: the hints are what vectorises them.
    unhinted = [r for r in compile_all(tmp_path, "--force-align1") if r["case"] in VECTORISED]
    assert unhinted and all(r["v4_loads"] == 0 and r["narrow_loads"] > 0 for r in unhinted), unhinted


NORM_FORWARDS = {"rms_norm forward", "layer_norm forward", "fused_add_rms_norm forward"}


def test_norm_forwards_load_everything_before_the_row_reduction(tmp_path):
    """The norm forwards issue their weight (and bias) loads with the row's, before the row's reduction: a load
    behind the reduction's barrier adds a memory round trip to every program (the 4096 x 4096 forward trailed
    Liger-Kernel by ~10% with a cold L2 while the weight was loaded after it)."""
    rows = [r for r in compile_all(tmp_path, *sorted(NORM_FORWARDS)) if r["case"] in NORM_FORWARDS]
    assert {r["case"] for r in rows} == NORM_FORWARDS
    for r in rows:
        assert r["loads_after_first_barrier"] == 0, r


def test_rope_asks_for_q_and_k_before_waiting_for_cos_and_sin(tmp_path):
    """A one-head-group RoPE program (the grid at 4096 tokens) issues its first q/k load before it touches the
    cos/sin tile it loaded: converting the tile first made it wait for cos/sin before asking for q/k, two memory
    round trips in a row. (A program of many head groups converts the tile once before its loop, on purpose.)"""
    case = "rope, one head group per program"
    (row,) = [r for r in compile_all(tmp_path, case) if r["case"] == case]
    assert row["v4_loads"] > 0 and row["loaded_values_used_before_first_wide_load"] == 0, row


def test_loss_loops_use_one_instruction_exp2_and_log2(tmp_path):
    """The per-element exponentials and logarithms of the loss sweeps compile to the hardware's ex2 / lg2 alone:
    tl.exp adds three instructions per element and tl.log ~25, which made the JSD loop issue-bound (~52
    instructions per element, now ~30) and KL against probabilities too (~39, now ~13). The only software logs
    left are the per-row logsumexps (one per row and input)."""
    per_row_logs = {"cross_entropy": 1, "cross_entropy, lagged": 2, "jsd": 0, "jsd on logits": 2, "kl_div": 0,
                    "kl_div with gradient": 0,
                    "kl_div, log target, with gradient": 0}
    rows = [r for r in compile_all(tmp_path, *sorted(per_row_logs)) if r["case"] in per_row_logs]
    assert {r["case"] for r in rows} == set(per_row_logs)
    for r in rows:
        assert r["exps_keeping_denormals"] == 0 and r["software_logs"] == per_row_logs[r["case"]], r
        if r["case"].startswith("jsd") or r["case"] in ("kl_div", "kl_div with gradient"):
            assert r["hardware_logs"] > 0, r


@pytest.mark.parametrize("case", ["sum_partials, weight gradient", "sum_partial_pairs, weight and bias gradients"])
def test_partial_sums_load_16_bytes_at_a_time(tmp_path, case):
    """The weight-gradient reduction (132 partials x 4096 columns, fp32), alone or as LayerNorm's dW/dB pair,
    loads 4 floats at a time under jax_triton's specialisation too: without the ALIGN hint its loads were 4 bytes
    wide and it took 29 us under jax against 6 under torch (H100, scripts/profile_kernels.py, perf-log
    fourteenth session)."""
    (hinted,) = [r for r in compile_all(tmp_path, case, reductions=True) if r["case"] == case]
    (unhinted,) = [r for r in compile_all(tmp_path, case, "--force-align1", reductions=True) if r["case"] == case]
    assert hinted["align"] == 16 and hinted["v4_loads"] > 0, hinted
    assert unhinted["v4_loads"] == 0, unhinted


WIDE_BACKWARDS = {"rms_norm backward, 16384 columns": 0, "fused_add_rms_norm backward, 16384 columns": 0,
                  "layer_norm backward, 16384 columns": 128}


def test_wide_norm_backwards_reload_instead_of_spilling(tmp_path):
    """At 16384 columns (one row a tile, 32 values a thread at 16 warps) the norm backwards held their tile
    across the row's reduction and spilled (ptxas: RMSNorm 88, fused add+RMSNorm 64, LayerNorm 244 bytes a
    thread); reloading it after the reduction leaves RMSNorm's and fused add+RMSNorm's without spills and halves
    LayerNorm's (its dW and dB accumulators are 64 registers a thread)."""
    rows = [r for r in compile_all(tmp_path, *sorted(WIDE_BACKWARDS), "--report") if r["case"] in WIDE_BACKWARDS]
    assert {r["case"] for r in rows} == set(WIDE_BACKWARDS)
    for r in rows:
        assert r["spill_store_bytes"] is not None and r["spill_store_bytes"] <= WIDE_BACKWARDS[r["case"]], r


WIDE_FORWARDS = {f"{family} forward, {n} columns" for family in ("rms_norm", "layer_norm", "fused_add_rms_norm")
                 for n in (65536, 20496)}  # whole chunks (no column masks), and a partial last chunk
WIDE_FORWARDS |= {f"{family} forward, 32768 columns (held)"
                  for family in ("rms_norm", "layer_norm", "fused_add_rms_norm")}


def test_wide_norm_forwards_sweep_in_chunks_without_spilling(tmp_path):
    """Past their held_up_to the norm forwards sweep each row in column chunks, twice, instead of holding it
    (a 65536-column row held at 8 warps spilled 3.0 / 5.8 / 6.2 KB a thread in RMSNorm / LayerNorm / fused
    add+RMSNorm); bf16 rows up to 32768 columns are held at 16 warps: no spills, 16-byte accesses
    (LayerNorm: plus one 2-byte load, the row's first value, its shift)."""
    rows = [r for r in compile_all(tmp_path, *sorted(WIDE_FORWARDS), "--report") if r["case"] in WIDE_FORWARDS]
    assert {r["case"] for r in rows} == WIDE_FORWARDS
    for r in rows:
        assert r["spill_store_bytes"] == 0 and r["v4_loads"] > 0 and r["v4_stores"] > 0, r
        assert r["narrow_loads"] <= 1, r


def test_default_norm_forwards_do_not_spill_around_their_held_limits(tmp_path):
    """Every default norm forward launch from 16384 to 65536 columns, bf16 rows with a bf16 or an fp32 weight,
    compiles without spills: the held/chunked choice (rowwise.held_rows_for: an fp32 weight spilled a held
    32768-column RMSNorm row by 28-60 bytes a thread) and the held row's warps. One known exception: LayerNorm's
    held 16384-column row with an fp32 weight (196 bytes; not measured, docs/perf-log.md s23)."""
    # the worker's default_forward_cases (not imported here: importing the worker turns the interpreter off)
    names = {f"{family} forward, {n} columns, weight {w}" for family in ("rms_norm", "layer_norm", "fused_add_rms_norm")
             for n in (16384, 20496, 24576, 28672, 32768, 65536) for w in ("bfloat16", "float32")}
    rows = [r for r in compile_all(tmp_path, *sorted(names), "--report") if r["case"] in names]
    assert {r["case"] for r in rows} == names
    known = {"layer_norm forward, 16384 columns, weight float32": 196}
    for r in rows:
        assert r["spill_store_bytes"] is not None and r["spill_store_bytes"] <= known.get(r["case"], 0), r


WIDE_SPLIT_BACKWARDS = {"rms_norm backward, 65536 columns", "layer_norm backward, 65536 columns",
                        "fused_add_rms_norm backward, 65536 columns"}


def test_wide_norm_backwards_split_columns_without_spilling(tmp_path):
    """Over 16384 columns the norm backwards sum each row in one chunked sweep, then walk 4096-column blocks of
    the rows (a whole-row tile and its dW accumulator spilled 1.1-1.4 KB a thread at 65536 columns): no launch
    spills, and the row sums and the blocks load 16 bytes at a time."""
    rows = [r for r in compile_all(tmp_path, *sorted(WIDE_SPLIT_BACKWARDS), "--report")
            if r["case"] in WIDE_SPLIT_BACKWARDS]
    assert {r["case"] for r in rows} == WIDE_SPLIT_BACKWARDS
    for case in WIDE_SPLIT_BACKWARDS:
        kernels = [r["kernel"] for r in rows if r["case"] == case]
        assert "row_" in kernels[0] and "backward" in kernels[1], kernels  # row sums, then the blocks
    for r in rows:
        assert r["spill_store_bytes"] == 0, r
        if "sum_partial" not in r["kernel"]:
            assert r["v4_loads"] > 0, r


def test_lagged_cross_entropy_keeps_eight_programs_an_sm(tmp_path):
    """The lagged CE kernel's plain launch (4 warps) fits 64 registers a thread, 8 programs an SM: at 79 (6 an
    SM; the ignored rows' masks in the gradient loop) it ran at 1.93 ms against the probe's 1.66 at 63, H100
    8192x128256 (docs/perf-log.md, twenty-seventh session)."""
    rows = [r for r in compile_all(tmp_path, "cross_entropy, lagged", "--report")
            if r["kernel"] == "_cross_entropy_lagged_kernel"]
    assert len(rows) == 1 and rows[0]["num_warps"] == 4, rows
    assert rows[0]["registers"] is not None and rows[0]["registers"] <= 64 and rows[0]["spill_store_bytes"] == 0, rows


def test_lagged_norm_backward_keeps_seven_programs_an_sm(tmp_path):
    """The lagged norm backward (RMSNorm's and fused add+RMSNorm's, 4 warps, 1024 columns a step) fits 72
    registers a thread, 7 programs an SM, without spills: at 2048 columns a step it took 96-128."""
    rows = [r for r in compile_all(tmp_path, "rms_norm backward, lagged", "fused_add_rms_norm backward, lagged",
                                   "--report") if r["kernel"] == "_rms_norm_lagged_backward_kernel"]
    assert len(rows) == 2 and all(r["num_warps"] == 4 for r in rows), rows
    assert all(r["registers"] is not None and r["registers"] <= 72 and r["spill_store_bytes"] == 0 for r in rows), rows
