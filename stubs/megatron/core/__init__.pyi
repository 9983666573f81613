from megatron.core import parallel_state as parallel_state
