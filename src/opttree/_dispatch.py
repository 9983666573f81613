"""A class-keyed ``functools.singledispatch`` table with lazy registrations by dotted path.

``singledispatch`` has no lazy hook, so this wraps it thinly (after dask's ``Dispatch``):
a registration by dotted path (``"apex.optimizers.fused_adam.FusedAdam"``) waits in a
second table until a looked-up class has that path somewhere in its MRO, or, for a path
through a re-export (``torch.optim.AdamW``), until its module has been imported and names
a class there. The class then exists, so its module was imported by the user, never by opttree.

Every class in the MRO is resolved before dispatching, so a lazily registered subclass
is found even when its parent was resolved earlier.

Threads may look classes up at once: each answer is worked out under a lock and then
kept in a plain dict, read without the lock, which every registration empties, and so
does a class registered under an ABC (``abc.get_cache_token()`` changes), as
``singledispatch`` empties its own cache, and, while a path waits, a module imported.
"""

from __future__ import annotations

import abc
import functools
import sys
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Generic, TypeVar, cast

from opttree._fields import kind_of

V = TypeVar("V")


def dotted_name(cls: type) -> str:
    """``module.QualName`` of a class, as lazy registrations name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


_MEGATRON_CLASSES: dict[type, bool] = {}


def is_megatron_class(cls: type) -> bool:
    """Whether a wrapper class is one of Megatron's or derives from one, whoever registered
    its kind: its checkpoints then need what Megatron's do (one step over its state).
    Kept per class: a class's bases do not change, and every node a tree builds below a
    Megatron wrapper asks it of the wrapper's class."""
    try:
        return _MEGATRON_CLASSES[cls]
    except KeyError:
        found = _MEGATRON_CLASSES[cls] = bool(megatron_bases(cls))
        return found


def megatron_bases(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that are Megatron's own (by their module), itself included."""
    return [base for base in cls.__mro__ if str(getattr(base, "__module__", "")).partition(".")[0] == "megatron"]


class_namespace = cast(Callable[[type], Mapping[str, object]], type.__dict__["__dict__"].__get__)
"""A class's own namespace, read without running a metaclass's ``__getattribute__``."""

class_mro = cast(Callable[[type], tuple[type, ...]], type.__dict__["__mro__"].__get__)
"""A class's MRO, read without running a metaclass's ``__getattribute__``."""


def static_attribute(cls: type, name: str) -> object:
    """What ``cls``'s namespaces hold as ``name``, the nearest first, or None: read raw,
    running no descriptor and no metaclass code (which could hide a method, or raise)."""
    return next((namespace[name] for namespace in map(class_namespace, class_mro(cls)) if name in namespace), None)


def imported_class(dotted: str) -> type | None:
    """The class a dotted path names where its module is imported already, read from the
    module's and classes' own namespaces, running no code: ``torch.optim.AdamW`` names
    ``torch.optim.adamw.AdamW``. None where it names none, or where the module is not a
    plain module (one ``importlib.util.LazyLoader`` made runs its import when read).

    The module is the longest prefix in ``sys.modules`` of at most :data:`_MODULE_DEPTH`
    parts (a stand-in may sit there without its parent packages): joining every prefix of
    a path of 20,000 parts took about 20 seconds."""
    parts = dotted.split(".")
    imported = _imported_prefix(parts)
    if imported is None:
        return None
    module, split = imported
    found = module.__dict__.get(parts[split])
    for name in parts[split + 1 :]:
        found = class_namespace(found).get(name) if isinstance(found, type) else None
    return found if isinstance(found, type) else None


def imported_non_class(dotted: str) -> str | None:
    """What a dotted path names where that is no class, read as :func:`imported_class`
    reads it: a module, or a module's function or other object ("a module", "a function
    in torch.optim.adamw"). None where it names a class or nothing yet (a class made at
    run time names its module without being in it, and matches its path all the same)."""
    if dotted in sys.modules:
        return "a module"
    parts = dotted.split(".")
    imported = _imported_prefix(parts)
    if imported is None or imported[1] != len(parts) - 1:
        return None
    module, split = imported
    found = module.__dict__.get(parts[split])
    if found is None or isinstance(found, type):
        return None
    return f"{kind_of(found)} in {'.'.join(parts[:split])}"


def _imported_prefix(parts: list[str]) -> tuple[ModuleType, int] | None:
    """The module the longest prefix of ``parts`` names in ``sys.modules`` (of at most
    :data:`_MODULE_DEPTH` parts) and how many parts it takes; None where no prefix is
    imported or the longest is not a plain module."""
    for split in range(min(len(parts) - 1, _MODULE_DEPTH), 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is not None:
            return (module, split) if type(module) is ModuleType else None
    return None


_MODULE_DEPTH = 32
"""More parts than any module's name holds (torch's deepest have about eight)."""


def _untellable(registered: type, cls: type, raised: Exception) -> str:
    return (
        f"whether the registration of {dotted_name(registered)} applies to {dotted_name(cls)} cannot be told: "
        f"its subclass check raised {type(raised).__name__}: {raised}"
    )


def _unregistered(_: object) -> type | None:
    return None


def _owner_of(cls: type) -> Callable[[object], type | None]:
    return lambda _: cls


class LazyDispatch(Generic[V]):
    """Maps a class to the value registered for it or its nearest registered ancestor."""

    def __init__(self) -> None:
        self._owners = functools.singledispatch(_unregistered)
        self._values: dict[type, V] = {}
        self._lazy: dict[str, V] = {}
        self._found: dict[type, tuple[type, V] | str | None] = {}
        self._twice: dict[type, str] = {}
        """Classes registered under two of their paths, met once both were imported."""
        self._token = self._cache_token()
        self._lock = threading.Lock()

    def _cache_token(self) -> tuple[object, int]:
        """What the answers kept hold for: the ABC registrations, and, while a path waits,
        the modules imported (one may have brought a re-exported class it names)."""
        return abc.get_cache_token(), len(sys.modules) if self._lazy else 0

    def register(self, cls: type, value: V) -> None:
        with self._lock:
            self._add(cls, value)
            self._forget()

    def register_lazy(self, dotted: str, value: V) -> None:
        with self._lock:
            self._lazy[dotted] = value
            self._forget()

    def _forget(self) -> None:
        self._found.clear()

    def is_registered(self, cls_or_dotted: type | str) -> bool:
        """Whether a value is registered for this class or path: under its own path, or,
        where its module is imported, under a path re-exporting it (or the class it names)."""
        with self._lock:
            if isinstance(cls_or_dotted, str):
                named = imported_class(cls_or_dotted)
                return (
                    cls_or_dotted in self._lazy
                    or any(dotted_name(cls) == cls_or_dotted for cls in self._values)
                    or (named is not None and self._holds(named))
                )
            return self._holds(cls_or_dotted)

    def _holds(self, cls: type) -> bool:
        """Under the lock: whether ``cls`` has a value, or a waiting path names it."""
        return cls in self._values or dotted_name(cls) in self._lazy or any(imported_class(dotted) is cls for dotted in self._lazy)

    def lookup(self, cls: type) -> V | None:
        found = self.lookup_owner(cls)
        return None if found is None else found[1]

    def lookup_owner(self, cls: type) -> tuple[type, V] | None:
        """The registered class whose value applies to ``cls`` (itself or its nearest
        registered ancestor), and that value."""
        found = self.resolved(cls)
        return None if isinstance(found, str) else found

    def resolved(self, cls: type) -> tuple[type, V] | str | None:
        """:meth:`lookup_owner`'s answer, or, where registrations apply to ``cls``
        ambiguously, why (see :meth:`ambiguity`): one answer, read at once, which another
        thread's registration or import cannot split."""
        token = self._cache_token()
        if token != self._token:  # a class registered under an ABC, or a module imported, may now have a value
            with self._lock:
                self._forget()
                self._token = token
        try:
            return self._found[cls]
        except KeyError:
            with self._lock:
                return self._resolve(cls)

    def _unresolved(self, cls: type, error: Exception) -> str:
        """Under the lock: why ``cls`` has no value where singledispatch raised ``error``: a
        registered ABC whose ``__subclasshook__`` (or ``__instancecheck__``-side code) raises
        for it cannot tell whether it applies; else two registrations apply, neither nearer."""
        applying: list[type] = []
        for registered in self._values:
            try:
                if issubclass(cls, registered):
                    applying.append(registered)
            except Exception as raised:  # noqa: BLE001  # a user's hook may raise anything
                return _untellable(registered, cls, raised)
        nearest: list[type] = []
        for a in applying:
            try:
                if not any(b is not a and issubclass(b, a) for b in applying):
                    nearest.append(a)
            except Exception as raised:  # noqa: BLE001  # asked about another registration, the hook may raise too
                return _untellable(a, cls, raised)
        if len(nearest) < 2:
            return f"{dotted_name(cls)} cannot be looked up: {type(error).__name__}: {error}"
        names = " and ".join(sorted(map(dotted_name, nearest)))
        return f"{dotted_name(cls)} is registered through both {names}, neither a subclass of the other: register {cls.__qualname__} itself"

    def ambiguity(self, cls: type) -> str | None:
        """Why ``cls`` has no value though registrations apply to it: two registered
        classes it derives from (abstract ones, through ``register`` or a subclass hook),
        neither a subclass of the other, so that no one value is its own. None otherwise."""
        found = self.resolved(cls)
        return found if isinstance(found, str) else None

    def _add(self, cls: type, value: V) -> None:
        self._values[cls] = value
        self._owners.register(cls, _owner_of(cls))

    def _resolve(self, cls: type) -> tuple[type, V] | str | None:
        """Under the lock. A class resolved here needs no emptying of ``_found``: a class
        found earlier that has it in its MRO would have resolved it then."""
        for klass in cls.__mro__:
            dotted = dotted_name(klass)
            if dotted in self._lazy:
                self._add(klass, self._lazy.pop(dotted))
        for dotted in list(self._lazy):  # a path through a re-export (torch.optim.AdamW), once imported
            imported = imported_class(dotted)
            if imported is None:
                continue
            value = self._lazy.pop(dotted)
            if imported in self._values:  # registered under its own path as well, before either was imported
                self._twice[imported] = (
                    f"{dotted_name(imported)} is registered under two of its paths ({dotted} too), which of them "
                    "applies depending on what was imported first: register it once"
                )
            else:
                self._add(imported, value)
        found: tuple[type, V] | str | None
        try:
            owner = self._owners.dispatch(cls)(None)
        except Exception as error:  # noqa: BLE001  # singledispatch's "Ambiguous dispatch", or a registered ABC's own hook
            found = self._unresolved(cls, error)
        else:
            found = None if owner is None else self._twice.get(owner, (owner, self._values[owner]))
        self._found[cls] = found
        return found
