"""The result of a reset."""

from __future__ import annotations

from typing import Literal

from attrs import asdict, field, frozen

from opttree._fields import of, one_of, tuple_of


def format_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@frozen
class ResetReport:
    """What a reset changed and what it kept.

    ``leaves`` counts the leaf optimizers the reset covered: every one, or, for a partial
    reset by parameters, those holding a selected parameter;
    ``steps`` counts step counters set back to their start (per-parameter tensors,
    per-group values, and the counters a schema names in groups and instance attributes;
    a step tensor several parameters share, as Megatron's load leaves one, once);
    ``tensors_zeroed``, ``tensors_filled`` (set to a starting value other than zero, such
    as Adagrad's ``initial_accumulator_value``) and ``tensors_dropped`` count history
    tensors, and ``tensors_zeroed`` the tensors a schema's ``step_attributes`` name (TE's
    overflow flag) too; ``tensors_kept`` and ``bytes_kept`` count the state tensors left
    as they were of the parameters the reset takes (a master copy, or the keys a reset
    by ``keys`` leaves; not the state of parameters a reset by ``params`` leaves out) and
    their memory, each tensor and each byte once however many entries or leaves hold it;
    ``loss_scales_reset`` and ``loss_scales_kept`` count fp16 loss scalers put back to
    their initial scale or kept as they were; ``entries_released`` counts the state entries
    ``release=True`` deleted, and ``bytes_released`` the bytes of their tensors (freed
    unless something else still holds them).
    """

    leaves: int = field(validator=of(int))
    tensors_zeroed: int = field(validator=of(int))
    tensors_dropped: int = field(validator=of(int))
    bytes_reset: int = field(validator=of(int))
    steps: int = field(validator=of(int))
    tensors_kept: int = field(validator=of(int))
    bytes_kept: int = field(validator=of(int))
    kept_keys: tuple[str, ...] = field(validator=tuple_of(str, what="key names"))
    shared_leaves: int = field(default=0, validator=of(int))
    tensors_filled: int = field(default=0, validator=of(int))
    loss_scales_reset: int = field(default=0, validator=of(int))
    loss_scales_kept: int = field(default=0, validator=of(int))
    entries_released: int = field(default=0, validator=of(int))
    bytes_released: int = field(default=0, validator=of(int))
    action: Literal["reset", "prune", "scale"] = field(default="reset", validator=one_of(("reset", "prune", "scale")))
    """What changed the history: a reset zeroes it, ``prune`` and ``scale`` change it in
    place, and ``tensors_zeroed`` then counts the history tensors they wrote, whether or
    not a value changed (a scale by 1, a prune of all-zero history)."""

    def __str__(self) -> str:
        kept = (
            f"; kept {self.tensors_kept} tensors ({format_bytes(self.bytes_kept)}: "
            f"{', '.join(self.kept_keys)})"
            if self.tensors_kept
            else ""
        )
        filled = f"{self.tensors_filled} filled with their starting values, " if self.tensors_filled else ""
        scales = "".join(
            f"; {count} loss scale{'s' if count > 1 else ''} {what}"
            for count, what in ((self.loss_scales_reset, "reset"), (self.loss_scales_kept, "kept"))
            if count
        )
        released = (
            f"; released {self.entries_released} state entries ({format_bytes(self.bytes_released)})"
            if self.entries_released
            else ""
        )
        changed = {"reset": "zeroed", "prune": "pruned", "scale": "scaled"}[self.action]
        return (
            f"{self.action} {self.leaves} optimizers: {self.tensors_zeroed} tensors {changed}, {filled}"
            f"{self.tensors_dropped} dropped ({format_bytes(self.bytes_reset)}), "
            f"{self.steps} step counters{kept}{scales}{released}"
        )

    def to_dict(self) -> dict[str, int]:
        """The counts, numbers only, ready for ``wandb.log`` or ``add_scalars``; the kept
        keys are :attr:`kept_keys`."""
        return {name: value for name, value in asdict(self).items() if isinstance(value, int)}
