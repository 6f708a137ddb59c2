"""Patched vs unpatched tiny Llama trained on 2 CPU processes (gloo) under DDP, FSDP2 and DeepSpeed ZeRO-3.

Each test starts two ranks of ``dist_worker.py`` (a process group through a file store in ``tmp_path``, so no
port is shared with a parallel test; CPU tensors and Triton's interpreter, also on a GPU machine) and compares
what they saved. A rank that fails ends the run: the
other is killed after a short grace period (it may wait in a collective for the dead one), and a run that
outlives its deadline is killed too, so a deadlock fails the test instead of hanging the suite.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from helpers import assert_close

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
WORLD = 2
DEADLINE_S = 300  # the runs take 10-20 s on 2 idle cores
GRACE_S = 15
F32 = torch.float32

_NUMPY = tuple(int(part) for part in __import__("numpy").__version__.split(".")[:2])
pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built"),
    # The ranks run the kernels in Triton's interpreter, which numpy >= 2.4 breaks (Triton 3.6: loops with
    # runtime bounds); scripts/setup.sh pins numpy below 2.4, the GPU image has a newer one.
    pytest.mark.skipif(_NUMPY >= (2, 4), reason="Triton 3.6's interpreter needs numpy < 2.4 (the CPU suite has it)"),
]


def _run(stacks, tmp_path, seed):
    """Runs the worker's stacks (in turn, in one pair of processes); returns (exit codes, a report of them with
    the logs' tails). A rank killed here (past the deadline, or still running GRACE_S after another failed)
    has a negative code."""
    # CPU tensors and the interpreter also on a GPU machine: the test is about the stacks, not the device.
    env = dict(os.environ, WORLD_SIZE=str(WORLD), LIGER_DIST_INIT=f"file://{tmp_path}/store",
               LIGER_DIST_SEED=str(seed), MASTER_ADDR="127.0.0.1", MASTER_PORT="0", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", LIGER_INTERPRET="1", DS_ACCELERATOR="cpu")
    logs = [open(tmp_path / f"log{r}.txt", "w") for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, WORKER, ",".join(stacks), str(tmp_path)], stdout=logs[r],
                              stderr=subprocess.STDOUT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(WORLD)]
    deadline, failed_at = time.monotonic() + DEADLINE_S, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
    codes = [p.returncode for p in procs]
    tails = "\n".join(f"--- rank {r} (exit {c}) ---\n" + (tmp_path / f"log{r}.txt").read_text()[-3000:]
                      for r, c in enumerate(codes))
    hung = "" if failed_at or time.monotonic() < deadline else f" (killed after {DEADLINE_S} s)"
    return codes, f"{','.join(stacks)}: ranks exited with {codes}{hung}\n{tails}"


def _load(stack, tmp_path):
    return [torch.load(tmp_path / f"{stack}_rank{r}.pt", weights_only=False) for r in range(WORLD)]


# A rank that dies of one of these signals crashed in native code: on CI a rank once died of SIGSEGV (no Python
# error, its peer then lost the gloo connection) and once of SIGABRT in gloo's teardown; neither reproduced in
# 36 runs of these stacks here, two at a time on 2 busy cores. An access outside a kernel's buffers, the crash
# our own code could cause, fails in Python instead (interpreter_bounds, on in the workers).
NATIVE_CRASHES = (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS)


def launch(stacks, tmp_path, seed):
    """Runs the stacks, which must succeed on every rank; returns {stack: [rank 0's, rank 1's]}. A run in which
    a rank crashed in native code is run once more (in a fresh directory), with a warning carrying its report
    (and the crashed rank's stacks, faulthandler's); a second crash, or any other failure, fails the test."""
    codes, report = _run(stacks, tmp_path, seed)
    if any(c in NATIVE_CRASHES for c in codes):
        warnings.warn(f"a rank crashed in native code; running again. The crashed run: {report}")
        tmp_path = tmp_path / "again"
        tmp_path.mkdir()
        codes, report = _run(stacks, tmp_path, seed)
    if codes != [0] * WORLD:
        pytest.fail(report)
    return {stack: _load(stack, tmp_path) for stack in stacks}


def launch_failing(stack, tmp_path, seed):
    """Runs a stack that must fail on every rank, each ending on its own with an error (exit 1: not killed, so
    no rank hung in a collective for more than GRACE_S); returns [rank 0's error, rank 1's]."""
    codes, report = _run([stack], tmp_path, seed)
    if codes != [1] * WORLD:
        pytest.fail(report)
    return [res["error"] for res in _load(stack, tmp_path)]


def _assert_drift(params, ref_params, start, name):
    # As test_hf_patching.py::test_convergence_adamw: AdamW turns rounding-sized gradient differences into
    # lr-sized element updates, so each tensor's difference is measured against its training update.
    assert params.keys() == ref_params.keys()
    for n in ref_params:
        drift = (params[n] - ref_params[n]).norm() / (ref_params[n] - start[n]).norm()
        assert drift <= 2e-3, f"{name}: final {n} differs by {drift.item():.2e} of its training update"


def _check_matches_unpatched(stack, results):
    vocab_hidden = tuple(results[0]["ref"][1]["lm_head.weight"].shape)
    assert vocab_hidden == (331, 64)
    for res in results:
        rank = res["rank"]
        (ref_losses, ref_params, start), (losses, params, start_liger) = res["ref"], res["liger"]
        assert all(torch.equal(start[n], start_liger[n]) for n in start)  # same init
        # the first step runs on the initial parameters: both equal a plain single-process forward
        assert_close(ref_losses[0], res["single_step0"], F32, f"{stack} rank {rank} unpatched first loss")
        assert_close(losses[0], res["single_step0"], F32, f"{stack} rank {rank} patched first loss")
        assert_close(losses, ref_losses, F32, f"{stack} rank {rank} per-step losses", scale=10)
        _assert_drift(params, ref_params, start, f"{stack} rank {rank}")
        # a plain (not DTensor, not partitioned) full weight on every step
        assert res["flce_weights"] == [("Parameter", vocab_hidden, F32)] * len(losses), (stack, res["flce_weights"])
    assert not torch.equal(results[0]["ref"][0], results[1]["ref"][0]), stack  # the ranks had different data
    for n, p in results[0]["liger"][1].items():  # one model: every rank ends with the same parameters
        assert torch.equal(p, results[1]["liger"][1][n]), f"{stack}: {n} differs between the ranks"


def test_ddp_and_fsdp2_match_unpatched(tmp_path, seed):
    """DDP; FSDP2 with lm_head in the root unit; FSDP2 with lm_head its own unit (its weight is a shard outside
    its forward). 3 AdamW steps, each rank on its own batches: per-step losses and final parameters of the
    patched run match the unpatched run under the same stack; the fused linear CE got the full (V, H)
    lm_head weight. (One pair of processes for the three: the start-up is most of the time.)"""
    for stack, results in launch(["ddp", "fsdp2", "fsdp2_lm_head"], tmp_path, seed).items():
        _check_matches_unpatched(stack, results)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_deepspeed_zero3_matches_unpatched(tmp_path, seed):
    """DeepSpeed ZeRO-3 (parameters partitioned over the ranks, a torch AdamW): as above. The patched forward
    reads lm_head.weight inside the CausalLM's forward, where ZeRO-3 gathers it (and registers it with that
    module for the backward)."""
    (results,) = launch(["zero3"], tmp_path, seed).values()
    _check_matches_unpatched("zero3", results)


def test_tensor_parallel_lm_head_is_a_clear_error(tmp_path, seed):
    """lm_head under tensor parallelism (ColwiseParallel: a vocab-sharded DTensor weight outside any FSDP unit):
    the unpatched model trains; the patched forward refuses on every rank (so none waits for another) with an
    error that says what it got and what to do."""
    (results,) = launch(["tp_lm_head"], tmp_path, seed).values()
    for res in results:
        assert_close(res["ref"][0][0], res["single_step0"], F32, "tensor-parallel unpatched loss")
        message = res.get("liger_error")
        assert message is not None, "the patched forward accepted a sharded lm_head weight"
        assert "DTensor" in message and "Shard(dim=0)" in message, message
        assert "fully_shard" in message and "fused_linear_cross_entropy=False" in message, message
        assert res["flce_weights"] == []  # refused before the kernel saw a shard


# rank 1's error (its beginning) in each stack where rank 1 alone gets bad input
ONE_RANK_ERRORS = {
    "ddp_bad_label": "ValueError: target has values outside [0, 331) that are not ignore_index=-100 (1 of 8 "
                     "targets; the first is 400)",
    "ddp_dtype": "TypeError: weight must have x's dtype bfloat16, got float32; cast them to one dtype "
                 "(model.to(dtype), lm_head included) or run under torch.autocast",
}


@pytest.mark.parametrize("stack", ONE_RANK_ERRORS)
def test_one_rank_error_ends_every_rank(stack, tmp_path, seed):
    """Rank 1 alone gets bad input (a label outside the vocabulary in its second batch; its decoder in bf16 with
    an fp32 lm_head): it raises the frontend's error, naming the argument and the bad value or dtypes and what
    to do, and rank 0, waiting for it in DDP's gradient all-reduce, fails too (gloo: the peer closed the
    connection) instead of hanging."""
    errors = launch_failing(stack, tmp_path, seed)
    assert errors[1].startswith(ONE_RANK_ERRORS[stack]), errors[1]
    assert errors[0].startswith("RuntimeError") and "by peer" in errors[0], errors[0]
