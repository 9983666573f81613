"""Master copies kept beside ``param_groups``, by place (a schema's ``master_groups``).

apex's ``FusedAdam`` and TransformerEngine 1.x's keep, with ``master_weights``, an fp32
copy of every parameter in ``self.param_groups_master``: groups parallel to
``param_groups`` whose ``params`` hold each parameter's copy at its place (``None``
without master weights). Their step reads and writes the copy and writes it back into the
parameter, so a copy left stale after weights are loaded into the model puts the old
weights back at the next step. They are read here through the built-in containers' own
methods; any other layout is reported, never guessed at.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from opttree._fields import kind_of
from opttree._held import instance_attributes

MasterPairs = list[tuple[torch.Tensor, torch.Tensor]]


def master_pairs(optimizer: torch.optim.Optimizer, attribute: str) -> MasterPairs | str:
    """Each parameter of ``optimizer`` with the master copy the groups in its instance
    attribute ``attribute`` hold at its place (none for a place holding ``None``); or why
    they cannot be read so. An optimizer without the attribute keeps no such copies."""
    attributes = dict(instance_attributes(optimizer))  # its __dict__'s and its slots'
    if attribute not in attributes:
        return []
    masters = attributes[attribute]
    groups = optimizer.param_groups
    if type(masters) not in (list, tuple) or len(cast(Sequence[object], masters)) != len(groups):
        count = f" of {len(masters)}" if isinstance(masters, (list, tuple)) else ""
        return f"its {attribute} is {kind_of(masters)}{count}, expected a list of {len(groups)} groups beside its param_groups"
    pairs: MasterPairs = []
    for index, (group, beside) in enumerate(zip(groups, cast(Sequence[object], masters), strict=True)):
        copies = dict.get(beside, "params") if type(beside) is dict else None
        params = group["params"]
        if type(copies) is not list or len(copies) != len(params):
            return f"its {attribute}[{index}] does not hold a 'params' list of {len(params)}, one for each parameter of param group {index}"
        odd = next((copy for copy in copies if copy is not None and type(copy) not in (torch.Tensor, torch.nn.Parameter)), None)
        if odd is not None:
            return f"its {attribute}[{index}]['params'] holds {kind_of(odd)}, expected master tensors or None"
        pairs.extend((param, copy) for param, copy in zip(params, copies, strict=True) if copy is not None)
    if len(set(map(object.__hash__, (copy for _, copy in pairs)))) < len(pairs):
        return f"its {attribute} holds one copy at two places: it cannot stand for both parameters"
    return pairs

