"""A bounds check for kernels run in Triton's interpreter: every masked-in load and store must fall inside the
storage of one of the launch's tensor arguments.

The interpreter reads and writes raw host addresses, so an access past a buffer reads a neighbour's bytes
(a silent wrong value, or nothing at all where the lane is discarded later) and segfaults only when the address
lands on an unmapped page. On the GPU the same access is an illegal-address fault, or garbage. With the check on,
such an access raises ``OutOfBoundsAccess`` naming the kernel, the operation and the first stray address.

``install()`` is idempotent; the test suite's conftest and the distributed worker call it when the kernels run
in the interpreter. LIGER_BOUNDS_CHECK=0 in the environment makes it do nothing.
"""

from __future__ import annotations

import os
import threading

import numpy as np

_state = threading.local()  # the running launch's (kernel name, [(first byte, end byte), ...]); per thread (jax
# callbacks launch from XLA's threads)


class OutOfBoundsAccess(AssertionError):
    pass


def _storage_ranges(args):
    ranges = []
    for arg in args:
        if isinstance(arg, (tuple, list)):
            ranges += _storage_ranges(arg)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges


def _check(ptrs, mask, itemsize, operation):
    launch = getattr(_state, "launch", None)
    if launch is None:  # not inside a launch this module saw start (should not happen): nothing to check against
        return
    kernel, ranges = launch
    addresses = np.asarray(ptrs, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask, dtype=bool), addresses.shape)]
    addresses = addresses.ravel()
    inside = np.zeros(addresses.shape, dtype=bool)
    for first, end in ranges:
        inside |= (addresses >= first) & (addresses + np.uint64(itemsize) <= end)
    if not inside.all():
        stray = addresses[~inside]
        nearest = min(ranges, key=lambda r: min(abs(int(stray[0]) - r[0]), abs(int(stray[0]) - r[1])), default=None)
        where = "" if nearest is None else (
            f"; the nearest argument storage is [{nearest[0]:#x}, {nearest[1]:#x}), "
            f"{int(stray[0]) - nearest[1]:+d} bytes past its end" if int(stray[0]) >= nearest[1]
            else f"; the nearest argument storage starts {nearest[0] - int(stray[0])} bytes after it")
        raise OutOfBoundsAccess(f"{kernel}: {operation} of {len(stray)} element(s) outside every argument's storage, "
                                f"first at {int(stray[0]):#x}{where}")


def install():
    if os.environ.get("LIGER_BOUNDS_CHECK", "1") == "0":
        return
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    if getattr(executor, "_liger_bounds_checked", False):
        return
    init_args, call = executor._init_args_hst, executor.__call__
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _state.launch = (getattr(self.fn, "__name__", "kernel"),
                         _storage_ranges(list(args_hst) + list(kwargs_hst.values())))
        return args_hst, kwargs_hst

    def call_checked(self, *args, **kwargs):
        outer = getattr(_state, "launch", None)
        try:
            return call(self, *args, **kwargs)
        finally:
            _state.launch = outer

    def itemsize(ptrs):
        return np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize

    def masked_load_checked(self, ptrs, mask, other, *args):
        _check(ptrs.data, mask.data, itemsize(ptrs), "load")
        return masked_load(self, ptrs, mask, other, *args)

    def masked_store_checked(self, ptrs, value, mask, *args):
        _check(ptrs.data, mask.data, itemsize(ptrs), "store")
        return masked_store(self, ptrs, value, mask, *args)

    executor._init_args_hst, executor.__call__ = init_args_checked, call_checked
    builder.create_masked_load, builder.create_masked_store = masked_load_checked, masked_store_checked
    executor._liger_bounds_checked = True
