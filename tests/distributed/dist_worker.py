"""One rank of a 2-process gloo run, started by ``test_distributed_training.py``.

    python dist_worker.py STACK[,STACK...] OUT_DIR  (env: RANK, WORLD_SIZE, LIGER_DIST_INIT=file:///..., LIGER_DIST_SEED)

For each stack in turn: trains the tiny Llama (``hf_tiny``) a few AdamW steps, unpatched and then patched
(``apply_liger_kernel``), each rank on its own data, and saves ``OUT_DIR/<STACK>_rank<R>.pt`` for the test:

- ``ref`` / ``liger``: (per-step local losses, final full parameters, initial parameters);
- ``single_step0``: this rank's first-step loss from a plain single-process model (the distributed runs start
  from the same parameters, so their first losses must equal it);
- ``flce_weights``: (type, shape, dtype) of every weight the patched forward gave the fused linear CE;
- ``error``: the exception, if one was raised (the rank then exits with status 1).

STACK: ``ddp``; ``fsdp2`` (``fully_shard`` per decoder layer and the root: lm_head in the root unit);
``fsdp2_lm_head`` (lm_head its own ``fully_shard`` unit); ``zero3`` (DeepSpeed ZeRO-3, a torch AdamW);
``tp_lm_head`` (lm_head tensor-parallel: ``ColwiseParallel``, its weight a vocab-sharded DTensor; the unpatched
model trains one step, the patched one must refuse with an error that names the remedy, saved as
``liger_error``).

Stacks where rank 1 goes wrong and rank 0 does not (a rank-local error must end every rank, none waiting
forever in a collective for it): ``ddp_bad_label`` (DDP, rank 1's second batch has a label outside the
vocabulary); ``ddp_dtype`` (DDP, rank 1's decoder cast to bf16 while its lm_head stays fp32, so the fused
linear CE gets bf16 hidden states and an fp32 weight). Both train the patched model only and save just
``error``.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "transformers")]
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import liger_core  # noqa: E402  (before anything imports triton: liger_core picks the interpreter)
import liger_torch._launch  # noqa: E402
import interpreter_bounds  # noqa: E402
import liger_torch.transformers._causal_lm as causal_lm  # noqa: E402
from hf_tiny import batch, build  # noqa: E402
from liger_torch.transformers import apply_liger_kernel  # noqa: E402

STEPS = 3
LR = 3e-3
SEED = int(os.environ.get("LIGER_DIST_SEED", "0"))
FAULTS = ("ddp_bad_label", "ddp_dtype")  # the stacks that break rank 1 (see above)
BAD_LABEL = 400  # the tiny model's vocabulary is 331


def fully_shard_api():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # older torch: the composable API's first home
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def record_flce(weights):
    """Wrap the patched forward's fused linear cross-entropy to record the weight it is given."""
    original = causal_lm.fused_linear_cross_entropy

    def recording(x, weight, *args, **kwargs):
        weights.append((type(weight).__name__, tuple(weight.shape), weight.dtype))
        return original(x, weight, *args, **kwargs)

    causal_lm.fused_linear_cross_entropy = recording


def data(rank, step, stack):
    # Data parallel: each rank its own shard. Tensor parallel: one batch for the group (the input is replicated).
    ids, labels = batch(SEED + 1000 * (0 if stack == "tp_lm_head" else rank) + step, "cpu", batch_size=1, seq=8)
    if stack == "ddp_bad_label" and rank == 1 and step == 1:  # after one good step together
        labels[0, 4] = BAD_LABEL
    return ids, labels


def mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def wrap(model, stack, world):
    """The model under the stack, and its optimizer."""
    if stack in ("ddp", "ddp_bad_label"):
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif stack == "ddp_dtype":
        # DDP's start-up broadcast of the parameters (and its per-forward one of the buffers) would meet the
        # mismatch first: gloo aborts rank 1 on the size difference, before the patched forward runs.
        model = torch.nn.parallel.DistributedDataParallel(model, init_sync=False, broadcast_buffers=False)
    elif stack in ("fsdp2", "fsdp2_lm_head"):
        fully_shard, dp = fully_shard_api(), mesh(world)
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        if stack == "fsdp2_lm_head":
            fully_shard(model.lm_head, mesh=dp)
        fully_shard(model, mesh=dp)
    elif stack == "tp_lm_head":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(model, mesh(world), {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    elif stack == "zero3":
        import deepspeed

        # Its shared-memory all-reduce op would be JIT-compiled with ninja on first use (about a minute on two
        # cores); gloo's own collectives do the job here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10**9}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        return engine, opt
    else:
        raise ValueError(stack)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def full_params(model, stack):
    if stack == "zero3":
        import deepspeed

        params = dict(model.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def train(stack, patched, rank, world, steps=STEPS):
    model = build("llama", SEED, "cpu")
    if patched:
        apply_liger_kernel(model)
    if stack == "ddp_dtype" and rank == 1:
        model.model.to(torch.bfloat16)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    model, opt = wrap(model, stack, world)
    losses = []
    for step in range(steps):
        ids, labels = data(rank, step, stack)
        loss = model(input_ids=ids, labels=labels).loss
        if stack == "zero3":
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return torch.stack(losses), full_params(model, stack), start


def single_process_loss(rank, stack):
    model = build("llama", SEED, "cpu").train()
    ids, labels = data(rank, 0, stack)
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).loss


def run_stack(stack, rank, world):
    if stack in FAULTS:  # rank 1 raises in its forward: main saves each rank's error
        train(stack, True, rank, world, steps=2)
        return {"rank": rank, "stack": stack}
    result = {"rank": rank, "stack": stack, "single_step0": single_process_loss(rank, stack)}
    weights = []
    record_flce(weights)
    if stack == "tp_lm_head":
        result["ref"] = train(stack, False, rank, world, steps=1)
        try:
            train(stack, True, rank, world, steps=1)
        except RuntimeError as e:
            result["liger_error"] = str(e)
    else:
        result["ref"] = train(stack, False, rank, world)
        assert not weights, "the unpatched model called the fused linear cross-entropy"
        result["liger"] = train(stack, True, rank, world)
    result["flce_weights"] = weights
    return result


def main():
    stacks, out_dir = sys.argv[1].split(","), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if liger_core.INTERPRET:  # as in the test suite: an access outside the launch's buffers fails the rank
        interpreter_bounds.install()
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV in gloo or torch, seen once on CI) prints its stacks
    torch.set_num_threads(1)
    liger_torch._launch.POISON_OUTPUTS = True  # as in the test suite: an unwritten output element is NaN
    # A collective that waits for a rank that died gives up after this (the test's own deadline is later).
    dist.init_process_group("gloo", init_method=os.environ["LIGER_DIST_INIT"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    original_flce = causal_lm.fused_linear_cross_entropy
    for stack in stacks:  # one process start (torch, transformers, triton: seconds) for several stacks
        causal_lm.fused_linear_cross_entropy = original_flce
        path = os.path.join(out_dir, f"{stack}_rank{rank}.pt")
        try:
            torch.save(run_stack(stack, rank, world), path)
        except BaseException as e:  # saved for the test to show, then re-raised (non-zero exit)
            torch.save({"rank": rank, "stack": stack, "error": f"{type(e).__name__}: {e}"}, path)
            traceback.print_exc()
            # Exit without the interpreter's teardown: destroying a gloo group whose peer is gone can abort the
            # process from gloo's own thread ("terminate called without an active exception", exit -6, seen on
            # CI) after the error was already reported.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
