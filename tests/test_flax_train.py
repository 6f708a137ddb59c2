"""liger_jax.models.train: the jitted optax (AdamW) step, single-device and data-parallel on the 4-device CPU mesh.

A tiny Llama from the same init trained on the same batches in five set-ups: without kernels on one device,
replicated over 4 and FSDP over 4 (five steps each); with kernels on one device (five steps) and FSDP over 4 (two
steps: the interpreter is slow). Each sharded run must give the single-device run's per-step losses and
parameters after its last step, and kernels vs no kernels the same per-step losses, all within
helpers.assert_close's fp32 bound, unwidened: |a - b| <= 1e-5 + 1e-5 |b| elementwise.

The runs differ only in reduction order (sharded) or the kernels' fp32 arithmetic. The learning rate is 1e-3:
AdamW's first steps move every parameter by about lr whatever its gradient's size, and at lr = 1e-2 this tiny
model's steps are chaotic enough that rounding-level gradient differences grew to 1.5% of a gradient by the
second step (parameters then off by 3e-5 between two correct runs; plain SGD stays at 5e-8 relative). At 1e-3
the worst parameter difference seen is about a third of the bound, and the loss still falls (5.56 -> 4.91).
"""

import jax
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import assert_close

from liger_jax.models import LlamaConfig, LlamaForCausalLM
from liger_jax.models.train import Trainer, fsdp_spec, make_mesh

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

F32 = torch.float32
CONFIG = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)
B, T = 4, 8
# name: (use_kernels, devices, fsdp, steps)
SETUPS = {"xla/1": (False, 1, False, 5), "xla/dp4": (False, 4, False, 5), "xla/fsdp4": (False, 4, True, 5),
          "kernels/1": (True, 1, False, 5), "kernels/fsdp4": (True, 4, True, 2)}


def _batches(steps):
    """Two batches, alternated, so the loss goes down within a few steps."""
    rng = np.random.default_rng(0)
    pair = []
    for _ in range(2):
        ids = rng.integers(0, CONFIG.vocab_size, (B, T))
        labels = ids.copy()
        labels[0, :3] = -100  # a masked prompt
        pair.append({"input_ids": ids, "labels": labels})
    return [pair[i % 2] for i in range(steps)]


def _params(model):
    return {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


_RUNS = {}


def _run(name):
    """(per-step losses, {step: parameters}, trainer) of a set-up, computed once per session."""
    use_kernels, devices, fsdp, steps = SETUPS[name]
    if len(jax.devices()) < devices:
        pytest.skip(f"needs {devices} jax devices (conftest sets 4 CPU devices when there is no GPU)")
    if name not in _RUNS:
        model = LlamaForCausalLM(CONFIG, use_kernels=use_kernels, rngs=nnx.Rngs(0))
        trainer = Trainer(model, optax.adamw(1e-3, weight_decay=0.1),
                          mesh=make_mesh(jax.devices()[:devices]), fsdp=fsdp)
        losses, params = [], {}
        for batch in _batches(steps):
            losses.append(float(trainer.step(batch)))
            params[len(losses)] = _params(trainer.model)
        _RUNS[name] = losses, params, trainer
    return _RUNS[name]


@pytest.fixture
def runs():
    return _run


@pytest.mark.parametrize("sharded,single", [("xla/dp4", "xla/1"), ("xla/fsdp4", "xla/1"),
                                            ("kernels/fsdp4", "kernels/1")])
def test_sharded_steps_match_single_device(runs, sharded, single):
    losses, params, trainer = runs(sharded)
    ref_losses, ref_params, _ = runs(single)
    steps = len(losses)
    assert_close(np.array(losses), np.array(ref_losses[:steps]), F32, f"{sharded}: per-step losses")
    assert ref_losses[-1] < ref_losses[0] - 0.1, f"training did not lower the loss: {ref_losses}"
    params, ref_params = params[steps], ref_params[steps]
    assert params.keys() == ref_params.keys()
    for name in params:
        assert_close(params[name], ref_params[name], F32, f"{sharded}: {name} after {steps} steps")
    up = trainer.state.params["model"]["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    assert up.sharding.spec == (P(None, "data") if sharded.endswith("fsdp4") else P())
    assert len(up.sharding.device_set) == 4


def test_kernels_and_xla_losses_agree(runs):
    assert_close(np.array(runs("kernels/1")[0]), np.array(runs("xla/1")[0]), F32, "per-step losses")


def test_fsdp_spec_shards_the_largest_divisible_axis():
    assert fsdp_spec((64, 128), 4) == P(None, "data")
    assert fsdp_spec((257, 64), 4) == P(None, "data")  # 257 is not divisible: the next largest axis
    assert fsdp_spec((128, 128), 4) == P("data")  # ties: the first
    assert fsdp_spec((257,), 4) == P()
    assert fsdp_spec((), 4) == P()
    assert fsdp_spec((64, 128), 1) == P()


def test_batch_must_divide_over_the_mesh():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 jax devices")
    trainer = Trainer(LlamaForCausalLM(CONFIG, use_kernels=False), optax.sgd(0.1), mesh=make_mesh(jax.devices()[:4]))
    with pytest.raises(ValueError, match=r"batch\['input_ids'\].*multiple of the 4 devices"):
        trainer.step({"input_ids": np.zeros((3, T), np.int32)})
