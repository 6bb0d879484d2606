"""Doge's modules in megatron's slots: the dynamic-mask core attention, the cross-domain MoE (CDMoE) in the MLP slot
and the learned residual scales in each layer's residual adds.

Choices:
- Core attention (``DogeCoreAttention``, our ``CoreAttention`` with transformers' ``A`` and ``dt_proj``): the bias of
  KV head ``g`` at key ``j`` is ``exp(A[g] * softplus(dt_proj(v_j)[g]))``, ``v_j`` the key's values over *all* KV
  heads. Tensor parallelism splits ``A`` and ``dt_proj``'s rows with the KV heads; each rank all-gathers the values
  over TP (the backward reduce-scatters their gradients: every rank's heads read every rank's values) and computes
  its own heads' biases. Then ``kernels.dynamic_mask_attention`` (materialised scores, transformers' top-k over
  ``keep_window_size``). Packed (thd) sequences are refused (documents go in rows with the block mask).
- Context parallelism: each rank all-gathers the keys and values over the CP group in global order (``_gather_kv``;
  the backward reduce-scatters), computes the biases of every key and attends its two load-balanced query chunks at
  their global slots over all keys: a row's top-k reads that row's keys only, so the result is the whole sequence's.
- A cached ``generate`` step (``kv_cache``'s ``attend_over_cache`` hook): the new queries (slots ``past ..``) over the
  cached and new keys, the biases recomputed from the cached values as transformers does from its cache's (a
  ``[b, kv heads, keys]`` projection per step), causal and transformers' padding mask, then the same top-k.
- CDMoE (``cdmoe``): megatron's gated MLP (the shared expert: ``gate_proj`` / ``up_proj`` / ``down_proj``, split over
  TP as usual) plus transformers' retrieval experts: ``router_gate`` (``[2 * keys, H]``), ``down_embed`` /
  ``up_embed`` (``[num_experts, H]``), replicated on every TP rank (exact; their gradients are summed over TP under
  sequence parallelism, as the norms'). transformers views the router logits ``[b, s, 2 * keys]`` as
  ``[2, b * s, keys]``, so a token's two key scores come from other tokens of the batch (its own note: not causal);
  the logits of the whole batch are therefore gathered over the sequence-parallel ranks, then over the CP ranks (put
  in global order; the backwards reduce-scatter them), reordered to transformers' ``b``-major order, routed, and
  each rank keeps its tokens' experts.
- Residual adds (``scaled_residual_add``): megatron's bias-dropout-add slots as ``scale * residual + out`` with the
  layer's ``input_residual`` / ``post_attention_residual`` (replicated; summed over TP under sequence parallelism).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge_hf.bridges.own_weights import adapted
from loongforge_hf.kernels.attention import CoreAttention
from loongforge_hf.kernels.specs import SwiGLUMLP


def _parameter(config, *shape: int, split: bool, fill: float | None = None) -> torch.nn.Parameter:
    """A parameter of this rank's ``shape`` (``fill``, else normal with the config's std): split over TP on dim 0, or
    replicated with its gradient summed over TP under sequence parallelism."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from loongforge_hf.xpu import get_backend

    device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
    param = torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype, device=device))
    with torch.no_grad():
        param.fill_(fill) if fill is not None else param.normal_(0.0, config.init_method_std)
    if split:
        set_tensor_model_parallel_attributes(param, True, 0, 1)
    else:
        param.sequence_parallel = bool(config.sequence_parallel)
    return param


# NOTE: transformers' linears our modules hold as parameters, which LoRA adapts (lora/own_weights.py): the core
# attention's dt_proj (split with the KV heads), the retrieval experts' router_gate (on each rank's tokens)
CORE_OWN_WEIGHTS = {"dt_proj": "column"}
RETRIEVAL_OWN_WEIGHTS = {"router_gate": "sequence_parallel"}


def _tp_size(group) -> int:
    return group.size() if group is not None else 1


def causal_allowed(places: torch.Tensor, keys: int, *, causal: bool) -> torch.Tensor:
    """``[len(places), keys]`` bool: which keys (slots ``0 .. keys - 1``) the queries at slots ``places`` may see."""
    allowed = torch.arange(keys, device=places.device)[None, :] <= places[:, None]
    return allowed if causal else torch.ones_like(allowed)


@functools.cache
def doge_core_attention(keep_window: int) -> type:
    """Our ``CoreAttention`` with Doge's dynamic mask, keeping ``keep_window`` keys per row past that many."""
    from megatron.core.tensor_parallel.mappings import all_gather_last_dim_from_tensor_parallel_region
    from megatron.core.utils import divide
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    from loongforge_hf.kernels.attention import CAUSAL_MASK_TYPES, _cp_global_index, _gather_kv
    from loongforge_hf.kernels.dynamic_mask_attention import dynamic_mask_attention

    class DogeCoreAttention(CoreAttention):
        lora_own_weights = CORE_OWN_WEIGHTS

        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            groups = divide(config.num_query_groups, _tp_size(self.tp_group))
            self.A = _parameter(config, groups, split=True, fill=0.0)
            self.dt_proj = _parameter(config, groups, config.num_query_groups * config.kv_channels, split=True)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0, "A": 0, "dt_proj": 0},
                sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

        def biases(self, values: torch.Tensor) -> torch.Tensor:
            """``values [skv, b, g_local * d]`` (this rank's KV heads) -> this rank's heads' biases ``[b, g_local,
            skv]``: the values of every KV head gathered over TP (module docstring)."""
            if _tp_size(self.tp_group) > 1:
                values = all_gather_last_dim_from_tensor_parallel_region(values, self.tp_group)
            dt = adapted(self, "dt_proj", values, F.linear(values, self.dt_proj))
            return torch.exp(self.A * F.softplus(dt)).permute(1, 2, 0)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("DogeForCausalLM's attention takes no attention_bias or packed (thd) sequences; "
                                 "pack documents into rows (position ids restarting at 0).")
            if attention_mask is not None and attention_mask.dtype != torch.bool:
                raise ValueError("DogeForCausalLM's attention takes megatron's bool mask (True = masked) only.")
            sq = query.shape[0]
            if self.cp_group is not None:  # NOTE: this rank's two load-balanced query chunks over every key
                cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
                if sq % 2 or key.shape[0] != sq:
                    raise ValueError(f"DogeForCausalLM's context-parallel attention: local query / key lengths "
                                     f"({sq}, {key.shape[0]}) must be equal and even.")
                key, value = _gather_kv(key, value, self.cp_group,
                                        _cp_global_index([sq * cp], cp, query.device))
                chunk = sq // 2
                places = torch.cat([torch.arange(j * chunk, (j + 1) * chunk, device=query.device)
                                    for j in (rank, 2 * cp - 1 - rank)])
            else:
                places = torch.arange(key.shape[0] - sq, key.shape[0], device=query.device)
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            allowed = causal_allowed(places, key.shape[0], causal=mask_type in CAUSAL_MASK_TYPES)
            allowed = allowed[None, None] if attention_mask is None else allowed & ~attention_mask
            out = self.attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                              allowed=allowed)
            return out.permute(2, 0, 1, 3).reshape(sq, query.shape[1], -1)

        def attend(self, query, key, value, *, allowed):
            """``query [b, h, sq, d]`` over ``key / value [b, h_kv, skv, d]`` (this rank's heads, every key) under
            ``allowed`` (bool, broadcast to ``[b, 1, sq, skv]``) with the keys' dynamic mask."""
            b, skv = key.shape[0], key.shape[2]
            bias = self.biases(value.permute(2, 0, 1, 3).reshape(skv, b, -1))
            dropout_p = self.dropout_p if self.training else 0.0
            with self._dropout_context(dropout_p):
                return dynamic_mask_attention(query, key, value, bias, allowed=allowed, scale=self.softmax_scale,
                                              keep_window=keep_window, dropout_p=dropout_p)

        def attend_over_cache(self, query, key, value, *, past: int, mask):
            """A cached step (``kv_cache``): the new tokens' ``query [b, h, sq, d]`` (slots ``past ..``) over the
            cached and new ``key / value [b, h_kv, skv, d]``; ``mask`` ``[b, 1, 1, skv]`` True at padding keys, or
            None. The biases are recomputed from the cached values (transformers computes them from its cache's)."""
            places = torch.arange(past, past + query.shape[2], device=query.device)
            allowed = causal_allowed(places, key.shape[2], causal=True)[None, None]
            return self.attend(query, key, value, allowed=allowed if mask is None else allowed & ~mask)

    return DogeCoreAttention


@functools.cache
def doge_attention(keep_window: int) -> type:
    """megatron's ``SelfAttention`` with ``doge_core_attention(keep_window)`` in its core attention slot."""
    from megatron.core.transformer.attention import SelfAttention

    core = doge_core_attention(keep_window)

    class DogeSelfAttention(SelfAttention):
        def __init__(self, config, submodules, *args, **kwargs) -> None:
            super().__init__(config, replace(submodules, core_attention=core), *args, **kwargs)

    return DogeSelfAttention


class _Retrieval(torch.nn.Module):
    """transformers' ``router_gate``, ``down_embed`` and ``up_embed`` (replicated over TP)."""

    lora_own_weights = RETRIEVAL_OWN_WEIGHTS

    def __init__(self, config, *, experts: int, keys: int) -> None:
        from megatron.core import parallel_state as ps

        super().__init__()
        self.config, self.tp_group = config, ps.get_tensor_model_parallel_group()
        self.router_gate = _parameter(config, 2 * keys, config.hidden_size, split=False)
        self.down_embed = _parameter(config, experts, config.hidden_size, split=False)
        self.up_embed = _parameter(config, experts, config.hidden_size, split=False)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Its three tensors, replicated over TP (megatron's MLP asks each child for its sharded state dict)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets)


def _route(logits: torch.Tensor, *, keys: int, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' product-key routing of ``logits [2, tokens, keys]`` -> (experts, weights) ``[tokens, top_k]``."""
    (scores_x, scores_y), (indices_x, indices_y) = logits.topk(keys, dim=-1)
    all_scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)
    all_indices = (indices_x.unsqueeze(-1) * keys + indices_y.unsqueeze(-2)).flatten(-2)
    scores, position = all_scores.topk(top_k, dim=-1)
    weights = F.softmax(scores, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return all_indices.gather(-1, position), weights


@functools.cache
def cdmoe(*, experts: int, top_k: int, norm_topk_prob: bool, act: str) -> type:
    """The MLP slot as transformers' ``DogeCDMoE`` (module docstring): ``experts`` retrieval experts, the top ``top_k``
    of the product keys, activation ``act`` (transformers' ``ACT2FN`` name)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from transformers.activations import ACT2FN

    from loongforge_hf.parallel.context_parallel import cp_whole_sequence

    keys = math.floor(math.sqrt(experts))
    # NOTE: not a submodule: megatron's MLP asks every child for its sharded state dict (a training checkpoint)
    activation = ACT2FN[act]

    class DogeCDMoE(SwiGLUMLP):
        def __init__(self, config, submodules, *args, **kwargs) -> None:
            super().__init__(config, submodules, *args, **kwargs)
            self.retrieval = _Retrieval(config, experts=experts, keys=keys)

        def _routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """(experts, weights) ``[s_local * b, top_k]`` of this rank's tokens, routed over the whole batch."""
            logits = adapted(self.retrieval, "router_gate", hidden, F.linear(hidden, self.retrieval.router_gate))
            tp = ps.get_tensor_model_parallel_group()
            local = logits.shape[0]
            if self.config.sequence_parallel and _tp_size(tp) > 1:
                logits = gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=True, group=tp)
            start = ps.get_tensor_model_parallel_rank() * local if local < logits.shape[0] else 0
            mine = torch.arange(start, start + local, device=logits.device)  # NOTE: its rows of the SP-gathered
            if self.config.context_parallel_size > 1:  # NOTE: the CP ranks' load-balanced chunks, in global order
                logits, cp_rows = cp_whole_sequence(logits, ps.get_context_parallel_group())
                mine = cp_rows[mine]
            s, b = logits.shape[:2]
            # NOTE: transformers' [b, s, 2 * keys] logits viewed as [2, b * s, keys]
            chosen, weights = _route(logits.transpose(0, 1).reshape(2, b * s, keys), keys=keys, top_k=top_k,
                                     norm=norm_topk_prob)
            chosen, weights = (t.view(b, s, top_k).transpose(0, 1)[mine].reshape(-1, top_k)
                               for t in (chosen, weights))
            return chosen, weights

        def forward(self, hidden_states, *args, **kwargs):
            out, bias = super().forward(hidden_states, *args, **kwargs)
            chosen, weights = self._routing(hidden_states)
            tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
            down, up = self.retrieval.down_embed[chosen], self.retrieval.up_embed[chosen]  # NOTE: [t, top_k, H]
            gates = activation(torch.matmul(down, tokens.unsqueeze(-1)).squeeze(-1)) * weights
            routed = torch.matmul(gates.unsqueeze(1), up).view(hidden_states.shape)
            return out + routed, bias

    return DogeCDMoE


class ResidualScales(torch.nn.Module):
    """A layer's ``input_residual`` and ``post_attention_residual`` ``[H]`` (replicated over TP)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.input_residual = _parameter(config, config.hidden_size, split=False, fill=1.0)
        self.post_attention_residual = _parameter(config, config.hidden_size, split=False, fill=1.0)


def scaled_residual_add(scales: ResidualScales, name: str):
    """megatron's bias-dropout-add slot as ``scales.<name> * residual + out`` (no bias; the bridge sets no hidden
    dropout)."""

    def add(output_with_bias, residual, prob):
        output, bias = output_with_bias
        if bias is not None:
            raise ValueError("DogeForCausalLM's residual add takes no bias.")
        return getattr(scales, name) * residual + output

    return lambda training, fused: add


def add_residual_scales(chunk) -> None:
    """Each layer of ``chunk`` with its ``residual_scales`` and both residual adds scaled by them."""
    for layer in chunk.decoder.layers:
        layer.residual_scales = ResidualScales(layer.config)
        layer.self_attn_bda = scaled_residual_add(layer.residual_scales, "input_residual")
        layer.mlp_bda = scaled_residual_add(layer.residual_scales, "post_attention_residual")
