"""Megatron-Core's own leaf classes, by dotted path (both megatron-core layouts for Muon)."""

from __future__ import annotations

from opttree._schema import StateSchema
from opttree._schemas.emerging import ADAPTIVE_MUON, MUON

LAZY: dict[str, StateSchema] = {
    "megatron.core.optimizer.muon.TensorParallelMuon": MUON,
    "megatron.core.optimizer.emerging_optimizers.TensorParallelMuon": MUON,
    "megatron.core.optimizer.emerging_optimizers.TensorParallelAdaptiveMuon": ADAPTIVE_MUON,
}
