"""The jax frontend's one executor for ``liger_core`` plans.

- GPU: each launch is a ``jax_triton.triton_call`` (imported lazily; it needs a CUDA jaxlib).
- CPU (kernels in Triton's interpreter): the whole plan runs in one ``jax.pure_callback``, the arrays handed to
  ``liger_torch``'s executor as CPU torch tensors (bf16 through a 16-bit view).

Also the vmap helpers the ops share: ops are ``jax.custom_batching.custom_vmap`` functions whose rules fold a
batch axis into the kernel's rows instead of looping over examples.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import liger_core
from liger_core.launch import ArrayInfo, Buf, Plan

JAX_TRITON_VERSION = "0.3.1"


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def info(x) -> ArrayInfo:
    """jax arrays are always row-major: their strides follow from the shape."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"expected a jax array, got {type(x).__name__}")
    return ArrayInfo.contiguous(tuple(x.shape), dtype_name(x.dtype))


def optional_info(x) -> ArrayInfo | None:
    return None if x is None else info(x)


def as_array(name: str, x):
    """Accept jax/numpy arrays (and tracers); reject anything else with the argument's name."""
    if isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer)):
        return jnp.asarray(x)
    raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")


@functools.lru_cache(maxsize=None)
def jax_triton():
    """Import jax_triton, undoing its ``TRITON_CACHE_DIR=""`` (which would switch off torch's Triton cache)."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton as jt
    except ImportError as err:
        raise ImportError(f"liger_jax on a GPU launches kernels through jax-triton=={JAX_TRITON_VERSION}; "
                          f"install it (pip install jax-triton=={JAX_TRITON_VERSION})") from err
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved
    return jt


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    if liger_core.INTERPRET:
        return liger_core.INTERPRETER_NUM_SMS
    from triton.runtime import driver
    return driver.active.utils.get_device_properties(0)["multiprocessor_count"]


def run_plan(plan: Plan, **inputs) -> tuple[jax.Array, ...]:
    missing = [name for name in plan.inputs if inputs.get(name) is None]
    if missing:
        raise AssertionError(f"plan needs inputs {missing}")
    if liger_core.INTERPRET:
        return _run_interpreted(plan, inputs)
    if jax.default_backend() != "gpu":
        raise RuntimeError("liger_core compiled its kernels for the GPU, but jax's default backend is "
                           f"{jax.default_backend()!r}; install jax with CUDA, or set LIGER_INTERPRET=1")
    return _run_triton_call(plan, inputs)


def _scalar(value):
    """jax_triton types a Python float as fp64, Triton's own launcher as fp32: pass fp32, as torch does."""
    return np.float32(value) if isinstance(value, float) else value


def _run_triton_call(plan: Plan, inputs) -> tuple[jax.Array, ...]:
    jt = jax_triton()
    buffers = {name: inputs[name] for name in plan.inputs}
    for launch in plan.launches:
        array_names = launch.array_args()
        args = [buffers[a.name] if isinstance(a, Buf) else _scalar(a) for a in launch.args]
        out_shape = [jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs]
        aliases = {array_names.index(o.alias): j for j, o in enumerate(launch.outputs) if o.alias is not None}
        zeroed = tuple(j for j, o in enumerate(launch.outputs) if o.zeroed)  # jax needs hashable params
        outs = jt.triton_call(*args, kernel=launch.kernel, out_shape=out_shape, grid=launch.grid,
                              num_warps=launch.num_warps, num_stages=launch.num_stages,
                              input_output_aliases=aliases, zeroed_outputs=zeroed, **launch.constexprs)
        for new, value in zip(launch.outputs, outs):
            buffers[new.name] = value
    return tuple(buffers[name] for name in plan.outputs)


# ---------------------------------------------------------------------------------------------------------
# CPU: Triton's interpreter behind a host callback


def _to_torch(array):
    import torch

    array = np.array(array, copy=True, order="C")  # writable: kernels may write in place
    if array.dtype == jnp.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _to_numpy(tensor):
    import torch

    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    return tensor.numpy()


def _run_interpreted(plan: Plan, inputs) -> tuple[jax.Array, ...]:
    from liger_torch._launch import run_plan as run_plan_torch

    result_shapes = tuple(
        jax.ShapeDtypeStruct(new.shape, jnp.dtype(new.dtype)) for new in map(plan.new_buffer, plan.outputs))

    def host(*arrays):
        tensors = {name: _to_torch(a) for name, a in zip(plan.inputs, arrays)}
        return tuple(_to_numpy(t) for t in run_plan_torch(plan, **tensors))

    return jax.pure_callback(host, result_shapes, *(inputs[name] for name in plan.inputs),
                             vmap_method="sequential")


# ---------------------------------------------------------------------------------------------------------
# vmap helpers


def broadcast_unbatched(axis_size: int, in_batched, args):
    """Give every unbatched array argument a leading batch axis (None stays None)."""
    return tuple(
        a if (a is None or b) else jnp.broadcast_to(a, (axis_size,) + tuple(a.shape))
        for a, b in zip(args, in_batched))


def map_over_batch(op, axis_size: int, in_batched, args):
    """Fallback for a batch the kernel cannot fold into rows (e.g. a per-example weight): one call per example."""
    args = broadcast_unbatched(axis_size, in_batched, args)
    return jax.lax.map(lambda example: op(*example), args)
