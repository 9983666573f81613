"""State keys that several origins share."""

MASTER_PARAM = "master_param"
"""The fp32 copy ``HybridDeviceOptimizer`` (``param_update_in_fp32``) keeps in its
sub-optimizers' state, whatever their class, and TE ``FusedAdam`` keeps for its own."""
