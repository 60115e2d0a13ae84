"""ckptstore as the storage under other checkpointing APIs: torch.distributed.checkpoint
(:mod:`ckptstore.integrations.dcp`) and Megatron-Core dist_checkpointing
(:mod:`ckptstore.integrations.megatron`). Import the package you need; this package imports
neither torch.distributed nor megatron by itself.

Each integration is a package whose ``__init__`` is its public face; everything else in it is
private (``_reader.py``, ``_commit.py``, ...). What they share, and what reading a checkpoint
needs without the frameworks, is in ``_common``; :mod:`ckptstore.integrations.formats` is the
table of formats the CLI reads. From the rest of ckptstore they use only the public floor,
:mod:`ckptstore.extending` (and :mod:`ckptstore.errors`).
"""
