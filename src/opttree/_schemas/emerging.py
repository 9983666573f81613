"""emerging_optimizers, by dotted path, so that opttree never imports it."""

from __future__ import annotations

from opttree._schema import StateSchema
from opttree._schemas._keys import MASTER_PARAM

MUON = StateSchema(zero={"momentum_buffer"}, keep={MASTER_PARAM})
ADAPTIVE_MUON = StateSchema(zero={"momentum_buffer", "moment2_buffer"}, keep={MASTER_PARAM})

LAZY: dict[str, StateSchema] = {
    "emerging_optimizers.orthogonalized_optimizers.muon.Muon": MUON,
    "emerging_optimizers.orthogonalized_optimizers.adaptive_muon.AdaptiveMuon": ADAPTIVE_MUON,
}
