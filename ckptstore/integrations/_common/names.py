"""The components that make a checkpoint a DCP or a Megatron one, named where importing them
costs nothing: ``ckptstore verify`` and ``export`` tell the formats apart
(:mod:`ckptstore.integrations.formats`) without importing torch.distributed.checkpoint (about a
second) for checkpoints that are not DCP ones."""

#: The component holding a DCP checkpoint's metadata (JSON) and its rank components' digests.
DCP_METADATA = "dcp/metadata"
#: The component holding a Megatron checkpoint's metadata.json, layout and world size.
MEGATRON_META = "megatron/meta"
#: The component holding an imported Hugging Face directory's config and tokenizer files
#: (file name -> bytes), which ``export --hf`` writes back beside the shards.
HF_FILES = "hf/files"
#: Its component kind.
FILES_KIND = "files"
