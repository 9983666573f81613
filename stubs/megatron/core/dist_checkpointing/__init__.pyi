# Narrower than the real functions: the save and load strategies, integrity checks and
# strict handling are left out (load then returns the state dict alone), as is the
# AsyncRequest that an async save returns.
from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint as check_is_distributed_checkpoint

def save(sharded_state_dict: dict[str, object], checkpoint_dir: str) -> None: ...
def load(sharded_state_dict: dict[str, object], checkpoint_dir: str) -> dict[str, object]: ...
