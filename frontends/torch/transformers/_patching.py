"""Bookkeeping of patches: kernel subclasses of HF classes, a journal of module-level changes (so that
``revert_liger_kernel`` can undo them exactly), and instance patching by swapping ``__class__``."""

from __future__ import annotations

import copy
import copyreg
import sys
import types

# (family name, target object, attribute, previous value or _MISSING), in the order applied.
_JOURNAL: list[tuple[str, object, str, object]] = []
_MISSING = object()
_SUBCLASSES: dict[tuple, type] = {}


def set_attr(family: str, target, name: str, value) -> None:
    """``setattr(target, name, value)``, journaled. For a class the previous value is the one in its own
    ``__dict__`` (an inherited method is restored by deleting the override)."""
    previous = target.__dict__.get(name, _MISSING) if isinstance(target, type) else getattr(target, name, _MISSING)
    _JOURNAL.append((family, target, name, previous))
    setattr(target, name, value)


def journal_length() -> int:
    return len(_JOURNAL)


def revert(family: str | None = None, since: int = 0) -> int:
    """Undo journaled patches (newest first): all, or one family's, or those made after ``since``."""
    undone = 0
    for i in range(len(_JOURNAL) - 1, since - 1, -1):
        fam, target, name, previous = _JOURNAL[i]
        if family is not None and fam != family:
            continue
        if previous is _MISSING:
            delattr(target, name)
        else:
            setattr(target, name, previous)
        del _JOURNAL[i]
        undone += 1
    return undone


def patched_families() -> list[str]:
    return sorted({fam for fam, *_ in _JOURNAL})


def original_class(cls: type) -> type:
    while is_liger(cls):
        cls = cls.__dict__["_liger_base"]
    return cls


def is_liger(cls: type) -> bool:
    return "_liger_base" in cls.__dict__


def liger_subclass(base: type, kind: str, key: tuple, namespace: dict, keep_name: bool = False) -> type:
    """A cached subclass of ``base`` with ``namespace`` (methods and settings) overriding it. Same constructor,
    attributes and parameters, so an instance's ``__class__`` may be swapped between the two. The name is
    ``Liger<Base>`` (it still contains ``RMSNorm`` etc., which transformers' weight init matches on) unless
    ``keep_name`` (model classes: ``save_pretrained`` writes the class name into ``config.architectures``).
    Its module and qualified name are the base's, where class-level patching puts it; an instance pickles as the
    class found there (``_reduce_as_reachable``)."""
    base = original_class(base)
    cache_key = (base, kind, key)
    if cache_key not in _SUBCLASSES:
        name = base.__name__ if keep_name else f"Liger{base.__name__}"
        ns = {"_liger_base": base, "_liger_kind": kind, "__module__": base.__module__,
              "__qualname__": base.__qualname__, "__reduce_ex__": _reduce_as_reachable,
              "__deepcopy__": _deepcopy_keeping_class, **namespace}
        _SUBCLASSES[cache_key] = type(name, (base,), ns)
    return _SUBCLASSES[cache_key]


def _reachable(cls: type) -> type:
    """The class that ``cls``'s module and qualified name lead to now: ``cls`` itself under class-level
    patching, the unpatched class under instance patching (or after a revert)."""
    found = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, original_class(cls)) else original_class(cls)


def _reduce_as_reachable(self, protocol):
    """pickle (``torch.save(model)``) records a class by module and name, where an instance-patched module's
    class is not: it is pickled as the class found there, so it loads unpatched (patch it again after loading)
    and, in a process patched at class level, as the patched class."""
    # copyreg's own reconstructor (pickle's for protocols 0 and 1): __newobj__ must name the object's class
    return copyreg._reconstructor, (_reachable(type(self)), object, None), self.__getstate__()


def _deepcopy_keeping_class(self, memo):
    """``copy.deepcopy`` of a patched instance stays patched (it would otherwise go through
    ``_reduce_as_reachable``): the default copy, with the instance's own class."""
    clone = type(self).__new__(type(self))
    memo[id(self)] = clone
    clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
    return clone


def swap_classes(model, mapping: dict[type, type]) -> int:
    """Set ``module.__class__`` to ``mapping[type(module)]`` for every submodule (PEFT wrappers included: their
    inner modules are ordinary HF modules). Returns the number of modules changed."""
    count = 0
    for module in model.modules():
        cls = type(module)
        base = original_class(cls)
        if base in mapping and cls is not mapping[base]:
            module.__class__ = mapping[base]
            count += 1
    return count


def unswap_classes(model) -> int:
    count = 0
    for module in model.modules():
        if is_liger(type(module)):
            module.__class__ = type(module).__dict__["_liger_base"]
            count += 1
    return count


def with_globals(func, overrides: dict):
    """A copy of ``func`` whose code sees ``overrides`` in place of its module globals.

    Follows a ``functools.wraps`` chain (decorators that keep the wrapped function in a closure cell, like
    transformers' ``deprecate_kwarg``): the innermost function is rebuilt with a globals dict that is a copy of
    its module's plus ``overrides``, and each wrapper is rebuilt with its cell pointing to the new inner function.
    Used to give one model instance's attention layers the kernel RoPE without changing the modeling module."""
    inner = getattr(func, "__wrapped__", None)
    if inner is not None and func.__closure__:
        new_inner = with_globals(inner, overrides)
        cells, replaced = [], False
        for cell in func.__closure__:
            try:
                contents = cell.cell_contents
            except ValueError:
                cells.append(cell)
                continue
            if contents is inner:
                cells.append(types.CellType(new_inner))
                replaced = True
            else:
                cells.append(cell)
        if replaced:
            new = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, tuple(cells))
            new.__kwdefaults__ = func.__kwdefaults__
            new.__dict__.update(func.__dict__)
            new.__wrapped__ = new_inner
            new.__qualname__ = func.__qualname__
            return new
    if not any(name in func.__code__.co_names for name in overrides) and inner is not None:
        raise TypeError(f"cannot rebind the globals of {func.__qualname__}")
    scope = dict(func.__globals__)
    scope.update(overrides)
    new = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    new.__kwdefaults__ = func.__kwdefaults__
    new.__dict__.update(func.__dict__)
    new.__qualname__ = func.__qualname__
    return new
