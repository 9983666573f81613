from collections.abc import Callable
from typing import Any

from _typeshed import Incomplete

from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint as check_is_distributed_checkpoint

# The parameters megatron-core 0.16.1 and 0.19.2 share: the first three by position, the
# rest by keyword (0.16 has common_strategy fourth, 0.19 validate_access_integrity).
# Narrower than the runtime: the strategies are not stubbed (Incomplete); save returns an
# AsyncRequest (not stubbed) for async_sharded_save=True, None otherwise; load's strict
# is left out, so that it returns the state dict alone, as with its default.
def save(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str,
    sharded_strategy: Incomplete | None = None,
    *,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    content_metadata: dict[str, Any] | None = None,
) -> Incomplete | None: ...
def load(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str,
    sharded_strategy: Incomplete | None = None,
    *,
    validate_access_integrity: bool = True,
) -> dict[str, Any]: ...
