"""A training step for the Flax models: optax under ``jax.jit``, data-parallel over a mesh of local devices.

``nnx.split`` turns the model into (graphdef, parameters, the rest); the step is a pure function of the
parameters, the optimizer state and a batch, traced once. Sharding goes through ``jax.sharding`` (XLA's SPMD
partitioner): the batch's leading axis is split over the mesh axis ``"data"``; parameters and optimizer state are
replicated, or with ``fsdp=True`` each array's largest axis that the device count divides is split over
``"data"`` too (arrays with no such axis stay replicated). With FSDP the step all-gathers the parameters once at
its start (one full copy lives during the step; the optimizer state, the bulk, stays sharded) and the gradients
come back to the sharded layout: so activations are sharded over the batch only, never along a weight's axis
(which XLA's propagation would otherwise try, through the kernels' custom calls too). XLA inserts the
collectives, so a sharded step computes the single-device step's numbers, up to the order of the reductions.

    trainer = Trainer(model, optax.adamw(3e-4), fsdp=True)   # mesh over all local devices
    for batch in batches:                                    # {"input_ids", "labels"?, "attention_mask"?}
        loss = trainer.step(batch)
    model = trainer.model                                    # the trained nnx model
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA = "data"


def make_mesh(devices=None, axis_name: str = DATA) -> Mesh:
    """A 1-D mesh over ``devices`` (default: all local devices) with the one axis ``axis_name``."""
    devices = jax.local_devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("make_mesh: devices is empty")
    return Mesh(np.asarray(devices), (axis_name,))


def fsdp_spec(shape, size: int, axis_name: str = DATA) -> PartitionSpec:
    """Split the largest axis that ``size`` divides over ``axis_name`` (first such axis on ties); replicate
    when no axis qualifies or there is one device."""
    candidates = [i for i, n in enumerate(shape) if size > 1 and n % size == 0 and n >= size]
    if not candidates:
        return PartitionSpec()
    axis = max(candidates, key=lambda i: (shape[i], -i))
    return PartitionSpec(*([None] * axis + [axis_name]))


def state_sharding(mesh: Mesh, fsdp: bool, axis_name: str = DATA) -> Callable[[Any], NamedSharding]:
    """The sharding of a parameter or optimizer-state array, from its shape alone: AdamW's moments have their
    parameter's shape, so they land where their parameter does."""
    size = mesh.shape[axis_name]

    def sharding(x) -> NamedSharding:
        spec = fsdp_spec(np.shape(x), size, axis_name) if fsdp else PartitionSpec()
        return NamedSharding(mesh, spec)

    return sharding


def default_loss(model, batch):
    """``model.loss`` on a batch dict: ``input_ids``, ``labels`` (default: the inputs; shifted inside),
    ``attention_mask`` (optional)."""
    return model.loss(batch["input_ids"], batch.get("labels", batch["input_ids"]), batch.get("attention_mask"))


class TrainState(NamedTuple):
    params: Any  # nnx.State of the nnx.Param variables
    opt_state: Any


def make_train_step(model, optimizer, *, mesh: Mesh | None = None, fsdp: bool = False, axis_name: str = DATA,
                    loss_fn: Callable = default_loss, donate: bool = True):
    """``(step, state)``: ``step(state, batch) -> (state, loss)`` is jitted; ``state`` holds copies of the
    model's parameters and the optimizer state (``optimizer``: an optax GradientTransformation), placed on
    ``mesh`` (default: all local devices). ``donate`` lets the step reuse the old state's buffers in place.
    ``loss_fn(model, batch)`` returns the scalar to minimise; ``step.merge(state)`` rebuilds the model."""
    mesh = make_mesh(axis_name=axis_name) if mesh is None else mesh
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis_name!r} (axes: {tuple(mesh.shape)})")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sharding = state_sharding(mesh, fsdp, axis_name)

    def place(tree):  # copies: a donated step must not free the arrays the model still holds
        # (device_put alone may hand a replicated array the source buffer as one of its shards)
        return jax.tree.map(lambda x: jax.device_put(jnp.copy(x), sharding(x)), tree)

    def constrain(tree):  # keep the new state where the old one was (XLA would otherwise choose)
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding(x)), tree)

    params = place(params)
    state = TrainState(params, place(optimizer.init(params)))

    replicated = NamedSharding(mesh, PartitionSpec())

    def step(state: TrainState, batch):
        def loss_of(p):
            if fsdp:  # gather: the forward and backward see whole weights and batch-sharded activations
                p = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), p)
            return loss_fn(nnx.merge(graphdef, p, rest), batch)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(constrain(params), constrain(opt_state)), loss

    jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
    return TrainStep(jitted, graphdef, rest, mesh, axis_name), state


class TrainStep:
    """``step(state, batch) -> (state, loss)``: shards the batch, runs the jitted step. ``step.merge(state)``
    is the nnx model with the state's parameters (sharing its arrays)."""

    def __init__(self, jitted, graphdef, rest, mesh: Mesh, axis_name: str):
        self.jitted, self.graphdef, self.rest, self.mesh = jitted, graphdef, rest, mesh
        self.batch_sharding = NamedSharding(mesh, PartitionSpec(axis_name))
        self.devices = mesh.shape[axis_name]

    def __call__(self, state: TrainState, batch):
        return self.jitted(state, shard_batch(batch, self.batch_sharding, self.devices))

    def merge(self, state: TrainState):
        return nnx.merge(self.graphdef, state.params, self.rest)


def shard_batch(batch: dict, sharding: NamedSharding, devices: int) -> dict:
    """Put each array of ``batch`` on the mesh, its leading (batch) axis split over the data axis."""
    out = {}
    for name, value in batch.items():
        if value is None:
            continue
        value = jnp.asarray(value) if not isinstance(value, jax.Array) else value
        if value.ndim == 0 or value.shape[0] % devices:
            raise ValueError(f"batch[{name!r}]: the batch size {value.shape[:1]} must be a multiple of the "
                             f"{devices} devices of the mesh")
        out[name] = jax.device_put(value, sharding)
    return out


class Trainer:
    """:func:`make_train_step` with its state kept: ``loss = trainer.step(batch)``; ``trainer.model``."""

    def __init__(self, model, optimizer, *, mesh: Mesh | None = None, fsdp: bool = False, axis_name: str = DATA,
                 loss_fn: Callable = default_loss, donate: bool = True):
        self.train_step, self.state = make_train_step(model, optimizer, mesh=mesh, fsdp=fsdp, axis_name=axis_name,
                                                      loss_fn=loss_fn, donate=donate)
        self.mesh = self.train_step.mesh

    def step(self, batch) -> jax.Array:
        self.state, loss = self.train_step(self.state, batch)
        return loss

    @property
    def model(self):
        return self.train_step.merge(self.state)
