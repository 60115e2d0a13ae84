"""Megatron-Core GPT names to Hugging Face GPT-NeoX names: the worked example of an export map.

``ckptstore export RUN@STEP DIR --hf --map ckptstore.maintenance.hfnames:megatron_to_hf``

Megatron-Core's GPTModel (local or Transformer Engine layer spec, ``model.sharded_state_dict()``)
stores each transformer-layer weight as one tensor with a leading layer axis, under a key without
the layer number (``decoder.layers.mlp.linear_fc1.weight``, shape ``(layers, 4h, h)``); this map
gives each layer its own tensor (a view of that one) under the name ``GPTNeoXForCausalLM`` loads.
The names map one to one: Megatron's fused QKV weight with as many query groups as heads is laid
out per head as ``[q, k, v]``, which is GPT-NeoX's ``query_key_value`` layout, and its MLP
(``linear_fc1``, ``linear_fc2``) is GPT-NeoX's ``dense_h_to_4h``, ``dense_4h_to_h``. A Llama-style
target (separate q/k/v, gated MLP) needs the model's head counts to split those tensors: copy this
module and return the parts as ``(name, view)`` pairs.

The README's Megatron example saves one column-parallel weight, ``fc1.weight`` of shape
``(1024, 256)``: the ``h -> 4h`` projection of a hidden-256 MLP, so layer 0's ``dense_h_to_4h``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Megatron-Core layer-local names (local and Transformer Engine specs) -> GPT-NeoX's.
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.linear_qkv.weight": "attention.query_key_value.weight",
    "self_attention.linear_qkv.bias": "attention.query_key_value.bias",
    "self_attention.linear_proj.weight": "attention.dense.weight",
    "self_attention.linear_proj.bias": "attention.dense.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
    "mlp.linear_fc1.bias": "mlp.dense_h_to_4h.bias",
    "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
    "mlp.linear_fc2.bias": "mlp.dense_4h_to_h.bias",
}
#: Whole-model names (and the README example's single MLP, as layer 0's).
MODEL_NAMES = {
    "embedding.word_embeddings.weight": "gpt_neox.embed_in.weight",
    "decoder.final_layernorm.weight": "gpt_neox.final_layer_norm.weight",
    "decoder.final_layernorm.bias": "gpt_neox.final_layer_norm.bias",
    "output_layer.weight": "embed_out.weight",
    "fc1.weight": "gpt_neox.layers.0.mlp.dense_h_to_4h.weight",
    "fc1.bias": "gpt_neox.layers.0.mlp.dense_h_to_4h.bias",
    "fc2.weight": "gpt_neox.layers.0.mlp.dense_4h_to_h.weight",
    "fc2.bias": "gpt_neox.layers.0.mlp.dense_4h_to_h.bias",
}
_ONE_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_STACKED = "decoder.layers."


def megatron_to_hf(
    name: str, tensor: torch.Tensor
) -> str | Iterator[tuple[str, torch.Tensor]] | None:
    """The Hugging Face name(s) of one Megatron-Core GPT tensor (an export ``--map``).

    Transformer Engine's ``_extra_state`` (FP8 scaling state) is left out; a name this map
    does not know raises ``KeyError`` naming it (write your own map for other models).
    """
    if name.endswith("._extra_state"):
        return None
    if name in MODEL_NAMES:
        return MODEL_NAMES[name]
    one = _ONE_LAYER.fullmatch(name)
    if one is not None:
        return f"gpt_neox.layers.{one[1]}.{_layer_name(one[2], name)}"
    if name.startswith(_STACKED):
        hf = _layer_name(name.removeprefix(_STACKED), name)
        return ((f"gpt_neox.layers.{i}.{hf}", tensor[i]) for i in range(tensor.shape[0]))
    raise KeyError(f"{name!r} is not a Megatron-Core GPT name this map knows")


def _layer_name(local: str, name: str) -> str:
    if local not in LAYER_NAMES:
        raise KeyError(f"{name!r}: {local!r} is not a GPT layer weight this map knows")
    return LAYER_NAMES[local]
