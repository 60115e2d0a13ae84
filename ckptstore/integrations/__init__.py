"""ckptstore as the storage under other checkpointing APIs: torch.distributed.checkpoint
(:mod:`ckptstore.integrations.dcp`) and Megatron-Core dist_checkpointing
(:mod:`ckptstore.integrations.megatron`). Import the submodule you need; this package imports
neither torch.distributed nor megatron by itself."""
