"""emerging_optimizers, by dotted path, so that opttree never imports it.

Derived from emerging-optimizers 0.3.0's sources. The orthogonalized and scalar
optimizers, and SOAP, create their whole state at once, on their first step
(``len(state) == 0``), as zeros, except SOAP's eigenbases ``Q_L``/``Q_R``, which start
as ``torch.eye``: where an entry has more than one key (AdaptiveMuon, LaProp, SOAP), an
entry lacking one fails the next step (``always_built``). The Riemannian ObliqueSGD and
ObliqueAdam build each missing key on its own. LaProp, ObliqueAdam and SOAP count steps per parameter in a Python
int, and SOAP's decides when it takes a full eigendecomposition (at step 0).
``MuonHyperball``'s ``hyperball_R`` is written on every step before it is read, so it is
dropped. Their moments are built ``zeros_like`` their parameter (``like_param``), but
AdaptiveMuon's ``moment2_buffer``, shaped by its mode, and SOAP's, built in float32 whatever
the parameter's dtype. PSGDPro creates each key on its own when it is missing: its lists of Kronecker
factors ``Q`` and Lipschitz constants ``L`` are dropped and rebuilt on the next step.
Each of them builds a missing entry again, so its state can be released.
"""

from __future__ import annotations

import attrs

from opttree._schema import StateSchema, StepLocation, StepType
from opttree._schemas._keys import MASTER_PARAM

MUON = StateSchema(zero={"momentum_buffer"}, keep={MASTER_PARAM}, rebuilds_missing=True, like_param={"momentum_buffer"})
ADAPTIVE_MUON = StateSchema(
    zero={"momentum_buffer", "moment2_buffer"},
    keep={MASTER_PARAM},
    rebuilds_missing=True,
    like_param={"momentum_buffer"},
    always_built={"momentum_buffer", "moment2_buffer"},  # with the entry, if len(state) == 0
)
_OBLIQUE_ADAM = StateSchema(
    zero={"exp_avg", "exp_avg_sq"},
    keep={MASTER_PARAM},
    step=StepLocation.PER_PARAMETER,
    step_type=StepType.INT,
    rebuilds_missing=True,
    like_param={"exp_avg", "exp_avg_sq"},
)
"""ObliqueAdam builds each missing key on its own; LaProp builds them with the entry."""
LAPROP = attrs.evolve(_OBLIQUE_ADAM, always_built={"exp_avg", "exp_avg_sq"})
SOAP = StateSchema(
    zero={"exp_avg", "exp_avg_sq", "L", "R"},
    keep={MASTER_PARAM},
    step=StepLocation.PER_PARAMETER,
    step_type=StepType.INT,
    identity={"Q_L", "Q_R"},
    rebuilds_missing=True,
    always_built={"exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"},
)

_ORTHOGONALIZED = "emerging_optimizers.orthogonalized_optimizers."
LAZY: dict[str, StateSchema] = {
    _ORTHOGONALIZED + "muon.Muon": MUON,
    _ORTHOGONALIZED + "adaptive_muon.AdaptiveMuon": ADAPTIVE_MUON,
    _ORTHOGONALIZED + "mop.MOP": MUON,
    _ORTHOGONALIZED + "polargrad.PolarGrad": MUON,
    _ORTHOGONALIZED + "scion.Scion": MUON,
    _ORTHOGONALIZED + "spel.Spel": MUON,
    _ORTHOGONALIZED + "sinkhorn_muon.SinkhornMuon": MUON,
    _ORTHOGONALIZED + "muon_hyperball.MuonHyperball": StateSchema(
        zero={"momentum_buffer"}, drop={"hyperball_R"}, keep={MASTER_PARAM}, rebuilds_missing=True, like_param={"momentum_buffer"}
    ),
    "emerging_optimizers.scalar_optimizers.lion.Lion": StateSchema(
        zero={"exp_avg"}, keep={MASTER_PARAM}, rebuilds_missing=True, like_param={"exp_avg"}
    ),
    "emerging_optimizers.scalar_optimizers.laprop.LaProp": LAPROP,
    "emerging_optimizers.riemannian_optimizers.normalized_optimizer.ObliqueSGD": MUON,
    "emerging_optimizers.riemannian_optimizers.normalized_optimizer.ObliqueAdam": _OBLIQUE_ADAM,
    "emerging_optimizers.soap.soap.SOAP": SOAP,
    "emerging_optimizers.soap.rekls.REKLS": SOAP,
    "emerging_optimizers.psgd.psgd.PSGDPro": StateSchema(
        zero={"exp_avg"},
        like_param={"exp_avg"},
        drop={"Q", "L"},
        keep={MASTER_PARAM},
        step=StepLocation.PER_PARAMETER,
        step_type=StepType.INT,
        rebuilds_missing=True,
    ),
}
