"""Where the kernels run: compiled for a GPU, or in Triton's interpreter on the CPU.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is *decorated*, so the choice has to be made
before any kernel module of ``liger_core`` is imported; ``liger_core/__init__.py`` calls :func:`configure`
first. The choice:

- ``LIGER_INTERPRET=1`` forces the interpreter, ``LIGER_INTERPRET=0`` forbids it (kernels then need a GPU);
- unset, the interpreter is used when no NVIDIA GPU is visible (one warning says so).

GPU detection uses NVML / the presence of the driver, never ``cuInit``, so importing the library does not create
a CUDA context (that would break ``fork``-based data loaders).
"""

from __future__ import annotations

import ctypes
import os
import warnings

ENV_VAR = "LIGER_INTERPRET"

_state: dict[str, bool] = {}


class InterpreterModeWarning(UserWarning):
    """Emitted once when kernels fall back to Triton's interpreter because no GPU was found."""


def _nvml_device_count() -> int | None:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint(0)
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
        return count.value if ok else None
    except AttributeError:
        return None


def gpu_visible() -> bool:
    """True when an NVIDIA GPU is visible to this process (without initialising CUDA)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    count = _nvml_device_count()
    if count is not None:
        return count > 0
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return os.path.exists("/dev/nvidiactl")


def _parse_flag(value: str) -> bool | None:
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("", "auto"):
        return None
    raise ValueError(f"{ENV_VAR} must be 1, 0 or auto, got {value!r}")


def configure() -> bool:
    """Decide once per process whether kernels are interpreted; returns that decision."""
    if "interpret" in _state:
        return _state["interpret"]
    forced = _parse_flag(os.environ.get(ENV_VAR, ""))
    if forced is None:
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1" or not gpu_visible()
        if interpret and os.environ.get("TRITON_INTERPRET", "0") != "1":
            warnings.warn(
                "liger_core: no NVIDIA GPU found, so the Triton kernels run in Triton's interpreter on the CPU "
                f"(slow; for tests and development). Set {ENV_VAR}=0 to forbid this, {ENV_VAR}=1 to silence it.",
                InterpreterModeWarning,
                stacklevel=3,
            )
    else:
        interpret = forced
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        # The interpreter runs kernels in numpy, which warns where the GPU silently follows IEEE (a running max
        # starting at -3e38 overflows to -inf on purpose, exp2(-inf) = 0); the kernels' results are what count.
        warnings.filterwarnings("ignore", message="(overflow|invalid value|divide by zero) encountered",
                                category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(f"{ENV_VAR}=0 but TRITON_INTERPRET=1 is set in the environment; unset one of them")
    _state["interpret"] = interpret
    return interpret


def interpreting() -> bool:
    """True when the kernels of this process run in Triton's interpreter."""
    return configure()
