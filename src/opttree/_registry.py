"""The two lookup tables opttree consults: users' registrations first, then built-ins."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar, cast, overload

import torch

from opttree._adapter import ChildrenFn, Expander, builtin_kinds, children_expander, function_failed, is_pair, yielded_wrongly
from opttree._dispatch import LazyDispatch, dotted_name
from opttree._errors import OptTreeError, RegistrationError
from opttree._schemas import builtin_schemas
from opttree._schema import StateSchema, StepLocation
from opttree._selection import INNER_PARAMS, InnerParams

_builtin_schemas = builtin_schemas()
_user_schemas: LazyDispatch[StateSchema] = LazyDispatch()
_builtin_kinds = builtin_kinds()
_user_kinds: LazyDispatch[Expander] = LazyDispatch()


def schema_for(cls: type) -> StateSchema | None:
    """The schema of a leaf class: a user's registration wins over a built-in one. A class
    that users' registrations apply to ambiguously has none: see :func:`unregistered_reason`."""
    schema = _user_schemas.lookup(cls)
    if schema is None and _user_schemas.ambiguity(cls) is None:
        return _builtin_schemas.lookup(cls)
    return schema


def unregistered_reason(cls: type) -> str:
    """Why a leaf class has no schema."""
    return _user_schemas.ambiguity(cls) or f"no state schema is registered for {cls.__module__}.{cls.__qualname__}"


def step_location(cls: type) -> StepLocation | None:
    """Where a leaf class counts its steps, or None for a class without a schema."""
    schema = schema_for(cls)
    return None if schema is None else schema.step


def kind_for(cls: type) -> Expander | None:
    """A class's wrapper kind (or leaf kind): a user's registration wins over a built-in
    one; none where users' registrations apply to it ambiguously."""
    expand = _user_kinds.lookup(cls)
    if expand is None and _user_kinds.ambiguity(cls) is None:
        return _builtin_kinds.lookup(cls)
    return expand


def _is_dotted(path: str) -> bool:
    """Whether ``path`` is ``module.QualName`` as :func:`~opttree._dispatch.dotted_name`
    writes it: a path no class has (``"Lion"``, ``"pkg..Lion"``, one with spaces) would never apply."""
    parts = path.split(".")
    return len(parts) > 1 and all(part.isidentifier() or part == "<locals>" for part in parts)


def _refuse_non_class(function: str, cls_or_dotted: object) -> None:
    if not isinstance(cls_or_dotted, (type, str)):
        msg = f"{function} registers a class or a dotted path, got a {type(cls_or_dotted).__qualname__}"
        raise RegistrationError(msg)
    if isinstance(cls_or_dotted, str) and not _is_dotted(cls_or_dotted):
        msg = f"{function} registers a class or its dotted path, module and class name ('my_pkg.optim.Lion'), got {cls_or_dotted!r}"
        raise RegistrationError(msg)


def _refuse_uncallable(name: str, function: object) -> None:
    if not callable(function):
        msg = f"register_wrapper needs a callable {name} function, got a {type(function).__qualname__}"
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


def register_schema(cls_or_dotted: type | str, schema: StateSchema) -> None:
    """Register the state schema of a leaf optimizer class and its subclasses.

    A dotted path (``"my_pkg.optim.Lion"``) registers lazily: the module is never
    imported by opttree, and the schema applies once such an object is met. A user's
    schema takes precedence over a built-in one for the class and its subclasses.
    """
    if not isinstance(cast(object, schema), StateSchema):
        msg = f"register_schema expects a StateSchema, got {type(schema).__qualname__}"
        raise RegistrationError(msg)
    _refuse_non_class("register_schema", cls_or_dotted)
    _refuse_repeat(_user_schemas, "schema", cls_or_dotted)
    _refuse_both(cls_or_dotted, "schema")
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
        except OptTreeError:
            raise
        except Exception as error:
            raise function_failed("inner_params", wrapper, path, error) from error
        for item in found:
            if not is_pair(item) or not isinstance(item[1], (list, tuple)):
                raise yielded_wrongly("inner_params", wrapper, path, item, "(param, copies) pairs with copies a list or tuple of tensors")
        return cast(list[tuple[torch.Tensor, Sequence[torch.Tensor]]], found)

    return pairs
