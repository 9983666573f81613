from megatron.core import dist_checkpointing as dist_checkpointing
from megatron.core import parallel_state as parallel_state
