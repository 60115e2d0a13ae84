"""What the integrations share, importable without torch.distributed.checkpoint or Megatron-Core
(so ``ckptstore verify`` and :mod:`ckptstore.integrations.formats` can use it): the components
that mark each format (``names``), the sharding-integrity check (``tiling``), a Megatron
checkpoint's stored layout and reader (``megatron_layout``, ``megatron_source``), which need
ckptstore alone, and the helpers both formats' large metadata documents are parsed with
(``documents``)."""
