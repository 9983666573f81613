"""Optimizers a wrapper or a leaf holds in its attributes, found without knowing its layout.

A safety net under the adapter: a wrapper kind says where its children are, but a
wrapper that also keeps an optimizer elsewhere (a list of "active" optimizers, a dict
of per-name lists, a record of per-module records) would make a reset silently miss that
optimizer's state, and so would a leaf that steps another optimizer beside its own state.
Every optimizer object reachable from a wrapper's instance attributes, or a leaf's other
than torch's bookkeeping, through at most :data:`DEPTH` nested holders (lists, tuples,
deques, dict keys and values, sets, frozensets, dataclass fields and ``SimpleNamespace``
attributes, the object a bound method is bound to, a ``functools.partial``'s function and
arguments, a weak reference's referent, the instance attributes and slots of any other
collection, where ``UserList``, ``UserDict`` and ``ChainMap`` keep their members, or, for
one built in C without them, what it refers to (a ``mappingproxy``'s dict), in any mix:
``aux['ema'][0]``) must therefore be a node of the tree.

The search never runs a holder's own code: the members of a list, tuple, deque, dict or
set (of a subclass too) are read through the built-in class's own methods, so an
overridden ``__iter__`` is neither called nor able to hide them, and a method's, partial's
or weak reference's through the built-in descriptors; only a dataclass field is read with
``getattr``, and one whose property raises is passed over. Other objects' attributes
(but a collection's) are not looked into. Tensors and modules are not
looked into. A container is looked into once (again only where more depth is left), so
one that holds itself ends the search. Containers are screened level by level by the
classes they hold, at C speed, so a list of ten thousand optimizers, or a dict of ten
thousand per-parameter dicts of tensors, costs little.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence, Set as AbstractSet
from itertools import chain, compress, islice
from typing import cast

import torch

from opttree._dispatch import class_mro, class_namespace, static_attribute

IsOptimizer = Callable[[type], bool]
Held = tuple[str, list[object], bool]
"""An attribute path (``module_infos['vision'].optimizer``), the optimizers found there,
and whether they are the members of a sequence at that path (``cpu_optimizers[i]``)."""

DEPTH = 4
"""How many containers deep an optimizer is looked for: ``aux['ema'][0]`` is two deep,
``stages[0].records['late'][1]`` four. Deeper than this, a wrapper's layout is its own to
declare with ``register_wrapper``."""

SCREENED = 1 << 20
"""How many members, all levels together, the screens of one wrapper's search read before
they answer "may hold" and the search reads container by container instead (each once).
Screening costs some tens of nanoseconds a member, so this bounds it near 0.1 s; a
container held many times over would otherwise multiply the members read."""


def _is_record(cls: type) -> bool:
    return (dataclasses.is_dataclass(cls) and isinstance(cls, type)) or issubclass(cls, types.SimpleNamespace)


def _is_container(cls: type) -> bool:
    if issubclass(cls, (torch.Tensor, torch.nn.Module)):
        return False
    return issubclass(cls, _HOLDERS) or _is_record(cls) or _is_other_collection(cls)


def _is_other_collection(cls: type) -> bool:
    """A collection, not text: a class whose namespaces define ``__len__`` and
    ``__iter__`` (a dict's values view has no ``__contains__``), read raw (asking
    ``collections.abc.Collection`` would run every ``__subclasshook__`` below it, a
    library's own code)."""
    if issubclass(cls, (str, bytes, bytearray)):
        return False
    return all(static_attribute(cls, name) is not None for name in _COLLECTION_METHODS)


_COLLECTION_METHODS = ("__len__", "__iter__")


def key_text(key: object) -> str:
    """A dict key in a path: a string or an integer as such (by the built-in repr), else its class."""
    if isinstance(key, str):
        return str.__repr__(key)
    return int.__repr__(key) if isinstance(key, int) else f"<{type(key).__qualname__}>"


def _fields(record: object) -> list[tuple[str, object]]:
    """A dataclass's fields that can be read, one that is missing or raises passed over;
    a ``SimpleNamespace``'s attributes."""
    if isinstance(record, types.SimpleNamespace):
        return list(dict.items(own_attributes(record)))
    found: list[tuple[str, object]] = []
    for field in dataclasses.fields(record):  # type: ignore[arg-type]  # a record: see _is_container
        try:
            found.append((field.name, getattr(record, field.name)))
        except Exception:  # noqa: BLE001  # a field never set, or a property whose own code raises
            continue
    return found


_PARTIAL_FUNC = cast(Callable[[object], object], functools.partial.__dict__["func"].__get__)
_PARTIAL_ARGS = cast(Callable[[object], tuple[object, ...]], functools.partial.__dict__["args"].__get__)
_PARTIAL_KEYWORDS = cast(Callable[[object], dict[str, object]], functools.partial.__dict__["keywords"].__get__)
_BOUND_TO = cast(Callable[[object], object], types.MethodType.__dict__["__self__"].__get__)
_REFERENT = cast(Callable[[object], object], weakref.ref.__call__)


_Members = Callable[[object, str], list[tuple[str, object]]]
_Iterate = Callable[[object], Iterator[object]]


def _indexed(iterate: _Iterate) -> _Members:
    def members(held: object, label: str) -> list[tuple[str, object]]:
        return [(f"{label}[{index}]", item) for index, item in enumerate(iterate(held))]

    return members


def _unordered(iterate: _Iterate) -> _Members:
    def members(held: object, label: str) -> list[tuple[str, object]]:
        return [(f"{label}{{...}}", item) for item in iterate(held)]

    return members


def _dict_members(held: object, label: str) -> list[tuple[str, object]]:
    mapping = cast(dict[object, object], held)
    keys = [(f"{label}.keys()[{index}]", key) for index, key in enumerate(dict.keys(mapping))]
    return keys + [(f"{label}[{key_text(key)}]", item) for key, item in dict.items(mapping)]


def _partial_members(held: object, label: str) -> list[tuple[str, object]]:
    arguments = [(f"{label}.args[{index}]", item) for index, item in enumerate(_PARTIAL_ARGS(held))]
    keywords = [(f"{label}.keywords[{key_text(key)}]", item) for key, item in dict.items(_PARTIAL_KEYWORDS(held))]
    return [(f"{label}.func", _PARTIAL_FUNC(held)), *arguments, *keywords]


def _bound_members(held: object, label: str) -> list[tuple[str, object]]:
    return [(f"{label}.__self__", _BOUND_TO(held))]


def _referent_members(held: object, label: str) -> list[tuple[str, object]]:
    return [(f"{label}()", _REFERENT(held))]


_LABELLED: tuple[tuple[type, _Members], ...] = (
    (dict, _dict_members),
    (list, _indexed(cast(_Iterate, list.__iter__))),
    (tuple, _indexed(cast(_Iterate, tuple.__iter__))),
    (collections.deque, _indexed(cast(_Iterate, collections.deque.__iter__))),
    (set, _unordered(cast(_Iterate, set.__iter__))),
    (frozenset, _unordered(cast(_Iterate, frozenset.__iter__))),
    (types.MethodType, _bound_members),
    (functools.partial, _partial_members),
    (weakref.ref, _referent_members),
)
"""What each kind of holder holds, with its path, read through the built-in class's own
methods and descriptors, which run no code of a subclass's: a dict's keys and values, the
members of a sequence or set, the object a method is bound to, a partial's function and
arguments, and the object a weak reference refers to (None once it is gone)."""

_HOLDERS = tuple(kind for kind, _ in _LABELLED)

_Reader = Callable[[object], Iterable[object]]
_FAST_READERS: tuple[tuple[type, _Reader], ...] = (
    (dict, cast(_Reader, lambda held: chain(dict.keys(held), dict.values(held)))),
    (list, cast(_Reader, list.__iter__)),
    (tuple, cast(_Reader, tuple.__iter__)),
    (set, cast(_Reader, set.__iter__)),
    (frozenset, cast(_Reader, frozenset.__iter__)),
)
"""Readers at C speed, for the screens, of the holders that may hold thousands."""


def _labelled(cls: type) -> _Members:
    return next((members for base, members in _LABELLED if issubclass(cls, base)), _record_members if _is_record(cls) else _attribute_members)


def _record_members(record: object, label: str) -> list[tuple[str, object]]:
    return [(f"{label}.{name}", item) for name, item in _fields(record)]


def _attribute_members(collection: object, label: str) -> list[tuple[str, object]]:
    """What another collection holds: its instance attributes and slots, read through
    Python's own descriptors, where such a class keeps its members (a ``UserDict``'s
    ``data``, a ``ChainMap``'s ``maps``), whatever its own ``__iter__`` shows; for one
    built in C without either (a ``mappingproxy``, a dict's views), the objects it refers
    to, as the garbage collector reads them, without running its code: the dict it shows,
    under its own label (``aux['ema']``, as the view reads it)."""
    attributes = [*own_attributes(collection).items(), *_slot_attributes(collection)]
    if attributes:
        return [(f"{label}.{name}", item) for name, item in attributes]
    return [(label, item) for item in gc.get_referents(collection) if not isinstance(item, type)]


def _reader(cls: type) -> _Reader:
    """How the members of a container of class ``cls`` are read: at C speed where it may
    hold many, else through its labelled members."""
    fast = next((reader for base, reader in _FAST_READERS if issubclass(cls, base)), None)
    if fast is not None:
        return fast
    members = _labelled(cls)
    return lambda held: [item for _, item in members(held, "")]


def _read(container: object) -> list[object]:
    """A container's members, or none where even the built-in reading raises (a dict resized meanwhile)."""
    try:
        return list(_reader(type(container))(container))
    except Exception:  # noqa: BLE001  # never raised out of a validation
        return []


def _members(container: object, label: str) -> list[tuple[str, object]]:
    """A container's members with their paths (a set's with its own: ``label{...}``)."""
    return _labelled(type(container))(container, label)


def _level_below(level: list[object], classes: set[type], kinds: set[type], limit: int) -> list[object]:
    """The members of the containers on ``level`` (of ``classes``) whose classes are
    ``kinds``, read at C speed (one held twice is read twice), at most ``limit`` + 1 of them."""
    by_reader: dict[_Reader, set[type]] = {}
    for cls in kinds:
        by_reader.setdefault(_reader(cls), set()).add(cls)
    below: list[object] = []
    for reader, these in by_reader.items():
        group = level if these == classes else compress(level, map(these.__contains__, map(type, level)))
        below.extend(islice(chain.from_iterable(map(reader, group)), limit + 1 - len(below)))
    return below


def held_optimizers(wrapper: object, is_optimizer: IsOptimizer, *, depth: int = DEPTH) -> Iterator[Held]:
    """The optimizers in ``wrapper``'s instance attributes, by attribute path."""
    yield from _Search(is_optimizer).search(instance_attributes(wrapper), depth)


def _is_tensor(cls: type) -> bool:
    return issubclass(cls, torch.Tensor)


def held_tensors(items: list[tuple[str, object]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors among ``items`` (attribute names and values), looked for as optimizers
    are, through the same holders and as deep, each with its path (``slow[1]``)."""
    return [
        (f"{label}[{index}]" if in_sequence else label, cast(torch.Tensor, tensor))
        for label, found, in_sequence in _Search(_is_tensor).search(items, DEPTH)
        for index, tensor in enumerate(found)
    ]


def unknown_attribute_tensors(
    owner: object, known: Callable[[], AbstractSet[int]], skipped: AbstractSet[str] = frozenset()
) -> list[tuple[str, str]]:
    """The tensors ``owner`` holds in instance attributes beyond torch's bookkeeping (other
    than those ``skipped``), as :func:`held_tensors` finds them, that ``known`` (identities,
    by ``object.__hash__``; called only where tensors are held) lacks: per such attribute,
    its name and how many it holds and where the first sits ("holds 2 tensor(s) in its
    attribute 'slow' (the first at slow[0])")."""
    held = [(name, found) for name, value in beyond_bookkeeping(owner) if name not in skipped and (found := held_tensors([(name, value)]))]
    if not held:
        return []
    identities = known()
    unknown: list[tuple[str, str]] = []
    for name, found in held:
        labels = [label for label, tensor in found if object.__hash__(tensor) not in identities]
        if labels:
            unknown.append((name, f"holds {len(labels)} tensor(s) in its attribute {name!r} (the first at {labels[0]})"))
    return unknown


OPTIMIZER_BOOKKEEPING = frozenset(
    {
        "defaults",
        "state",
        "param_groups",
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
        "_zero_grad_profile_name",
        "_warned_capturable_if_run_uncaptured",
        "_opt_called",
    }
)
"""The attributes torch's ``Optimizer`` and ``LRScheduler`` set on an optimizer: its
state, groups and hooks, which opttree reads and checks on their own."""


def held_by_leaf(optimizer: object, is_optimizer: IsOptimizer) -> list[Held]:
    """The optimizers in a leaf's instance attributes other than torch's bookkeeping (an
    optimizer a registered class steps besides its own state, an ``aux`` set on one):
    read only where there are any, which a torch optimizer has none of."""
    items = beyond_bookkeeping(optimizer)
    return list(_Search(is_optimizer).search(items, DEPTH)) if items else []


def beyond_bookkeeping(optimizer: object) -> list[tuple[str, object]]:
    """A leaf's instance attributes other than torch's bookkeeping, and its slots'."""
    own = own_attributes(optimizer)
    names = own.keys() - OPTIMIZER_BOOKKEEPING
    return [(name, own[name]) for name in sorted(names)] + _slot_attributes(optimizer)


def only_bookkeeping(optimizers: Sequence[object]) -> bool:
    """Whether none of ``optimizers`` (a run of sibling leaves) holds any attribute beyond
    torch's bookkeeping, nor a slot: read over the run at once, most of it at C speed; then
    none holds a method of its own or an optimizer beside its state."""
    dicts = list(map(own_attributes, optimizers))
    if not OPTIMIZER_BOOKKEEPING.issuperset(set().union(*map(dict.keys, dicts))):
        return False
    return not any(map(_slot_attributes, optimizers))


def own_attributes(instance: object) -> dict[str, object]:
    """``instance``'s ``__dict__``, read through the descriptor Python made for it: neither a
    class's own ``__getattribute__`` nor a ``__dict__`` property a class body defines (which
    could show attributes of its choosing) runs. Empty where it has none."""
    cls = type(instance)
    reader = _dict_readers.get(cls)
    if reader is None:
        reader = _dict_readers[cls] = next((found for found in map(_dict_descriptor, class_mro(cls)) if found is not None), _no_dict)
    try:
        attributes = reader.__get__(instance, cls)
    except Exception:  # noqa: BLE001  # a C type's own reader may refuse
        return {}
    return attributes if isinstance(attributes, dict) else {}


def _dict_descriptor(klass: type) -> types.GetSetDescriptorType | types.MemberDescriptorType | None:
    """The descriptor Python made for ``klass``'s instances' ``__dict__`` (a getset one, or
    a member one for a C type such as ``SimpleNamespace``), or None: not one of another
    class's set in a class body, nor a property."""
    found = class_namespace(klass).get("__dict__")
    if isinstance(found, (types.GetSetDescriptorType, types.MemberDescriptorType)) and found.__objclass__ is klass:
        return found
    return None


class _NoDict:
    """The reader of a class whose instances have no ``__dict__``."""

    def __get__(self, instance: object, owner: type) -> dict[str, object]:
        return {}


_no_dict = _NoDict()
_dict_readers: weakref.WeakKeyDictionary[type, types.GetSetDescriptorType | types.MemberDescriptorType | _NoDict] = weakref.WeakKeyDictionary()
"""Each class's reader of its instances' ``__dict__``: the namespace entry Python makes
with a class cannot be replaced later (a class's ``__dict__`` is not writable)."""


def instance_attributes(instance: object) -> list[tuple[str, object]]:
    """An instance's attributes: those of its ``__dict__`` and those its classes' ``__slots__``
    hold, each slot read through its own descriptor (no property of a subclass runs);
    a slot never set is passed over."""
    return list(dict.items(own_attributes(instance))) + _slot_attributes(instance)


_slots: weakref.WeakKeyDictionary[type, list[tuple[str, type, types.MemberDescriptorType]]] = weakref.WeakKeyDictionary()
"""Each class's slot descriptors, read once: slots are made with their class. A slot
descriptor set on a class later is another class's (reading it raises, and it is passed
over) or a base's (read already as that base's)."""


def _slot_attributes(instance: object) -> list[tuple[str, object]]:
    """What the slots of ``instance``'s classes hold, each read through its own descriptor
    (no property of a subclass runs); a slot never set is passed over."""
    cls = type(instance)
    known = _slots.get(cls)
    if known is None:
        known = _slots[cls] = [
            (name, klass, descriptor)
            for klass in class_mro(cls)
            for name, descriptor in class_namespace(klass).items()
            if isinstance(descriptor, types.MemberDescriptorType) and name not in ("__weakref__", "__dict__")
        ]
    found: list[tuple[str, object]] = []
    for name, klass, descriptor in known:
        try:
            found.append((name, descriptor.__get__(instance, klass)))
        except (AttributeError, TypeError):  # never set; another class's slot set on this one
            continue
    return found


@dataclasses.dataclass
class _Search:
    """One wrapper's search: labelled, container by container, where a screen of the levels
    below (by the classes on them, at C speed) says that an optimizer may be there."""

    wanted: IsOptimizer
    """The classes looked for: optimizers' (or tensors', see :func:`held_tensors`)."""
    budget: int = SCREENED
    """How many more members the screens may read before they stop, answering "may hold"."""
    seen: dict[int, tuple[int, object]] = dataclasses.field(default_factory=dict)
    """Containers looked into, by ``id``: the depth left then, and the container itself
    (kept alive so that its ``id`` is not reused meanwhile)."""

    def search(self, items: list[tuple[str, object]], depth: int) -> Iterator[Held]:
        for label, value in items:
            if self.wanted(type(value)):
                yield label, [value], False
            elif depth > 0 and _is_container(type(value)) and self._first_look(value, depth):
                yield from self._look_into(label, value, depth)

    def _first_look(self, container: object, depth: int) -> bool:
        """Whether ``container`` is looked into now: never before, or now with more depth left."""
        before = self.seen.get(id(container))
        if before is not None and before[0] >= depth:
            return False
        self.seen[id(container)] = (depth, container)
        return True

    def _look_into(self, label: str, container: object, depth: int) -> Iterator[Held]:
        values = _read(container)
        classes = set(map(type, values))
        if classes and all(map(self.wanted, classes)) and isinstance(container, (list, tuple)):
            yield label, values, True  # such as HybridDeviceOptimizer.cpu_optimizers, in one piece
        elif self._may_hold(values, classes, depth - 1):
            # Only the members that are optimizers or containers are followed: a list of param
            # groups, or a dict of per-parameter dicts of tensors, holds none and is passed by the screen.
            wanted = {cls for cls in classes if self.wanted(cls) or _is_container(cls)}
            try:
                members = [(name, item) for name, item in _members(container, label) if type(item) in wanted]
            except Exception:  # noqa: BLE001  # as in _read
                members = []
            yield from self.search(members, depth - 1)

    def _may_hold(self, values: list[object], classes: set[type], depth: int) -> bool:
        """Whether an optimizer may be among ``values`` (of ``classes``), or within ``depth``
        levels of the containers among them; once the budget is spent (or a level cannot be read: a dict
        resized meanwhile), it may, and the search reads each container on its own."""
        level = values
        for left in range(depth, -1, -1):
            if any(map(self.wanted, classes)):
                return True
            kinds = {cls for cls in classes if _is_container(cls)}
            if not kinds or left == 0:
                return False
            if self.budget <= 0:
                return True
            try:
                level = _level_below(level, classes, kinds, self.budget)
            except Exception:  # noqa: BLE001  # never raised out of a validation
                return True
            self.budget -= len(level)
            classes = set(map(type, level))
        return False
