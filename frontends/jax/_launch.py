"""The jax frontend's one executor for ``liger_core`` plans.

- GPU: each launch is a ``jax_triton.triton_call`` (imported lazily; it needs a CUDA jaxlib).
- CPU (kernels in Triton's interpreter): the whole plan runs in one ``jax.pure_callback``, the arrays handed to
  ``liger_torch``'s executor as CPU torch tensors (bf16 through a 16-bit view). Inside one shard of an SPMD
  partition (:mod:`liger_jax._sharding`) the same host function runs behind a named CPU custom call instead:
  a partition's body is lowered into a temporary module, which would lose a ``pure_callback``.

Also the vmap helpers the ops share: ops are ``jax.custom_batching.custom_vmap`` functions whose rules fold a
batch axis into the kernel's rows instead of looping over examples.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import itertools
import os
import sys
import traceback

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
        array = jnp.asarray(x)
        if isinstance(x, np.ndarray) and x.dtype.kind in "iu" and x.size and array.dtype != x.dtype:
            # without jax_enable_x64 an int64 array becomes int32, wrapping values past its range: a label of
            # 2**32 + 1 would be read as class 1, one of 2**32 - 100 as ignore_index
            limits = np.iinfo(array.dtype)
            if x.min() < limits.min or x.max() > limits.max:
                raise ValueError(f"{name} has values outside {array.dtype}'s range [{limits.min}, {limits.max}], "
                                 f"the dtype jax stores its {x.dtype} as here (jax_enable_x64 is off)")
        return array
    raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")


def undifferentiated(op: str, what: str, name: str, x):
    """``x``, with a ValueError naming it when it is differentiated: ``op`` differentiates ``what`` only, and a
    zero cotangent returned for ``x`` would be a silently wrong gradient (as liger_torch raises for a tensor that
    requires grad). A constant (or stop_gradient'ed) ``x`` has no tangent, so the rule never runs for it."""
    return None if x is None else _refusing_identity(op, what, name)(x)


@functools.lru_cache(maxsize=None)  # one function per message: jax caches its traces by function
def _refusing_identity(op: str, what: str, name: str):
    @jax.custom_jvp
    def identity(value):
        return value

    @identity.defjvp
    def refuse(primals, tangents):
        raise ValueError(f"{name} is differentiated, but liger_jax.{op} differentiates {what} only; wrap {name} in "
                         "jax.lax.stop_gradient")

    return identity


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
        if any(o.strides is not None for o in launch.outputs):  # jax arrays (and so the plans' inputs) are dense
            raise AssertionError("a jax_triton output must be contiguous")
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
        # Shards of a partitioned op run on several XLA threads: liger_torch's executor serialises the
        # interpreted launches themselves (INTERPRETER_LOCK), so nothing more is needed here.
        return tuple(_to_numpy(t) for t in run_plan_torch(plan, **tensors))

    arrays = [inputs[name] for name in plan.inputs]
    if _IN_PARTITION.get():
        return _host_custom_call(host, result_shapes, arrays)
    return jax.pure_callback(host, result_shapes, *arrays, vmap_method="sequential")


# ---------------------------------------------------------------------------------------------------------
# CPU inside a partition: the host function behind a custom call registered once, by name
#
# pure_callback registers its function with the module being lowered (an index into its host callbacks). The
# SPMD partitioner lowers a custom_partitioning body into a temporary module whose callbacks are dropped, so a
# pure_callback there would call a dangling index (a crash; jax-ml/jax#23620). A custom call found by name and
# keyed by its backend_config has no such tie. XLA's legacy CPU custom-call API is used through ctypes, as it
# needs no compiled code; it cannot return an error, so a failing plan prints its traceback and returns NaN.

_IN_PARTITION = contextvars.ContextVar("liger_jax_in_partition", default=False)
_HOST_TARGET = "liger_jax_interpreted_plan"
_HOST_CALLS: dict[bytes, tuple] = {}  # backend_config -> (host function, input avals, output avals)
_HOST_KEYS = itertools.count()
# void f(void* out, const void** in, const char* opaque, size_t opaque_len, XlaCustomCallStatus* status)
_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                 ctypes.c_size_t, ctypes.c_void_p)
_API_VERSION_STATUS_RETURNING_UNIFIED = 3


@contextlib.contextmanager
def partition_body():
    """Trace a partition's per-shard body: interpreted plans inside become named custom calls."""
    token = _IN_PARTITION.set(True)
    try:
        yield
    finally:
        _IN_PARTITION.reset(token)


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * jnp.dtype(aval.dtype).itemsize


def _host_array(address, aval):
    if _nbytes(aval) == 0:
        return np.zeros(aval.shape, aval.dtype)
    raw = (ctypes.c_char * _nbytes(aval)).from_address(address)
    return np.frombuffer(raw, dtype=aval.dtype).reshape(aval.shape)


def _host_handler(out, ins, opaque, opaque_len, status):
    del status  # the status setter is not exported by jaxlib
    key = ctypes.string_at(opaque, opaque_len)
    host, in_avals, out_avals = _HOST_CALLS[key]
    addresses = [out] if len(out_avals) == 1 else ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[:len(out_avals)]
    try:
        results = host(*(_host_array(ins[i], a) for i, a in enumerate(in_avals)))
    except BaseException:  # an exception must not unwind into XLA
        traceback.print_exc(file=sys.stderr)
        results = [np.full(a.shape, np.nan if jnp.issubdtype(a.dtype, jnp.floating) else -1, a.dtype)
                   for a in out_avals]
    for address, aval, result in zip(addresses, out_avals, results):
        if _nbytes(aval):
            ctypes.memmove(address, np.ascontiguousarray(result, dtype=aval.dtype).ctypes.data, _nbytes(aval))


@functools.lru_cache(maxsize=None)
def _host_target():
    handler = _HANDLER_TYPE(_host_handler)  # cached: the function pointer must outlive every executable
    jax.ffi.register_ffi_target(_HOST_TARGET, jax.ffi.pycapsule(ctypes.cast(handler, ctypes.c_void_p).value),
                                platform="cpu", api_version=0)
    return handler


def _host_custom_call(host, result_shapes, arrays):
    _host_target()
    key = str(next(_HOST_KEYS)).encode()
    _HOST_CALLS[key] = (host, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays), result_shapes)
    call = jax.ffi.ffi_call(_HOST_TARGET, result_shapes, custom_call_api_version=_API_VERSION_STATUS_RETURNING_UNIFIED,
                            legacy_backend_config=key.decode())
    return tuple(call(*arrays))


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
