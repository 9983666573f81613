"""The two lookup tables opttree consults: users' registrations first, then built-ins."""

from __future__ import annotations

import abc
import builtins
import os
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar, cast, overload

import torch

from opttree._adapter import (
    MEGATRON_KINDS,
    ChildrenFn,
    Expander,
    builtin_kinds,
    children_expander,
    expand_leaf,
    function_failed,
    is_pair,
    yielded_wrongly,
)
from opttree._dispatch import LazyDispatch, dotted_name
from opttree._errors import OptTreeError, RegistrationError
from opttree._schemas import builtin_schemas
from opttree._schema import StateSchema, StepLocation
from opttree._selection import INNER_PARAMS, InnerParams
from opttree._fields import kind_of

_builtin_schemas = builtin_schemas()
_user_schemas: LazyDispatch[StateSchema] = LazyDispatch()
_builtin_kinds = builtin_kinds()
_user_kinds: LazyDispatch[Expander] = LazyDispatch()


STATE_BUILDERS = ("step", "_init_group", "pre_weight_update_fn_inplace", "post_weight_update_fn_inplace", "__init__", "add_param_group")
"""The methods in which torch's, Megatron's and emerging-optimizers' classes build their
state, or may: the last two of the first four are the hooks emerging-optimizers'
orthogonalized optimizers call around each update (where ``MuonHyperball`` keeps its
radius); ``__init__`` builds Adagrad's, and a subclass's may build entries for every
parameter before any step; ``add_param_group`` is where Adagrad builds a later group's. A
built-in schema describes the state its class's own methods build: a subclass that defines
one of them otherwise may build other state (other defaults set in its own ``__init__``
included), so it inherits no built-in schema. A user's registration applies to the
class's subclasses as it says."""

INSTANCE_BUILDERS = frozenset(STATE_BUILDERS) - {"__init__"}
"""The state-building methods an instance may hold in its own ``__dict__``, in place of
its class's (torch's ``LRScheduler`` sets a wrapper of the class's ``step`` there)."""

_TORCH_CODE = os.path.dirname(torch.__file__) + os.sep

_differing: weakref.WeakKeyDictionary[type, dict[tuple[type, tuple[object, ...]], str | None]] = weakref.WeakKeyDictionary()


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


def _torch_wrapper(function: object, inner: object) -> bool:
    """Whether ``function``, which wraps ``inner``, runs torch's code alone around it: its
    code lies in torch, and so does everything its closure holds but ``inner`` (a user's
    subclass of torch's context decorator runs its own ``__enter__``)."""
    code = getattr(function, "__code__", None)
    if not isinstance(code, types.CodeType) or not code.co_filename.startswith(_TORCH_CODE):
        return False
    cells = getattr(function, "__closure__", None) or ()
    plain = (type(None), bool, int, float, str, weakref.ref)
    wrapped = (inner, getattr(inner, "__func__", inner))  # LRScheduler's holds the function of the bound step it wraps
    for cell in cells:
        try:
            held: object = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
        if not (any(held is target for target in wrapped) or isinstance(held, plain) or _in_torch(held)):
            return False
    return True


def _unwrapped(method: object) -> object:
    """The function a method runs, through the wrappers torch's own code puts around it
    (``_use_grad_for_differentiable``, the profiling hook torch sets as ``step`` on a
    subclass, ``LRScheduler``'s, ``torch.compile``'s), and only those: a user's decorator
    that copies ``__wrapped__`` with ``functools.wraps`` runs code of its own, and so does
    torch's context decorator around a user's context manager."""
    for _ in range(16):
        function: object = getattr(method, "__func__", method)  # a bound method
        inner: object = getattr(function, "__wrapped__", None)
        if inner is None or not _torch_wrapper(function, inner):
            return function
        method = inner
    return method


def _own_builder(cls: type, base: type) -> str | None:
    """The first of the methods that build ``base``'s state (see :data:`STATE_BUILDERS`)
    that ``cls`` defines otherwise than ``base``, the class of the built-in schema that
    would apply to it; None where it builds state with ``base``'s own methods. Kept per
    class and the methods it has now, so that a method set on the class later is looked at
    again, and forgotten with the class."""
    if cls is base:
        return None
    names = STATE_BUILDERS
    methods = tuple(getattr(cls, name, None) for name in names)
    known = _differing.setdefault(cls, {})
    try:
        return known[(base, methods)]
    except KeyError:
        pass
    differing = next(
        (name for name, method in zip(names, methods, strict=True) if _unwrapped(method) is not _unwrapped(getattr(base, name, None))),
        None,
    )
    known[(base, methods)] = differing
    return differing


def _applying(cls: type) -> tuple[StateSchema | None, tuple[type, str] | None]:
    """The schema that applies to ``cls``, and, where a built-in one would but ``cls``
    builds its state with methods of its own (see :data:`STATE_BUILDERS`), the class of
    that schema and the method, in its place. A user's registration wins; one that applies
    ambiguously leaves no schema."""
    users = _user_schemas.resolved(cls)
    if users is not None:
        return (None, None) if isinstance(users, str) else (users[1], None)
    found = _builtin_schemas.lookup_owner(cls)
    if found is None:
        return None, None
    method = _own_builder(cls, found[0])
    return (found[1], None) if method is None else (None, (found[0], method))


def schema_for(cls: type) -> StateSchema | None:
    """The state schema opttree applies to a leaf optimizer class, or None.

    A user's registration for the class or a base of it wins; then a built-in schema of
    the class or its nearest base, where the class builds its state with that base's own
    methods (:data:`STATE_BUILDERS`: a subclass defining one otherwise is not known). A
    class that users' registrations apply to ambiguously has none. See
    :func:`opttree.register_schema`.
    """
    if not isinstance(cast(object, cls), type):
        msg = f"schema_for takes an optimizer class, got {kind_of(cls)}"
        raise OptTreeError(msg)
    return _applying(cls)[0]


def instance_builder(optimizer: object) -> str | None:
    """The first state-building method (:data:`INSTANCE_BUILDERS`) that ``optimizer`` holds
    in its own ``__dict__`` otherwise than its class has it, where a built-in schema
    applies to the class: a ``step`` set on one instance may build other state, as a
    subclass's may. None where it holds none, or a user's registration applies."""
    own = getattr(optimizer, "__dict__", None)
    if not isinstance(own, dict) or INSTANCE_BUILDERS.isdisjoint(own):
        return None
    cls = type(optimizer)
    if _user_schemas.resolved(cls) is not None:
        return None
    return next(
        (name for name in STATE_BUILDERS if name in own and _unwrapped(own[name]) is not _unwrapped(getattr(cls, name, None))),
        None,
    )


def instance_builder_reason(optimizer: object, method: str) -> str:
    """Why a leaf whose instance holds its own ``method`` is refused."""
    cls = type(optimizer)
    return (
        f"this {cls.__qualname__} holds its own {method} on the instance, otherwise than its class {dotted_name(cls)}, "
        "whose state opttree knows, builds its state: opttree cannot tell that it builds the same state; "
        "set it on a subclass and register that, if it does"
    )


def unregistered_reason(cls: type) -> str:
    """Why a leaf class has no schema."""
    ambiguity = _user_schemas.ambiguity(cls)
    if ambiguity is not None:
        return ambiguity
    overridden = _applying(cls)[1]
    if overridden is None:
        return f"no state schema is registered for {dotted_name(cls)}"
    base, method = overridden
    own_method = _unwrapped(getattr(cls, method, None))  # torch sets a hook over a mixin's step on the class itself
    definer = next((klass for klass in cls.__mro__ if vars(klass).get(method) is own_method), cls)
    own = f"defines its own {method}" if definer is cls else f"takes its own {method} from {dotted_name(definer)}"
    return (
        f"{dotted_name(cls)} {own}, where its base {dotted_name(base)}, whose state opttree knows, "
        "builds its state: opttree cannot tell that it builds the same state"
        f"{' (it does not read the code of an __init__, even one that only sets other defaults)' if method == '__init__' else ''}; "
        "if it does, register it with that schema: "
        f"opttree.register_schema({cls.__qualname__}, opttree.schema_for({base.__qualname__}))"
    )


def step_location(cls: type) -> StepLocation | None:
    """Where a leaf class counts its steps, or None for a class without a schema."""
    schema = schema_for(cls)
    return None if schema is None else schema.step


def kind_for(cls: type) -> Expander | None:
    """A class's wrapper kind (or leaf kind): a user's registration wins over a built-in
    one; none where users' registrations apply to it ambiguously."""
    users = _user_kinds.resolved(cls)
    if users is None:
        return _builtin_kinds.lookup(cls)
    return None if isinstance(users, str) else users[1]


def _is_dotted(path: str) -> bool:
    """Whether ``path`` is ``module.QualName`` as :func:`~opttree._dispatch.dotted_name`
    writes it: a path no class has (``"Lion"``, ``"pkg..Lion"``, one with spaces) would never apply."""
    parts = path.split(".")
    return len(parts) > 1 and all(part.isidentifier() or part == "<locals>" for part in parts)


def _refuse_non_class(function: str, cls_or_dotted: object) -> None:
    if not isinstance(cls_or_dotted, (type, str)):
        msg = f"{function} registers a class or a dotted path, got {kind_of(cls_or_dotted)}"
        raise RegistrationError(msg)
    if isinstance(cls_or_dotted, str) and not _is_dotted(cls_or_dotted):
        msg = f"{function} registers a class or its dotted path, module and class name ('my_pkg.optim.Lion'), got {cls_or_dotted!r}"
        raise RegistrationError(msg)


def _refuse_odd_class(function: str, cls_or_dotted: type | str) -> None:
    """A class no leaf or wrapper can be: a schema for a class that is not an optimizer
    (nor an ABC optimizers are registered under) or for a wrapper kind opttree knows, whose
    leaves carry the schemas, would never be used; a wrapper kind for a base class of
    torch's optimizers would make every optimizer, and every object, a wrapper."""
    if isinstance(cls_or_dotted, str):
        _refuse_odd_path(function, cls_or_dotted)
        return
    name = dotted_name(cls_or_dotted)
    if function == "register_schema":
        if cls_or_dotted is abc.ABC:
            msg = "register_schema registers an optimizer class, got abc.ABC, a base of every abstract class"
            raise RegistrationError(msg)
        if not issubclass(cls_or_dotted, torch.optim.Optimizer) and not isinstance(cls_or_dotted, abc.ABCMeta):
            msg = f"register_schema registers an optimizer class (or an ABC optimizer classes are registered under), got {name}"
            raise RegistrationError(msg)
        if _builtin_kinds.lookup(cls_or_dotted) not in (None, expand_leaf):
            msg = f"{name} is a wrapper kind opttree knows: the optimizers it holds carry the schemas"
            raise RegistrationError(msg)
    elif issubclass(torch.optim.Optimizer, cls_or_dotted):
        msg = f"register_wrapper registers a wrapper class, got {name}, a base of every torch optimizer"
        raise RegistrationError(msg)
    if cls_or_dotted is abc.ABC or vars(builtins).get(cls_or_dotted.__qualname__) is cls_or_dotted:
        msg = f"{function} registers an optimizer or wrapper class, got {name}, one of Python's own"
        raise RegistrationError(msg)


def _refuse_odd_path(function: str, dotted: str) -> None:
    """:func:`_refuse_odd_class` for a class named by its dotted path, as far as the path
    tells: Python's own classes, the wrapper kinds opttree knows, torch's optimizer bases."""
    if dotted.startswith("builtins.") or dotted == "abc.ABC":
        msg = f"{function} registers an optimizer or wrapper class, got {dotted}, one of Python's own"
        raise RegistrationError(msg)
    if function == "register_schema" and dotted in MEGATRON_KINDS:
        msg = f"{dotted} is a wrapper kind opttree knows: the optimizers it holds carry the schemas"
        raise RegistrationError(msg)
    if function == "register_wrapper" and dotted in {dotted_name(base) for base in torch.optim.Optimizer.__mro__}:
        msg = f"register_wrapper registers a wrapper class, got {dotted}, a base of every torch optimizer"
        raise RegistrationError(msg)


def _refuse_uncallable(name: str, function: object) -> None:
    if not callable(function):
        msg = f"register_wrapper needs a callable {name} function, got {kind_of(function)}"
        raise RegistrationError(msg)


def _refuse_repeat(table: LazyDispatch[StateSchema] | LazyDispatch[Expander], what: str, cls_or_dotted: type | str) -> None:
    if table.is_registered(cls_or_dotted):
        name = cls_or_dotted if isinstance(cls_or_dotted, str) else dotted_name(cls_or_dotted)
        msg = f"a {what} for {name} is registered already"
        raise RegistrationError(msg)


def _refuse_both(cls_or_dotted: type | str, registering: str) -> None:
    """A class is a leaf or a wrapper, not both: where it were, its wrapper kind would win
    and its schema would go unused in silence."""
    other, table = ("wrapper kind", _user_kinds) if registering == "schema" else ("schema", _user_schemas)
    if table.is_registered(cls_or_dotted):
        name = cls_or_dotted if isinstance(cls_or_dotted, str) else dotted_name(cls_or_dotted)
        msg = f"a {other} for {name} is registered already: a class is a leaf with a schema or a wrapper, not both"
        raise RegistrationError(msg)


def register_schema(cls_or_dotted: type | str, schema: StateSchema | None) -> None:
    """Register the state schema of a leaf optimizer class and its subclasses.

    A dotted path (``"my_pkg.optim.Lion"``) registers lazily: the module is never
    imported by opttree, and the schema applies once such an object is met. A user's
    schema takes precedence over a built-in one for the class and its subclasses.
    ``schema`` may be what :func:`schema_for` gives (``register_schema(MyAdamW,
    schema_for(AdamW))``), so None is taken by the signature and refused here.
    """
    if schema is None:
        msg = "register_schema expects a StateSchema, got None (schema_for gives None for a class opttree has no schema for)"
        raise RegistrationError(msg)
    if not isinstance(cast(object, schema), StateSchema):
        msg = f"register_schema expects a StateSchema, got {type(schema).__qualname__}"
        raise RegistrationError(msg)
    _refuse_non_class("register_schema", cls_or_dotted)
    _refuse_repeat(_user_schemas, "schema", cls_or_dotted)
    _refuse_both(cls_or_dotted, "schema")
    _refuse_odd_class("register_schema", cls_or_dotted)
    if isinstance(cls_or_dotted, str):
        _user_schemas.register_lazy(cls_or_dotted, schema)
    else:
        _user_schemas.register(cls_or_dotted, schema)


_Wrapper = TypeVar("_Wrapper")


@overload
def register_wrapper(
    cls_or_dotted: type[_Wrapper],
    *,
    children: Callable[[_Wrapper], Iterable[tuple[str, object]]],
    inner_params: Callable[[_Wrapper, str], Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]] | None = None,
) -> None: ...


@overload
def register_wrapper(cls_or_dotted: str, *, children: ChildrenFn, inner_params: InnerParams | None = None) -> None: ...


def register_wrapper(
    cls_or_dotted: type | str,
    *,
    children: Callable[..., Iterable[tuple[str, object]]],
    inner_params: Callable[..., Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]] | None = None,
) -> None:
    """Register a wrapper kind: ``children(wrapper)`` yields ``(label, inner)`` pairs.

    The wrapper becomes a :class:`~opttree.WrapperNode` whose children are built from
    the inner objects, which may be optimizers or other wrappers. If the wrapper steps
    copies of its parameters, ``inner_params(wrapper, path)`` yields ``(param, copies)``
    pairs so that a partial reset can follow a parameter to its copies.
    """
    _refuse_non_class("register_wrapper", cls_or_dotted)
    _refuse_uncallable("children", children)
    if inner_params is not None:
        _refuse_uncallable("inner_params", inner_params)
    _refuse_repeat(_user_kinds, "wrapper kind", cls_or_dotted)
    _refuse_both(cls_or_dotted, "wrapper")
    _refuse_odd_class("register_wrapper", cls_or_dotted)
    expand = children_expander(children)
    if isinstance(cls_or_dotted, str):
        _user_kinds.register_lazy(cls_or_dotted, expand)
        if inner_params is not None:
            INNER_PARAMS.register_lazy(cls_or_dotted, guarded_inner_params(inner_params))
    else:
        _user_kinds.register(cls_or_dotted, expand)
        if inner_params is not None:
            INNER_PARAMS.register(cls_or_dotted, guarded_inner_params(inner_params))


def guarded_inner_params(inner_params: InnerParams) -> InnerParams:
    """A user-registered ``inner_params`` function, whose failure, or output other than
    ``(param, copies)`` pairs, is refused as a malformed wrapper, as a failing children
    function is, not raised from wherever it is read. What ``param`` and the copies are
    is checked where they are used: :mod:`opttree._masters` reports one that is not a tensor."""

    def pairs(wrapper: object, path: str) -> list[tuple[torch.Tensor, Sequence[torch.Tensor]]]:
        try:
            found: list[object] = list(inner_params(wrapper, path))
        except Exception as error:  # an OptTreeError too: a nested opttree call's names its own object
            raise function_failed("inner_params", wrapper, path, error) from error
        for item in found:
            if not is_pair(item) or not isinstance(item[1], (list, tuple)):
                raise yielded_wrongly("inner_params", wrapper, path, item, "(param, copies) pairs with copies a list or tuple of tensors")
        return cast(list[tuple[torch.Tensor, Sequence[torch.Tensor]]], found)

    return pairs
