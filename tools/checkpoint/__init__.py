"""The pieces of tools/inspect_checkpoint.py and tools/convert_checkpoint.py, one job per module.

Both read datastates checkpoints only through the engine's public reader and audit (`datastates.CheckpointReader`,
`datastates.audit_checkpoint`); megatron-core's torch_dist through its own `dist_checkpointing`.
"""
