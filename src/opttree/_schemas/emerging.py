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
AdaptiveMuon's ``moment2_buffer``, typed as it and shaped by its ``moment2_method``
(``shape_with``); SOAP's are built in float32 whatever
the parameter's dtype (``dtype_of``), and its Kronecker factors square (``shape_of``).
PSGDPro builds its ``exp_avg`` ``zeros_like`` the gradient (``like_grad``). None is
``elementwise``: the orthogonalized ones multiply their momentum as a matrix (with gaps
between its elements, Muon's step differed from a fresh one's in the last bits), and the
scalar ones run compiled kernels. PSGDPro creates its ``exp_avg`` and step each on its own when missing, and
its lists of Kronecker factors ``Q`` and Lipschitz constants ``L`` together where either is
missing (``rebuilt_together``): they are dropped and rebuilt on the next step.
Each of them builds a missing entry again, so its state can be released.
"""

from __future__ import annotations

import attrs
import torch

from opttree._schema import StateSchema, StepLocation, StepType
from opttree._schemas._keys import MASTER_PARAM

MUON = StateSchema(zero={"momentum_buffer"}, keep={MASTER_PARAM}, rebuilds_missing=True, like_param={"momentum_buffer"})


def _moment2_shape(optimizer: torch.optim.Optimizer, shape: tuple[int, ...]) -> tuple[int, ...]:
    """AdaptiveMuon's ``moment2_buffer``, by the optimizer's ``moment2_method`` (its
    ``_init_group``): the parameter's shape (``adamuon``), a 2-D parameter's with the
    shorter of its dimensions, columns where tied, 1 (``normuon``), or one value (``namo``).
    For another method it builds none (and its step raises): refused, not guessed."""
    method: object = getattr(optimizer, "moment2_method", None)
    if method == "adamuon":
        return shape
    if method == "normuon":
        if len(shape) != 2:
            msg = f"normuon builds it for 2-D parameters only, not for shape {shape}"
            raise ValueError(msg)
        rows, columns = shape
        return (rows, 1) if rows >= columns else (1, columns)
    if method == "namo":
        return (1,)
    msg = f"{type(optimizer).__qualname__} builds it for no moment2_method {method!r}"
    raise ValueError(msg)


ADAPTIVE_MUON = StateSchema(
    zero={"momentum_buffer", "moment2_buffer"},
    keep={MASTER_PARAM},
    rebuilds_missing=True,
    like_param={"momentum_buffer"},
    shape_with={"moment2_buffer": _moment2_shape},
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


def _rows_square(shape: tuple[int, ...]) -> tuple[int, int]:
    """SOAP's left Kronecker factor and eigenbasis: square in the parameter's rows."""
    return (shape[0], shape[0])


def _columns_square(shape: tuple[int, ...]) -> tuple[int, int]:
    """SOAP's right Kronecker factor and eigenbasis: square in the parameter's columns."""
    return (shape[-1], shape[-1])


def _parameters_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """SOAP's moments: the parameter's shape, in a layout of their own (see :data:`SOAP`)."""
    return shape


def _float32(param_dtype: torch.dtype) -> torch.dtype:
    return torch.float32


def _default_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """What ``torch.zeros``/``torch.eye`` build in when given no dtype, read at each check."""
    return torch.get_default_dtype()


SOAP = StateSchema(
    zero={"exp_avg", "exp_avg_sq", "L", "R"},
    keep={MASTER_PARAM},
    step=StepLocation.PER_PARAMETER,
    step_type=StepType.INT,
    identity={"Q_L", "Q_R"},
    rebuilds_missing=True,
    always_built={"exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"},
    shape_of={
        "exp_avg": _parameters_shape,
        "exp_avg_sq": _parameters_shape,
        "L": _rows_square,
        "Q_L": _rows_square,
        "R": _columns_square,
        "Q_R": _columns_square,
    },
    dtype_of={"exp_avg": _float32, "exp_avg_sq": _float32, "L": _default_dtype, "R": _default_dtype, "Q_L": _default_dtype, "Q_R": _default_dtype},
    expressed_in={"exp_avg": {"Q_L", "Q_R"}, "exp_avg_sq": {"Q_L", "Q_R"}},
)
"""SOAP and REKLS (2-D parameters only) build their moments in the parameter's shape in
float32, their Kronecker factors and eigenbases square in its rows and its columns, in
torch's default dtype. Their moments are kept in the eigenbases' coordinates
(``update_eigenbasis_and_exp_avgs`` rotates them from the old bases to the new ones).
Each step replaces the moments with those rotations, row-major whatever the parameter's
layout, before it reads them otherwise: built ``zeros_like`` the parameter, they are not
laid out like it after the first step (a column-major weight's), and zeros in any layout
rotate to the same zeros, so their layout is not compared (``shape_of``, not
``like_param``): compared, every SOAP over a column-major weight was refused."""

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
        like_grad={"exp_avg"},
        drop={"Q", "L"},
        rebuilt_together={"Q", "L"},
        keep={MASTER_PARAM},
        step=StepLocation.PER_PARAMETER,
        step_type=StepType.INT,
        rebuilds_missing=True,
    ),
}
