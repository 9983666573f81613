"""What a subclass, or one instance, defines otherwise than the class opttree knows.

A built-in schema describes the state its class's own code builds and keeps, and a
built-in wrapper kind says where its class keeps its optimizers. A subclass that defines
any method of its own may keep other state: any method its base's ``step`` calls (a
capture health check, the profiling hook's ``_optimizer_step_code``, emerging-optimizers'
``orthogonalize``) or that training code calls may start, count or change history in
attributes opttree never reads, and a reset would keep it in silence. So a class inherits
a built-in schema or kind only where it defines nothing but what every class body makes
(its module, docstring and the like); a method set on one instance over its class's
counts the same. The wrappers torch's own code puts around a method (the profiling hook
torch sets as ``step`` on a subclass, ``_use_grad_for_differentiable``, ``LRScheduler``'s,
``torch.compile``'s) do not count: they run the method they wrap and torch's code alone.
"""

from __future__ import annotations

import abc
import dis
import functools
import os
import sys
import sysconfig
import types
import warnings
import weakref

import torch

from opttree._dispatch import class_mro, class_namespace, static_attribute
from opttree._held import OPTIMIZER_BOOKKEEPING, own_attributes

_TORCH_CODE = os.path.dirname(torch.__file__) + os.sep

CLASS_RECORDS = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__annotations__",
        "__annotate__",
        "__annotate_func__",
        "__annotations_cache__",
        "__firstlineno__",
        "__static_attributes__",
        "__orig_bases__",
        "__parameters__",
        "__type_params__",
        "__abstractmethods__",
        "_abc_impl",
        "__final__",
    }
)
"""What Python writes into every class's namespace, or a typed or abstract class's: records
of the class, none of its behaviour."""

def _in_torch(value: object) -> bool:
    """Whether ``value`` is torch's own code: a function whose code lies in torch, a method
    of an object of a torch class bound to such a function, a builtin of a torch module
    (dynamo's ``torch._C._is_tracing``), or an object or class of a torch module
    (``torch.no_grad``'s instance, a dynamo context)."""
    function = getattr(value, "__func__", None)
    if function is not None:
        return _in_torch(function) and _in_torch(getattr(value, "__self__", None))
    code = getattr(value, "__code__", None)
    if isinstance(code, types.CodeType):
        return code.co_filename.startswith(_TORCH_CODE)
    module = getattr(value, "__module__", None) if isinstance(value, (type, types.BuiltinFunctionType)) else type(value).__module__
    return isinstance(module, str) and (module == "torch" or module.startswith("torch."))


def _torch_wrapper(function: object, inner: object, owner: object | None) -> bool:
    """Whether ``function``, which wraps ``inner``, runs torch's code alone around it: its
    code lies in torch, and so does everything its closure holds but ``inner`` (a user's
    subclass of torch's context decorator runs its own ``__enter__``). With ``owner``, a
    weak reference it holds must be to ``owner``: ``LRScheduler``'s wrapper steps the
    optimizer its reference names, another's where it was copied from another."""
    code = getattr(function, "__code__", None)
    if not isinstance(code, types.CodeType) or not (code.co_filename.startswith(_TORCH_CODE) or code in _deprecation_wrappers()):
        return False
    plain = (type(None), bool, int, float, str)
    wrapped = (inner, getattr(inner, "__func__", inner))  # LRScheduler's holds the function of the bound step it wraps
    for held in _filled_cells(function):
        if isinstance(held, weakref.ref):
            if owner is not None and held() is not owner:
                return False
        elif not (any(held is target for target in wrapped) or isinstance(held, plain) or _in_torch(held) or _is_warning(held)):
            return False
    return True


def _is_warning(value: object) -> bool:
    """Whether ``value`` is one of Python's own warning classes, as a deprecation wrapper holds."""
    return isinstance(value, type) and issubclass(value, Warning) and value.__module__ == "builtins"


@functools.cache
def _deprecation_wrappers() -> frozenset[types.CodeType]:
    """The code of the wrapper ``typing_extensions.deprecated`` (torch's own methods use it:
    ``Optimizer._cuda_graph_capture_health_check``) and ``warnings.deprecated`` put around a
    function: it warns, then runs the function it wraps, and nothing else."""
    import typing_extensions  # a dependency of torch

    makers = [typing_extensions.deprecated, getattr(warnings, "deprecated", None)]  # warnings' from Python 3.13
    found: set[types.CodeType] = set()
    for maker in makers:
        if maker is not None:
            code = getattr(maker("")(_sample), "__code__", None)
            if isinstance(code, types.CodeType):
                found.add(code)
    return frozenset(found)


def _sample() -> None:
    """A function to wrap, to find the code a decorator wraps functions with."""


def unwrapped(method: object, owner: object | None = None) -> object:
    """The function a method runs, through the wrappers torch's own code puts around it
    (``_use_grad_for_differentiable``, the profiling hook torch sets as ``step`` on a
    subclass, ``LRScheduler``'s, ``torch.compile``'s), and only those: a user's decorator
    that copies ``__wrapped__`` with ``functools.wraps`` runs code of its own, and so does
    torch's context decorator around a user's context manager. With ``owner`` (for a
    method held by an instance), a method bound to another object, or a wrapper of one
    (another optimizer's step, compiled), is what it runs itself. An object whose own
    attribute reads raise is what it runs itself."""
    for _ in range(16):
        try:
            if owner is not None and isinstance(method, types.MethodType) and method.__self__ is not owner:
                return method
            function: object = getattr(method, "__func__", method)  # a bound method
            inner: object = getattr(function, "__wrapped__", None)
            if inner is None or not _torch_wrapper(function, inner, owner):
                return function
        except Exception:  # noqa: BLE001  # an attribute value's own __getattr__ may raise anything
            return method
        method = inner
    return method


_NEUTRAL_MODULES = frozenset({"typing", "typing_extensions", "abc"})
"""Modules whose classes (``Generic``, ``Protocol``, ``ABC``) a typed or abstract subclass
takes as bases: their namespaces hold typing machinery, no optimizer's behaviour."""
_NEUTRAL_METACLASSES = (type, abc.ABCMeta)


def _defined_below(cls: type, base: type) -> list[tuple[str, object]]:
    """What ``cls`` and its bases that are not ``base`` or one of its bases define (a mixin
    placed after ``base`` too), the nearest definition of each name, records of the class
    left out (see :func:`_is_record`), and nothing of typing's and abc's own bases. Read
    raw from each class's namespace: no descriptor and no metaclass code runs."""
    inherited = set(class_mro(base))
    found: dict[str, object] = {}
    for klass in class_mro(cls):
        namespace = class_namespace(klass)
        if klass in inherited or namespace.get("__module__") in _NEUTRAL_MODULES:
            continue
        for name, value in namespace.items():
            if not _is_record(klass, name, value):
                found.setdefault(name, value)
    return list(found.items())


def _is_record(klass: type, name: str, value: object) -> bool:
    """Whether a class namespace's ``name`` is a record Python makes of every class (or a
    typed, abstract or final one): ``__dict__`` and ``__weakref__`` only as the descriptors
    Python makes (a property of that name would show opttree an instance's attributes of its
    choosing), ``__slots__`` only where it adds none."""
    if name in ("__dict__", "__weakref__"):
        return isinstance(value, types.GetSetDescriptorType) and value.__objclass__ is klass
    if name == "__slots__":
        return type(value) in (tuple, list) and not value  # by type first: a hostile object's __eq__ could raise
    return name in CLASS_RECORDS


def own_definition(cls: type, base: type) -> str | None:
    """The first name ``cls`` defines otherwise than ``base`` (see :func:`_defined_below`),
    where ``base`` is the class of the built-in schema or wrapper kind that would apply to
    it; None where it defines nothing of its own, or only torch's wrappers around ``base``'s
    methods. A metaclass of its own (but ``ABCMeta``) counts: it decides what the class's
    attribute reads give. Read afresh each time: a method set on the class later, or a
    wrapper's closure changed in place, is looked at again."""
    if cls is base:
        return None
    metaclass = type(cls)
    if metaclass is not type(base) and metaclass not in _NEUTRAL_METACLASSES:
        return f"__class__ (its metaclass {metaclass.__module__}.{metaclass.__qualname__})"
    return next(
        (name for name, value in _defined_below(cls, base) if unwrapped(value) is not unwrapped(static_attribute(base, name))),
        None,
    )


def definer(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO that defines what ``cls`` runs as ``name``: not ``cls``
    where torch has set its profiling hook over a mixin's ``step`` on ``cls`` itself."""
    own = unwrapped(static_attribute(cls, name))
    namespaces = [(klass, class_namespace(klass)) for klass in class_mro(cls)]
    exact = next((klass for klass, namespace in namespaces if namespace.get(name) is own), None)  # under torch's hook, the mixin's
    return exact or next((klass for klass, namespace in namespaces if unwrapped(namespace.get(name)) is own), cls)


def own_instance_method(instance: object) -> str | None:
    """The first attribute ``instance`` holds in its own ``__dict__`` over a method of its
    class, otherwise than the class has it (a ``step`` assigned to one Adam; not the wrapper
    ``LRScheduler`` sets there over the class's own). None where it holds none, or its
    ``__dict__`` cannot be read."""
    own = own_attributes(instance)
    names = own.keys() - OPTIMIZER_BOOKKEEPING
    if not names:
        return None
    cls = type(instance)
    for name in sorted(names):
        method = static_attribute(cls, name)
        if _is_method(method) and unwrapped(dict.__getitem__(own, name), instance) is not unwrapped(method):
            return name
    return None


def _is_method(value: object) -> bool:
    return callable(value) or isinstance(value, (classmethod, staticmethod))


def foreign_method(cls: type) -> tuple[type, str, str] | None:
    """The first method that ``cls`` or one of its bases holds in its namespace as code
    from outside the package that defines that class: a patch (``torch.optim.Adam.step =
    counting_step``), which may build, count or change state opttree does not read. As the
    class, the name and the file of that code. Methods are functions, class and static
    methods and properties, read through the wrappers torch puts around a method and
    deprecation wrappers (see :func:`unwrapped`). A base's own method is not foreign to a
    class below it: torch sets its profiling hook around a base's ``step`` on the class it
    builds (Megatron's ``TensorParallelMuon`` over emerging-optimizers' ``step``), and the
    base is read as its own package's. Python's own classes, and those of a package that
    lies nowhere on disk (a module made in memory), are not placed."""
    mro = class_mro(cls)
    for index, klass in enumerate(mro):
        namespace = class_namespace(klass)
        places = _package_places(namespace.get("__module__"))
        if not places:
            continue
        for name, value in namespace.items():
            try:
                functions = _functions_of(value)
            except Exception:  # noqa: BLE001  # a descriptor whose own reads raise runs code of its own
                return klass, name, "a descriptor whose attributes cannot be read"
            for function in functions:
                found = _foreign_code(function, places)
                if found is not None and not any(unwrapped(class_namespace(base).get(name)) is found[0] for base in mro[index + 1 :]):
                    return klass, name, found[1]
    return None


def _foreign_code(function: object, places: tuple[str, ...], depth: int = 0) -> tuple[object, str] | None:
    """The function, and its file, that ``function`` runs from outside ``places``: its own
    code, or, where that is Python's standard library (``functools.partialmethod``'s
    binding, typing's aliases), the code of what its closure holds; None where all of it
    lies in ``places`` or is Python's own. Standard-library closures nested deeper than
    opttree follows count as foreign: what they run is not known."""
    found = _code_of(function)
    if found is None or found[1].startswith(places):
        return None
    if not _pythons_own(found[1]) or depth >= 4:
        return found
    for held in _closure_values(found[0]):
        inner = _foreign_code(held, places, depth + 1)
        if inner is not None:
            return inner
    return None


def _closure_values(function: object) -> list[object]:
    """What a function's closure holds, but plain values."""
    return [held for held in _filled_cells(function) if not isinstance(held, (type(None), bool, int, float, str, bytes, type))]


def _filled_cells(function: object) -> list[object]:
    """What the cells of a function's closure hold, those not yet filled passed over."""
    found: list[object] = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            continue
    return found


def _functions_of(value: object) -> tuple[object, ...]:
    """What a class namespace's ``value`` runs when called or read: a class or static
    method's function, a property's accessors, or the value itself (not a class: what it
    runs when called is found by :func:`_code_of`) and its class's ``__get__``, which binds
    it where it is read from an instance."""
    if isinstance(value, (classmethod, staticmethod)):
        return (value.__func__,)
    if isinstance(value, property):
        return tuple(f for f in (value.fget, value.fset, value.fdel) if f is not None)
    if isinstance(value, type):
        return ()
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return (value,)
    return (value, static_attribute(type(value), "__get__"))


_STORES = frozenset({"STORE_ATTR", "DELETE_ATTR"})
_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_FAST_LOAD_FAST"})

_stored_names: dict[tuple[type, ...], frozenset[str]] = {}


def stored_attribute_names(classes: tuple[type, ...]) -> frozenset[str]:
    """The attribute names the code of the methods ``classes`` define (through torch's
    wrappers, and the functions nested in them) sets or deletes on the instance, as
    ``self.name = ...``: not those it only reads, nor those it sets on other objects
    (``param.data = ...``), which a subclass may keep state in. Kept per tuple of classes:
    reading code takes milliseconds, and the classes asked about are a library's own."""
    found = _stored_names.get(classes)
    if found is None:
        names: set[str] = set()
        for klass in classes:
            for value in class_namespace(klass).values():
                for function in _functions_of(value):
                    runs = _code_of(function)
                    code = getattr(runs[0], "__code__", None) if runs is not None else None
                    if isinstance(code, types.CodeType) and code.co_argcount:
                        _add_stored(code, code.co_varnames[0], names)
        found = _stored_names[classes] = frozenset(names)
    return found


def _add_stored(code: types.CodeType, instance: str, names: set[str]) -> None:
    """The names ``code`` stores on ``instance`` (its method's first argument), and the
    code nested in it, which reaches the instance through a closure cell of that name: the
    store's object is the value loaded just before it."""
    loaded: object = None
    for op in dis.get_instructions(code):
        if op.opname in _STORES and (loaded == instance or (isinstance(loaded, tuple) and loaded[-1:] == (instance,))):
            names.add(str(op.argval))
        loaded = op.argval if op.opname in _LOADS else None
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # a nested function, comprehension or lambda
            _add_stored(constant, instance, names)


_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")


def _pythons_own(file: str) -> bool:
    """Whether ``file`` is of Python's standard library (typing's aliases, functools'
    descriptors), not of a package installed beside it."""
    if not file.startswith(_STDLIB):
        return False
    return file[len(_STDLIB) :].split(os.sep, 1)[0] not in ("site-packages", "dist-packages")


def _code_of(function: object) -> tuple[object, str] | None:
    """The Python function ``function`` runs and the file of its code, through torch's and
    deprecation wrappers, and through any other wrapper without code of its own
    (``functools.lru_cache``'s) to the function it wraps; None where it runs none (a
    builtin, a typing alias). A chain of wrappers longer than opttree follows is named as
    code of no package's, so that it counts as foreign."""
    for _ in range(16):
        found = unwrapped(function)
        code = getattr(found, "__code__", None) if isinstance(found, types.FunctionType) else None
        if isinstance(code, types.CodeType):
            return found, code.co_filename
        inner = _runs(found)
        if inner is None:
            return None
        function = inner
    return function, "<a chain of more than 16 wrappers>"


def _runs(found: object) -> object:
    """What an object that is not a Python function runs when called: for an object of a
    class whose ``__call__`` is Python code, that code (even where it copies
    ``__wrapped__``: it runs its own first); else the function a wrapper copies as
    ``__wrapped__`` (``functools.lru_cache``'s), or a partial's function; None for a builtin."""
    if isinstance(found, (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType)):
        return None
    call = static_attribute(type(found), "__call__")
    if isinstance(call, types.FunctionType):
        return call
    inner = own_attributes(found).get("__wrapped__")
    if inner is not None:
        return inner
    if isinstance(found, (functools.partial, functools.partialmethod)):
        return found.func
    return None


def _package_places(module: object) -> tuple[str, ...]:
    """Where the package that ships the module named ``module`` lies on disk: the directory
    of its outermost regular package (one with an ``__init__``: ``megatron.core`` under the
    ``megatron`` namespace, whose other parts, such as ``megatron.bridge``, are other
    distributions' code), or a lone module's file; none where it is Python's own, not
    imported, or lies nowhere on disk. Read from the modules' own files, not from a
    namespace's ``__path__``, which an editable install fills with a placeholder."""
    if not isinstance(module, str) or module in ("builtins", *_NEUTRAL_MODULES):
        return ()
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        places = _places.get(name)
        if places is not None:
            return places
        found = sys.modules.get(name)
        if found is None:
            return ()
        file = own_attributes(found).get("__file__")
        if isinstance(file, str):  # the outermost regular package, or a module
            places = (os.path.join(os.path.dirname(file), ""),) if os.path.basename(file).startswith("__init__.") else (file,)
            _places[name] = places  # a module imported stays where it was found
            return places
    return ()


_places: dict[str, tuple[str, ...]] = {}
