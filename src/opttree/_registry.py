"""The two lookup tables opttree consults: users' registrations first, then built-ins."""

from __future__ import annotations

import abc
import builtins
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar, cast, overload

import torch

from opttree._adapter import (
    MEGATRON_KINDS,
    ChildrenFn,
    Expander,
    builtin_kinds,
    children_expander,
    expand_chained,
    expand_leaf,
    expand_unknown_megatron,
    function_failed,
    is_pair,
    refusing_kind,
    yielded_wrongly,
)
from opttree._dispatch import LazyDispatch, dotted_name, imported_class, imported_non_class
from opttree._errors import OptTreeError, RegistrationError
from opttree._schemas import builtin_schemas
from opttree._schema import StateSchema, StepLocation
from opttree._selection import INNER_PARAMS, InnerParams
from opttree._fields import kind_of
from opttree._overrides import definer, foreign_method, own_definition, own_instance_method

_builtin_schemas = builtin_schemas()
_user_schemas: LazyDispatch[StateSchema] = LazyDispatch()
_builtin_kinds = builtin_kinds()
_user_kinds: LazyDispatch[Expander] = LazyDispatch()


def _applying(cls: type) -> tuple[StateSchema | None, tuple[type, str] | None]:
    """The schema that applies to ``cls``, and, where a built-in one would but ``cls``
    defines something of its own (see :mod:`opttree._overrides`), the class of that
    schema and the name, in its place. A user's registration wins, and covers the classes
    below the class it names whatever they define (a family of the user's own); but one
    for a class opttree has a schema of its own for (AdamW's schema registered again, to
    accept a patch of AdamW) vouches for that class, not for a subclass's own methods,
    which stay refused as they were. One that applies ambiguously leaves no schema."""
    users = _user_schemas.resolved(cls)
    if isinstance(users, str):
        return None, None
    if users is not None and not _is_builtin(users[0]):
        return users[1], None
    found = _builtin_schemas.lookup_owner(cls)
    if found is None:
        return None, None
    schema = found[1] if users is None else users[1]
    method = own_definition(cls, found[0])
    return (schema, None) if method is None else (None, (found[0], method))


def _is_builtin(cls: type) -> bool:
    """Whether opttree has a schema of its own for ``cls`` itself."""
    found = _builtin_schemas.lookup_owner(cls)
    return found is not None and found[0] is cls


def schema_for(cls: type) -> StateSchema | None:
    """The state schema opttree applies to a leaf optimizer class, or None.

    A user's registration for the class or a base of it wins; then a built-in schema of
    the class or its nearest base, where the class defines no method of its own (see
    :mod:`opttree._overrides`: a subclass that does may keep other state). A
    class that users' registrations apply to ambiguously has none. See
    :func:`opttree.register_schema`.
    """
    if not isinstance(cast(object, cls), type):
        msg = f"schema_for takes an optimizer class, got {kind_of(cls)}"
        raise OptTreeError(msg)
    return _applying(cls)[0]


def builds_as_its_schema_says(cls: type) -> bool:
    """Whether ``cls``'s state is built as its schema's own class builds it: the schema is
    opttree's built-in one, which applies because ``cls`` defines nothing of its own. A
    user's schema (a class whose ``__init__`` builds a step of shape ``(1,)``, registered with
    Adam's) says what the state holds, not the shapes and dtypes its class builds."""
    return _user_schemas.resolved(cls) is None and _applying(cls)[0] is not None


def instance_builder(optimizer: object) -> str | None:
    """The first method ``optimizer`` holds in its own ``__dict__`` over its class's,
    where a built-in schema applies to the class: a ``step`` set on one instance may keep
    other state, as a subclass's may. None where it holds none, or a user's registration
    of a class of their own applies (see :func:`_vouched_for_instances`)."""
    return _unregistered_instance_method(optimizer, _user_schemas, _builtin_schemas)


def wrapper_instance_method(wrapper: object) -> str | None:
    """The first method a wrapper of a built-in kind holds in its own ``__dict__`` over its
    class's (a ``step`` that warms the lr up, set on one ChainedOptimizer): where its kind
    is a user's registration of a class of their own, the registration says what it keeps."""
    return _unregistered_instance_method(wrapper, _user_kinds, _builtin_kinds)


def _unregistered_instance_method(
    obj: object, registrations: LazyDispatch[StateSchema] | LazyDispatch[Expander], builtins: LazyDispatch[StateSchema] | LazyDispatch[Expander]
) -> str | None:
    method = own_instance_method(obj)
    if method is None or _vouched_for_instances(type(obj), registrations, builtins):
        return None
    return method


def _vouched_for_instances(
    cls: type, registrations: LazyDispatch[StateSchema] | LazyDispatch[Expander], builtins: LazyDispatch[StateSchema] | LazyDispatch[Expander]
) -> bool:
    """Whether a user's registration applying to ``cls`` is for a class of the user's own
    (none opttree has a schema or kind for itself), at or below the built-in one that
    would apply: their word for its instances too. One for a class opttree knows (AdamW's
    registered again, Adam's for an AdamW, MegatronOptimizer's for Megatron's wrappers) is
    their word for that class, not for a method set on one instance."""
    users = registrations.resolved(cls)
    if not isinstance(users, tuple):
        return False
    own = builtins.lookup_owner(users[0])
    nearest = builtins.lookup_owner(cls)
    return (own is None or own[0] is not users[0]) and (nearest is None or issubclass(users[0], nearest[0]))


def _registered_at_or_below(registrations: LazyDispatch[StateSchema] | LazyDispatch[Expander], cls: type, known: type) -> bool:
    """Whether a user's registration applying to ``cls`` is for ``known`` (the class of
    the built-in schema or kind that would apply) or a class below it: the user's word
    for what ``known``, as it is now, keeps. One for a base of it (Adam's, for a patched
    AdamW; MegatronOptimizer's, for a patched Float16OptimizerWithFloat16Params) is not."""
    users = registrations.resolved(cls)
    return isinstance(users, tuple) and issubclass(users[0], known)


def patched_schema_reason(cls: type) -> str | None:
    """Why a leaf class whose built-in schema applies is refused: the class the schema is
    for, or a base of it, holds a method patched in from outside its package (see
    :func:`~opttree._overrides.foreign_method`); None where none is, or a user's
    registration for that class or below it applies, which is the user's word for what
    the class keeps."""
    found = _builtin_schemas.lookup_owner(cls)
    patch = None if found is None else foreign_method(found[0])
    if found is None or patch is None or _registered_at_or_below(_user_schemas, cls, found[0]):
        return None
    return (
        f"{_patch_text(patch)}: a patch of a class whose state opttree knows may build, count or change state it does "
        f"not read; if it keeps none, register the schema yourself: opttree.register_schema({cls.__qualname__}, "
        f"opttree.schema_for({cls.__qualname__}))"
    )


def patched_kind_reason(cls: type) -> str | None:
    """:func:`patched_schema_reason` for a wrapper of a built-in kind: a patched method
    may keep optimizers or state its kind does not say."""
    found = _builtin_kinds.lookup_owner(cls)
    if found is None or not _is_wrapper_kind(found):  # a leaf's schema says; an unknown one is refused
        return None
    patch = foreign_method(found[0])
    if patch is None or _registered_at_or_below(_user_kinds, cls, found[0]):
        return None
    return (
        f"{_patch_text(patch)}: a patch of a wrapper kind opttree knows may keep optimizers or state the kind does not "
        "say; undo the patch, or, if it keeps none, register the class with opttree.register_wrapper(cls, children=...), "
        "naming its optimizers (children=lambda w: [(\"optimizer\", w.optimizer)] for one over a single optimizer)"
    )


def _patch_text(patch: tuple[type, str, str]) -> str:
    klass, name, file = patch
    return f"{dotted_name(klass)}.{name} runs code from {file}, outside the package that defines {klass.__qualname__}"


def instance_builder_reason(optimizer: object, method: str) -> str:
    """Why a leaf whose instance holds its own ``method`` is refused."""
    cls = type(optimizer)
    return (
        f"this {cls.__qualname__} holds its own {method} on the instance, otherwise than its class {dotted_name(cls)}, "
        "whose state opttree knows, keeps its state: opttree cannot tell that it keeps the same state; "
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
    base, name = overridden
    return (
        f"{_own_text(cls, name)}, where its base {dotted_name(base)}, whose state opttree knows, "
        "builds and keeps its state: a method of its own may build, count or change state opttree does not read"
        f"{' (it does not read the code of an __init__, even one that only sets other defaults)' if name == '__init__' else ''}; "
        "if it keeps the same state, register it with that schema: "
        f"opttree.register_schema({cls.__qualname__}, opttree.schema_for({base.__qualname__}))"
    )


def _own_text(cls: type, name: str) -> str:
    """``cls`` defines its own ``name``, or takes it from a mixin or base of its own."""
    found = definer(cls, name)
    return f"{dotted_name(cls)} defines its own {name}" if found is cls else f"{dotted_name(cls)} takes its own {name} from {dotted_name(found)}"


def step_location(cls: type) -> StepLocation | None:
    """Where a leaf class counts its steps, or None for a class without a schema."""
    schema = schema_for(cls)
    return None if schema is None else schema.step


def kind_for(cls: type) -> Expander | None:
    """A class's wrapper kind (or leaf kind): a user's registration wins over a built-in
    one; none where users' registrations apply to it ambiguously. A subclass of a built-in
    wrapper kind that defines anything of its own (see :mod:`opttree._overrides`) may keep
    optimizers or state elsewhere: its kind refuses it until it is registered. A user's
    registration covers the subclasses of a class of the user's own whatever they define;
    one for a class of a built-in kind (registered again, to accept a patch of it) is the
    user's word for that class, and its subclasses' own methods stay refused."""
    users = _user_kinds.resolved(cls)
    if isinstance(users, str):
        return refusing_kind(users)
    if users is not None:
        leaf = _schema_owner(cls)
        if leaf is None:
            return _users_kind(cls, *users)
        if leaf is users[0]:
            return refusing_kind(
                f"{dotted_name(leaf)} is registered as a wrapper kind and has a schema: a class is a leaf with a schema "
                "or a wrapper, not both"
            )
        wrapper_at, leaf_at = _base_index(cls, users[0]), _base_index(cls, leaf)
        if wrapper_at == 0:
            return _users_kind(cls, *users)
        if leaf_at != 0:
            if wrapper_at is None or leaf_at is None:
                return refusing_kind(
                    f"{dotted_name(cls)} has a schema, for {dotted_name(leaf)}, and a wrapper kind, for "
                    f"{dotted_name(users[0])}, one of them through an ABC it is registered under, not one of its bases, "
                    "so neither is nearer: register the class itself with register_schema or register_wrapper"
                )
            if wrapper_at < leaf_at:
                return _users_kind(cls, *users)
        # a schema nearer than the wrapper kind: a leaf, as the schema says
    found = _builtin_kinds.lookup_owner(cls)
    if found is None:
        return None
    base, expand = found
    if not _is_wrapper_kind(found):  # leaves: their schemas say
        return expand
    return _unless_own(cls, base, expand)


def registered_wrapper(cls: type) -> bool:
    """Whether a user's ``register_wrapper`` applies to ``cls``."""
    return isinstance(_user_kinds.resolved(cls), tuple)


def builtin_chain(cls: type) -> bool:
    """Whether ``cls`` is a chain by its built-in kind (a ``ChainedOptimizer`` or a
    subclass), whatever a user registered it as."""
    return _builtin_kinds.lookup(cls) is expand_chained


def _users_kind(cls: type, owner: type, expand: Expander) -> Expander:
    """A user's kind, registered for ``owner``, as it applies to ``cls``."""
    builtin = _builtin_kinds.lookup_owner(owner)
    if builtin is None or builtin[0] is not owner or not _is_wrapper_kind(builtin):
        return expand
    nearest = _builtin_kinds.lookup_owner(cls)
    return expand if nearest is None else _unless_own(cls, nearest[0], expand)


def _is_wrapper_kind(found: tuple[type, Expander]) -> bool:
    """Whether a built-in kind is a wrapper's: not a leaf's, nor an unknown Megatron one's."""
    return found[1] is not expand_leaf and found[1] is not expand_unknown_megatron


def _unless_own(cls: type, base: type, expand: Expander) -> Expander:
    """``expand``, or a refusing kind where ``cls`` defines something of its own below
    ``base``, a wrapper kind opttree knows."""
    name = own_definition(cls, base)
    if name is None:
        return expand
    return refusing_kind(
        f"{_own_text(cls, name)}, where its base {dotted_name(base)}, a wrapper kind opttree knows, keeps its optimizers "
        "and state where opttree reads them: a method of its own may keep others; register it with "
        "opttree.register_wrapper(cls, children=...) to say where its optimizers are"
    )


def _schema_owner(cls: type) -> type | None:
    """The class whose schema applies to ``cls`` (a user's, else a built-in one), or None."""
    users = _user_schemas.resolved(cls)
    if isinstance(users, tuple):
        return users[0]
    found = _builtin_schemas.lookup_owner(cls)
    return None if found is None else found[0]


def _base_index(cls: type, owner: type) -> int | None:
    """Where ``owner`` is in ``cls``'s bases (0 for ``cls`` itself), or None for an ABC
    ``cls`` is registered under: of a schema and a wrapper kind that both apply, the nearer
    one does (a wrapper kind for a base does not make a subclass with a schema of its own a
    wrapper, whose reset would then reset nothing), and where one applies through an ABC
    neither is nearer unless the other is registered for ``cls`` itself."""
    mro = cls.__mro__
    return mro.index(owner) if owner in mro else None


def _is_dotted(path: str) -> bool:
    """Whether ``path`` is ``module.QualName`` as :func:`~opttree._dispatch.dotted_name`
    writes it: a path no class has (``"Lion"``, ``"pkg..Lion"``, one with spaces) would never apply."""
    parts = path.split(".")
    return len(parts) > 1 and all(part.isidentifier() or part == "<locals>" for part in parts)


def _class_or_dotted(function: str, cls_or_dotted: object) -> type | str:
    """``cls_or_dotted``, refused unless it is a class or a dotted path to one."""
    if not isinstance(cls_or_dotted, (type, str)):
        msg = f"{function} registers a class or a dotted path, got {kind_of(cls_or_dotted)}"
        raise RegistrationError(msg)
    if isinstance(cls_or_dotted, str) and not _is_dotted(cls_or_dotted):
        msg = f"{function} registers a class or its dotted path, module and class name ('my_pkg.optim.Lion'), got {cls_or_dotted!r}"
        raise RegistrationError(msg)
    return cls_or_dotted


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
    elif _schema_owner(cls_or_dotted) is cls_or_dotted:
        msg = f"{name} has a schema: a class is a leaf with a schema or a wrapper, not both"
        raise RegistrationError(msg)
    if cls_or_dotted is abc.ABC or vars(builtins).get(cls_or_dotted.__qualname__) is cls_or_dotted:
        msg = f"{function} registers an optimizer or wrapper class, got {name}, one of Python's own"
        raise RegistrationError(msg)


def _refuse_odd_path(function: str, dotted: str) -> None:
    """:func:`_refuse_odd_class` for a class named by its dotted path: the class itself
    where the path names one already imported (``torch.optim.Optimizer``, a re-export of
    ``torch.optim.optimizer.Optimizer``), else as far as the path tells: Python's own
    classes, the wrapper kinds opttree knows, torch's optimizer bases."""
    if dotted.startswith("builtins.") or dotted == "abc.ABC":
        msg = f"{function} registers an optimizer or wrapper class, got {dotted}, one of Python's own"
        raise RegistrationError(msg)
    named = imported_class(dotted)
    if named is not None:
        _refuse_odd_class(function, named)
        return
    other = imported_non_class(dotted)
    if other is not None:
        msg = f"{function} registers a class or its dotted path, got {dotted!r}, which names {other}"
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
    _class_or_dotted("register_schema", cls_or_dotted)
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
    # Not ``type[_Wrapper]`` alone: mypy refuses an abstract class there (``type-abstract``),
    # and a wrapper kind is often registered for an abstract base such as MegatronOptimizer.
    cls_or_dotted: type[_Wrapper] | Callable[..., _Wrapper],
    *,
    children: Callable[[_Wrapper], Iterable[tuple[str, object]]],
    inner_params: Callable[[_Wrapper, str], Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]] | None = None,
) -> None: ...


@overload
def register_wrapper(cls_or_dotted: str, *, children: ChildrenFn, inner_params: InnerParams | None = None) -> None: ...


def register_wrapper(
    cls_or_dotted: type | str | Callable[..., object],
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
    target = _class_or_dotted("register_wrapper", cls_or_dotted)
    _refuse_uncallable("children", children)
    if inner_params is not None:
        _refuse_uncallable("inner_params", inner_params)
    _refuse_repeat(_user_kinds, "wrapper kind", target)
    _refuse_both(target, "wrapper")
    _refuse_odd_class("register_wrapper", target)
    expand = children_expander(children)
    if isinstance(target, str):
        _user_kinds.register_lazy(target, expand)
        if inner_params is not None:
            INNER_PARAMS.register_lazy(target, guarded_inner_params(inner_params))
    else:
        _user_kinds.register(target, expand)
        if inner_params is not None:
            INNER_PARAMS.register(target, guarded_inner_params(inner_params))


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
