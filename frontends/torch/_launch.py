"""The torch frontend's one executor for ``liger_core`` plans, and the tensor checks every op shares."""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading

import torch
from triton import knobs

import liger_core
from liger_core.launch import ArrayInfo, Buf, Plan, collapse_rows, contiguous_strides

_DTYPE_NAMES = {
    torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}") from None


def info(t: torch.Tensor) -> ArrayInfo:
    return ArrayInfo(tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype))


def optional_info(t: torch.Tensor | None) -> ArrayInfo | None:
    return None if t is None else info(t)


def rowwise(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its leading axes fold into rows by strides, else a contiguous copy."""
    return t if collapse_rows(info(t)) is not None else t.contiguous()


def sole_reference(grad: torch.Tensor | None) -> bool:
    """Whether the backward receiving ``grad`` holds its only reference, so that writing over it is safe.
    Autograd hands one tensor to every input of an add (a residual sum's two branches), and a caller's
    ``backward(gradient)`` or a hook may keep one: a backward run first sees the other holder and must write
    elsewhere. A torch without ``Tensor._use_count`` counts as shared, and so does a gradient met while a CUDA
    graph is captured before the count was measured."""
    if grad is None or not hasattr(grad, "_use_count"):
        return False
    device = grad.device.type
    if device not in _SOLE_USE_COUNT:
        if device == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        _SOLE_USE_COUNT[device] = _measure_sole_use_count(device)
    return grad._use_count() <= _SOLE_USE_COUNT[device]


_SOLE_USE_COUNT: dict[str, int] = {}


def _measure_sole_use_count(device: str) -> int:
    """The use count of a gradient that nothing but the running Python backward holds: 1 where the engine
    hands its reference over to Python (torch 2.13), more where it keeps its own during the call. Measured
    once per device type, on a two-element graph."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad._use_count())
            return grad

    with torch.enable_grad():
        x = torch.ones(2, device=device, requires_grad=True)
        torch.autograd.grad((Probe.apply(x) * 2).sum(), x)  # the product's backward makes a fresh gradient
    return seen[0]


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` would give a matmul on t's device, or None when autocast is off there. The
    fused linear losses cast their matmul operands to it themselves (as ``F.linear`` would) and run with
    autocast off, so their chunk logits keep the dtype the kernel plans were built for."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _dtensor_type():
    """``torch.distributed.tensor.DTensor`` once something imported it (importing it here would cost ~1 s), else
    None: no tensor can be a DTensor before its module is loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def check_tensors(**tensors: torch.Tensor | None) -> torch.device:
    """Type and device checks for an op's tensor arguments (None allowed); returns the common device."""
    tensors = {name: t for name, t in tensors.items() if t is not None}
    dtensor = _dtensor_type()
    # Types first, so a DTensor gets its remedy rather than a complaint about its (mesh's) device.
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name} has an unsupported dtype {t.dtype} (the kernels take float32, bfloat16 and "
                            "float16 data, integer targets and positions)")
        if dtensor is not None and isinstance(t, dtensor):
            raise ValueError(f"{name} is a DTensor ({t.placements} on a {tuple(t.device_mesh.shape)} mesh), but the "
                             f"kernels take local tensors: pass {name}.full_tensor() (the whole array) or "
                             f"{name}.to_local() (this rank's shard, where the op is applied shard by shard); "
                             "with FSDP2 (fully_shard), call the kernels inside the module's forward, where its "
                             "parameters are unsharded")
    device = None
    first = None
    for name, t in tensors.items():
        if liger_core.INTERPRET:
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}, but the kernels run in Triton's interpreter on the "
                                 "CPU here (LIGER_INTERPRET / no GPU found); pass CPU tensors")
        elif t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; put them on one device")
    return device


class _SecondDerivative(torch.autograd.Function):
    """Identity on a backward's gradients, as a graph node that raises when differentiated."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError("liger_torch kernels are differentiable once: their gradients carry no graph, so a "
                           "derivative of a gradient (a gradient penalty, a Hessian) is not supported")


_ANCHOR = torch.zeros((), requires_grad=True)  # makes _SecondDerivative's outputs part of the graph


def once_differentiable(backward):
    """A Function's ``backward`` run without graph; under ``create_graph`` its gradients come out as part of the
    graph through a node that raises on use. torch's own ``once_differentiable`` does that only when an incoming
    gradient requires grad: the gradient of ``f(x).sum()`` then comes out as a constant, and a penalty built on
    it would silently add nothing to x's gradient."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():  # no create_graph (the engine turned grad mode off): a first derivative
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        if not any(isinstance(o, torch.Tensor) for o in outputs):
            return outputs[0] if single else outputs
        guarded = iter(_SecondDerivative.apply(_ANCHOR, *[o for o in outputs if isinstance(o, torch.Tensor)]))
        outputs = tuple(next(guarded) if isinstance(o, torch.Tensor) else o for o in outputs)
        return outputs[0] if single else outputs

    return wrapper


def refuse_grad(op: str, what: str, **tensors: torch.Tensor | None) -> None:
    """ValueError naming the first of ``tensors`` that requires grad (under grad mode): ``op`` differentiates
    ``what`` only, and a gradient silently left at None would look like a frozen parameter."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} requires grad, but liger_torch.{op} differentiates {what} only; pass "
                             f"{name}.detach()")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def capturing_cuda_graph(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``t``'s device: no host sync may happen then, so the eager
    value checks (targets, positions) step aside and the kernels' own marks (NaN for a bad value) remain."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def num_sms(device: torch.device) -> int:
    if liger_core.INTERPRET or device.type != "cuda":
        return liger_core.INTERPRETER_NUM_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Tests set this: fresh outputs are then filled with NaN (or -1 for integers) so an element the kernel never
# writes cannot pass for a result.
POISON_OUTPUTS = False


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple) -> tuple:
    return contiguous_strides(shape)  # per call, the host time of a plan's fresh buffers adds up (~1-4 us each)


def _allocate(buffers: dict, new, device) -> torch.Tensor:
    if new.alias is not None:
        target = buffers[new.alias]
        if tuple(target.shape) != tuple(new.shape) or dtype_name(target.dtype) != new.dtype:
            raise AssertionError(f"{new.name} cannot be written over {new.alias}: shape or dtype differ")
        return target
    dtype = _TORCH_DTYPES[new.dtype]
    strides = new.strides or _contiguous_strides(tuple(new.shape))
    out = torch.empty_strided(new.shape, strides, dtype=dtype, device=device)
    if new.zeroed:
        return out.zero_()
    if POISON_OUTPUTS:
        return out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def run_plan(plan: Plan, **inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Allocate each launch's outputs (or reuse the aliased input) and launch the kernels in order."""
    missing = [name for name in plan.inputs if inputs.get(name) is None]
    if missing:
        raise AssertionError(f"plan needs inputs {missing}")
    buffers = {name: inputs[name] for name in plan.inputs}
    device = buffers[plan.inputs[0]].device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for launch in plan.launches:
            outputs = []
            for new in launch.outputs:
                buffers[new.name] = _allocate(buffers, new, device)
                outputs.append(buffers[new.name])
            args = [buffers[a.name] if isinstance(a, Buf) else a for a in launch.args]
            _launch(launch, args, outputs, device)
    return tuple(buffers[name] for name in plan.outputs)


# Compiled kernels by (launch, pointer alignments, device). Triton's launch path re-derives the specialisation
# of every argument on every call (~tens of microseconds of host time per launch); a cached plan's scalars are
# fixed, so only the pointers' 16-byte alignment can change which compiled kernel applies.
_FAST_LAUNCHES: collections.OrderedDict = collections.OrderedDict()
_FAST_LAUNCHES_MAX = 4096


# Triton's interpreter keeps the running kernel's program ids (and its patched tl module) in process-global
# state: two threads interpreting at once read each other's grid index. Interpreted launches take turns.
INTERPRETER_LOCK = threading.RLock()


def _launch(launch, args, outputs, device) -> None:
    if device.type != "cuda":
        with INTERPRETER_LOCK:
            launch.kernel[launch.grid](*args, *outputs, num_warps=launch.num_warps, num_stages=launch.num_stages,
                                       **launch.constexprs)
        return
    if knobs.runtime.launch_enter_hook is not None:
        launch.kernel[launch.grid](*args, *outputs, num_warps=launch.num_warps, num_stages=launch.num_stages,
                                   **launch.constexprs)
        return
    positional = (*args, *outputs)
    aligned = tuple(a.data_ptr() % 16 == 0 for a in positional if isinstance(a, torch.Tensor))
    key = (id(launch), aligned, device.index)
    entry = _FAST_LAUNCHES.get(key)
    if entry is not None and entry[0] is launch:
        entry[1](*positional, *entry[2], stream=torch._C._cuda_getCurrentRawStream(device.index))
        return
    compiled = launch.kernel[launch.grid](*positional, num_warps=launch.num_warps, num_stages=launch.num_stages,
                                          **launch.constexprs)
    names = launch.kernel.arg_names[len(positional):]
    if compiled is None or any(name not in launch.constexprs for name in names):
        return
    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    _FAST_LAUNCHES[key] = (launch, compiled[grid], tuple(launch.constexprs[name] for name in names))
    if len(_FAST_LAUNCHES) > _FAST_LAUNCHES_MAX:
        _FAST_LAUNCHES.popitem(last=False)

