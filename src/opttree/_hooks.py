"""Step hooks: code that runs inside an optimizer's ``step()`` besides its class's own.

torch runs an optimizer's own step pre- and post-hooks (``register_step_pre_hook``) and
its global ones (``register_optimizer_step_pre_hook``) in every ``step()``. A hook may
build or change state (start a moment from the first gradient where an entry is empty,
count in a closure of its own), as a subclass's ``step`` may, so a reset is exact only
where each hook is known to leave optimizer state alone: Megatron's own (a
HybridDeviceOptimizer copies its sub-optimizers' parameters back after each step), or one a
user declares with :func:`register_step_hook`. Any other is refused, as an instance's own
``step`` is.

Megatron's and torch's own hooks are known by their function's module and qualified
name, so that the closures a wrapper makes anew for each sub-optimizer are one hook; a
user's declared hooks by their function's code object, which every closure of one ``def``
shares, and a function defined anew under the same name (a notebook cell run again, with a
count of its own) does not; a callable object by its class's ``__call__``, the function
it runs, so that its instances are one hook too. Names are read where a function's code
says them (the ``__name__`` of the globals it was defined in, and its code's
``co_qualname``), not from its ``__module__`` and ``__qualname__``, which
``functools.wraps`` copies onto a decorator's wrapper: a wrapper around a declared hook runs
its own code, and is a hook of its own: a function that records one it wraps
(``__wrapped__``: ``functools.wraps``, torch's ``no_grad`` decorator) is known by its own
function and that function together, so that one decorator's wrappers of two hooks are two.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import chain, repeat
from types import BuiltinFunctionType, FunctionType
from typing import TypeVar, cast

from torch.optim import optimizer as torch_optimizer

from opttree._errors import RegistrationError
from opttree._fields import kind_of
from opttree._held import own_attributes

_HYBRID = "HybridDeviceOptimizer._register_param_copy_back_gpu_hook.<locals>."
_BUILTIN: frozenset[tuple[tuple[str, str], ...]] = frozenset(
    {
        (("megatron.core.optimizer.cpu_offloading.hybrid_optimizer", _HYBRID + "param_copy_back_gpu_hook_closure.<locals>.param_copy_back_gpu_hook"),),
        (("megatron.core.optimizer.cpu_offloading.hybrid_optimizer", _HYBRID + "fp32_param_copy_back_gpu_hook_closure.<locals>.fp32_param_copy_back_gpu_hook"),),
        (("torch.profiler", "_optimizer_post_hook"),),  # counts steps for the Kineto profiler
    }
)
"""Hooks read in their sources and known to leave optimizer state alone, by module and
qualified name (each a function that wraps none)."""

_registered: set[tuple[object, ...]] = set()
"""The hooks users declared, each by :func:`_code_key`."""
_lock = threading.Lock()

_OWN = (("_optimizer_step_pre_hooks", "step pre-hook"), ("_optimizer_step_post_hooks", "step post-hook"))
_GLOBAL = (("_global_optimizer_pre_hooks", "step pre-hook"), ("_global_optimizer_post_hooks", "step post-hook"))


def _function(hook: object) -> object:
    """The function a hook runs: a bound method's or a ``functools.partial``'s, and a
    callable object's class's ``__call__``, as its bound ``__call__`` would be. An object
    that has a qualified name of its own (a function, or one ``functools.wraps`` named) is
    known by it; an instance has none."""
    for _ in range(8):
        inner: object
        if isinstance(hook, functools.partial):
            inner = hook.func
        elif hasattr(hook, "__qualname__"):
            inner = getattr(hook, "__func__", None)
        else:
            inner = _class_call(type(hook))
        if inner is None:
            return hook
        hook = inner
    return hook


def _class_call(cls: type) -> object:
    """The ``__call__`` that calling an instance of ``cls`` runs: found along its MRO, as
    Python finds it, not on its metaclass (``type.__call__``, which makes instances)."""
    return next((vars(base)["__call__"] for base in cls.__mro__ if "__call__" in vars(base)), None)


HookKey = tuple[tuple[str, str], ...]
"""What a hook is known by: the module and qualified name of the function it runs, then of
each function that one wraps (``__wrapped__``, as ``functools.wraps`` and torch's context
decorators record it), outermost first."""


def _key(hook: object) -> HookKey | None:
    """A hook's :data:`HookKey`, or None where a function along it has no name to be known
    by (``str`` itself: a subclass's own hash could say anything), or the chain is longer
    than opttree follows."""
    return _chain(hook, _name_of)


def _code_key(hook: object) -> tuple[object, ...] | None:
    """What a declared hook is known by: the code object of the function it runs, then of
    each function that one wraps (a C function, which has none, by itself); None as for
    :func:`_key`."""
    return _chain(hook, _code_of)


_Part = TypeVar("_Part")


def _chain(hook: object, read: Callable[[object], _Part | None]) -> tuple[_Part, ...] | None:
    """``read`` of the function ``hook`` runs, then of each function that one wraps
    (``__wrapped__``), outermost first; None where one reads as None, or the chain is
    longer than opttree follows."""
    parts: list[_Part] = []
    for _ in range(8):
        try:
            function = _function(hook)
        except Exception:  # noqa: BLE001  # an object's own __getattr__ may raise anything
            return None
        part = read(function)
        if part is None:
            return None
        parts.append(part)
        hook = own_attributes(function).get("__wrapped__") if isinstance(function, FunctionType) else None
        if hook is None:
            return tuple(parts)
    return None


def _code_of(function: object) -> object | None:
    if isinstance(function, FunctionType):
        return function.__code__
    return function if isinstance(function, BuiltinFunctionType) else None


def _name_of(function: object) -> tuple[str, str] | None:
    if isinstance(function, FunctionType):
        return _code_name(function)
    if isinstance(function, BuiltinFunctionType):  # C's: their names cannot be set
        module, qualname = function.__module__, function.__qualname__
        return (module, qualname) if type(module) is str and type(qualname) is str else None
    return None


def _code_name(function: FunctionType) -> tuple[str, str] | None:
    """Where a Python function's code was defined: the module its globals are, and the
    qualified name its code object was compiled under; None where its globals name none."""
    module = dict.get(function.__globals__, "__name__")
    return (module, function.__code__.co_qualname) if type(module) is str else None


def hook_name(hook: object) -> str:
    key = _key(hook)
    return kind_of(hook) if key is None else " around ".join(map(".".join, key))


def _known(hook: object) -> bool:
    return _key(hook) in _BUILTIN or _code_key(hook) in _registered


def register_step_hook(hook: Callable[..., object]) -> None:
    """Declare that ``hook``, a step pre- or post-hook, leaves optimizer state alone (it
    logs, times, casts gradients or copies parameters): optimizers holding it are then
    reset as any other. It is known by its function's module and qualified name, so every
    closure one function makes counts; a callable object is known by its class's
    ``__call__`` (declare that function, or any instance), so every instance of a class
    with that ``__call__`` counts, whatever its attributes hold, as a closure's cells may
    hold anything. Only declare hooks that neither build nor change state, nor keep counts
    of their own that a reset would leave behind, for every closure or instance: a reset
    cannot see them."""
    if not callable(cast(object, hook)):  # untyped callers pass anything
        msg = f"register_step_hook takes the hook function, got {kind_of(hook)}"
        raise RegistrationError(msg)
    key = _declarable_key(hook)
    if isinstance(key, str):
        raise RegistrationError(key)
    with _lock:
        _registered.add(key)


def _declarable_key(hook: object) -> tuple[object, ...] | str:
    """What ``hook`` is declared by (see :func:`_code_key`), or why it cannot be declared:
    its functions must have names (:func:`_key`) that are not shared by every lambda."""
    key = _key(hook)
    code = _code_key(hook)
    if key is None or code is None:
        return (
            f"{kind_of(hook)} runs a function that has no module and qualified name to be known by (a callable object "
            "is known by its class's __call__, which a class written in C has not): make the hook a function of your own"
        )
    unnamed = [part for _, qualname in key for part in qualname.split(".") if part.startswith("<") and part != "<locals>"]
    if unnamed:
        return (
            f"{hook_name(hook)} is known by a name that every {unnamed[0]} defined there shares: declaring it would declare "
            "them all; give the hook a def of its own"
        )
    return code


_NOT_A_DICT = object()


def _first_unknown(hooks: object) -> object:
    """The first of ``hooks`` not known to leave state alone; :data:`_NOT_A_DICT` where
    they are not held in the dict torch holds them in, whose contents nothing can tell;
    None where there are none, or every one is known."""
    if hooks is None:
        return None
    if not isinstance(hooks, dict):
        return _NOT_A_DICT
    for hook in dict.values(hooks):  # dict's own: a subclass's values() is its code
        if not _known(hook):
            return hook
    return None


def _unknown_in(held: Callable[[str], object], attributes: tuple[tuple[str, str], ...], whose: str, inside: str) -> str | None:
    """Why the hooks ``held`` gives under ``attributes`` make a reset unsafe, or None."""
    for attribute, kind in attributes:
        hooks = held(attribute)
        found = _first_unknown(hooks)
        if found is _NOT_A_DICT:
            return _reason(f"{whose} {kind}s, held in {kind_of(hooks)} where torch holds a dict, run inside {inside}")
        if found is not None:
            declared_as = _declarable_key(found)
            return _reason(f"{whose} {kind} {hook_name(found)} runs inside {inside}", declared_as if isinstance(declared_as, str) else None)
    return None


def unknown_step_hook(optimizer: object) -> str | None:
    """Why ``optimizer``'s own step hooks make its reset unsafe, or None."""
    return _unknown_in(own_attributes(optimizer).get, _OWN, "its", "its step")


_DICT = operator.attrgetter("__dict__")
_CODE = operator.attrgetter("__code__")


def surely_known_hooks(optimizers: Sequence[object]) -> bool:
    """Whether every step hook of ``optimizers`` (a run of sibling leaves) is surely known,
    read over the run at once, at C speed, where they are held as torch holds them (plain
    functions in an ``OrderedDict``); False sends the run to :func:`unknown_step_hook`,
    leaf by leaf, which names the hook."""
    try:
        owns = list(map(_DICT, optimizers))
    except Exception:  # noqa: BLE001  # no __dict__, or a class's own __getattribute__ that raises: see unknown_step_hook
        return False
    if set(map(type, owns)) != {dict}:
        return False
    for attribute, _ in _OWN:
        held = list(map(dict.get, owns, repeat(attribute)))
        if not set(map(type, held)) <= {OrderedDict, type(None)}:
            return False
        hooks = list(chain.from_iterable(map(dict.values, filter(None, held))))
        if not hooks:
            continue
        if set(map(type, hooks)) != {FunctionType} or any(map(operator.contains, map(_DICT, hooks), repeat("__wrapped__"))):
            return False  # a wrapper is known by what it wraps too: named leaf by leaf
        if not ({(name,) for name in map(_code_name, hooks)} <= _BUILTIN or {(code,) for code in map(_CODE, hooks)} <= _registered):
            return False  # some of each, or an unknown one: told leaf by leaf
    return True


def unknown_global_step_hook() -> str | None:
    """Why torch's global step hooks, which run in every optimizer's ``step()``, make a
    reset unsafe, or None."""
    return _unknown_in(lambda attribute: getattr(torch_optimizer, attribute, None), _GLOBAL, "torch's global", "every optimizer's step")


def _reason(what: str, undeclarable: str | None = None) -> str:
    """Why a hook makes a reset unsafe, and what to do: declare it, or, where it cannot be
    declared as it is (``undeclarable``: a lambda), first make it declarable."""
    advice = "declare it with opttree.register_step_hook" if undeclarable is None else f"it cannot be declared as it is ({undeclarable}), then declare that with opttree.register_step_hook"
    return f"{what}: opttree cannot tell that it builds and changes no state, so a reset could not be exact; if it leaves optimizer state alone, {advice}"
