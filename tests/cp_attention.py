"""Context-parallel core attention for megatron-core on CPU, in the place of the ring attention that
MindSpeed patches in on NPUs (megatron_cp_algo) and Transformer Engine's on GPUs: megatron's own
local DotProductAttention refuses context parallelism (dot_product_attention.py:57). Each rank holds
the queries of its two chunks of the row (megatron's load-balanced split, get_batch_on_this_cp_rank:
chunks r and 2·cp-1-r); keys and values of every chunk are all-gathered over the context-parallel
group (with their gradients sent back) and put in row order; the attention mask's rows are this
rank's queries, its columns the whole row. Everything else of the model is megatron's."""
import math

import torch
import torch.distributed.nn.functional as collectives

from aspc.backends.ascend.packing import in_row_order


class AllGatherKVAttention(torch.nn.Module):
    """Called as megatron's core attention: query [sq, b, heads, d], key/value [sk, b, groups, d] of
    this rank's chunks; attention_mask [b, 1, sq, T] True where masked; -> [sq, b, heads·d]."""

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None, **_):
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        key, value = (in_row_order(list(collectives.all_gather(t.contiguous(), group=group)), dim=0)
                      for t in (key, value))
        heads, groups = query.shape[2], key.shape[2]
        key, value = (t.repeat_interleave(heads // groups, dim=2) for t in (key, value))
        scores = torch.einsum("qbhd,kbhd->bhqk", query, key) / math.sqrt(query.shape[-1])
        scores = scores.masked_fill(attention_mask, -10000.0)  # as megatron's masked softmax: padding rows stay finite
        out = torch.einsum("bhqk,kbhd->qbhd", torch.softmax(scores.float(), -1).to(value.dtype), value)
        return out.reshape(out.shape[0], out.shape[1], -1)


def with_cp_attention(spec):
    """A local layer spec (get_gpt_layer_local_spec) whose core attention is AllGatherKVAttention."""
    spec.submodules.self_attention.submodules.core_attention = AllGatherKVAttention
    return spec
