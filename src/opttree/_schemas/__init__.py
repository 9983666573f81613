"""Built-in state schemas, one file per origin: ``torch_optim`` (by class), and by dotted
path ``megatron``, ``emerging`` and ``fused_adam`` (TransformerEngine and apex), so that
opttree never imports ``megatron``, ``emerging_optimizers``, ``transformer_engine`` or
``apex`` itself. Adding a schema is one entry in one of these files.
"""

from __future__ import annotations

from opttree._dispatch import LazyDispatch
from opttree._schema import StateSchema
from opttree._schemas import emerging, fused_adam, megatron, torch_optim


def builtin_schemas() -> LazyDispatch[StateSchema]:
    table: LazyDispatch[StateSchema] = LazyDispatch()
    for cls, schema in torch_optim.torch_classes():
        table.register(cls, schema)
    for lazy in (megatron.LAZY, emerging.LAZY, fused_adam.LAZY):
        for dotted, schema in lazy.items():
            table.register_lazy(dotted, schema)
    return table
