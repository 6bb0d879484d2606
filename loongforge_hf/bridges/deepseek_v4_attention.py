"""DeepSeek-V4's attention (transformers' ``DeepseekV4Attention`` and its compressors) as a module of our own in
megatron's self-attention slot: megatron has no shared-KV MQA with a compressed KV branch, an indexer over it, sinks
and a grouped low-rank output projection in one layer.

Choices:
- transformers' eager path step by step (no cache): the query through ``q_a_proj`` / ``q_a_norm`` / ``q_b_proj`` and
  an unweighted per-head RMS norm, one shared K=V head (``kv_proj`` / ``kv_norm``), interleaved partial rope on the
  trailing ``qk_rope_head_dim`` channels (``main`` rope on sliding layers, ``compress`` rope on the compressed ones),
  the sliding-window causal mask, per-head sinks, the output de-rotated at the query's position, then the grouped
  ``o_a_proj`` and ``o_b_proj``. ``heavily_compressed_attention`` appends one softmax-pooled entry per
  ``compress_rate`` tokens, visible once its window has closed; ``compressed_sparse_attention`` pools overlapping
  windows (two series) and keeps, per query, the ``index_topk`` entries its lightning indexer scores highest. The
  indexer only chooses (a top-k): its tensors take no gradient, as in transformers, and are frozen here (no update;
  marked ``takes_no_gradient``, so LoRA's ``modules_to_save`` and adapters there stay frozen too). A row shorter than
  a compression window gives no entry, and the compressor's tensors a zero gradient (transformers': none), which is
  the same update under megatron's gradient buffers and lets their overlapped reduction start.
- Rotary frequencies are transformers' own (``ROPE_INIT_FUNCTIONS`` on the HF config, per rope label), so YaRN on the
  ``compress`` rope is theirs; the attention scaling factor they return multiplies cos / sin as theirs does.
- Tensor parallelism: the module is replicated (transformers' own TP plan keeps attention replicated: one KV head,
  compressors over the whole sequence). Under sequence parallelism the layer input is all-gathered (its gradient
  split back), each rank computes the whole attention and keeps its own tokens (their gradient all-gathered), so every
  rank's attention weights take the whole gradient, like any replicated weight.
- Context parallelism: the layer input is all-gathered over the CP group and put in sequence order (its gradient
  summed back to each rank's rows); every rank computes the keys and the compressed entries of the whole sequence
  (the compressors pool windows of all of it) and the queries, scores and output of its own tokens only (megatron's
  mask holds their rows), as megatron's CP splits queries over ranks. The rest of the layer (hyper-connections, MoE)
  runs on the rank's tokens.
- Padding: the sliding keys follow megatron's mask (transformers' padding mask); the compressed entries follow only
  causality, as transformers' ``block_bias``. Positions are ``0..s-1`` of the (padded) sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' ``DeepseekV4RMSNorm`` (``weight``) / ``DeepseekV4UnweightedRMSNorm`` (None)."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    y = x.float()
    return (weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' interleaved rope on the trailing ``2 * cos.shape[-1]`` channels; ``cos`` ``[b, s, r/2]``,
    ``x`` ``[b, heads, s, d]``."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, ((rope.float() * cos) + (turned.float() * sin)).to(x.dtype)], dim=-1)


def _whole_sequence(x: torch.Tensor):
    """Under context parallelism: (the whole sequence ``[S, b, h]`` in order, gathered over the CP group (its
    gradient summed back to each rank's rows), the positions of this rank's tokens in it, in local order); else
    ``(x, None)``."""
    from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_whole_sequence

    group, cp, _ = cp_group_and_size()
    return (x, None) if cp == 1 else cp_whole_sequence(x, group)


class Rotary(torch.nn.Module):
    """cos / sin ``[b, s, r/2]`` of one rope label (``main`` / ``compress``) at given positions."""

    def __init__(self, hf_config, label: str) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        kind = hf_config.rope_parameters[label]["rope_type"]
        init = DeepseekV4RotaryEmbedding.compute_default_rope_parameters if kind == "default" \
            else ROPE_INIT_FUNCTIONS[kind]
        inv_freq, self.scaling = init(hf_config, None, layer_type=label)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


def _linear(inp: int, out: int, dtype) -> torch.nn.Linear:
    return torch.nn.utils.skip_init(torch.nn.Linear, inp, out, bias=False, dtype=dtype)


def _vector(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=torch.float32))


class Compressor(torch.nn.Module):
    """transformers' HCA compressor (``overlap`` False) or CSA compressor / indexer compressor (``overlap`` True):
    ``forward(h [b, s, H], positions [b, s])`` -> pooled entries ``[b, T, head_dim]`` (rope at ``w * rate``)."""

    def __init__(self, hf_config, *, rate: int, head_dim: int, overlap: bool, dtype) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.rate, self.head_dim, self.overlap, self.eps = rate, head_dim, overlap, hf_config.rms_norm_eps
        self.kv_proj, self.gate_proj = _linear(hf_config.hidden_size, width, dtype), \
            _linear(hf_config.hidden_size, width, dtype)
        self.position_bias = _vector(rate, width)
        self.kv_norm = torch.nn.Module()
        self.kv_norm.weight = _vector(head_dim)

    def forward(self, h: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        b, s, _ = h.shape
        n, rate, d, w = s // self.rate, self.rate, self.head_dim, self.kv_proj.out_features
        # NOTE: with no whole window yet (n == 0) the same ops run on none: no entry, and every tensor here takes a
        # (zero) gradient, which megatron's overlapped gradient reduction expects of each trainable parameter
        kv = self.kv_proj(h)[:, :n * rate].view(b, n, rate, w)
        gate = self.gate_proj(h)[:, :n * rate].view(b, n, rate, w) + self.position_bias
        if self.overlap:  # NOTE: entry w pools window w-1's first series with window w's second (transformers' CSA)
            pooled_kv = kv.new_zeros((b, n, 2 * rate, d))
            pooled_gate = gate.new_full((b, n, 2 * rate, d), float("-inf"))
            pooled_kv[:, :, rate:], pooled_gate[:, :, rate:] = kv[..., d:], gate[..., d:]
            if n > 1:
                pooled_kv[:, 1:, :rate], pooled_gate[:, 1:, :rate] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
            kv, gate = pooled_kv, pooled_gate
        pooled = rms_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2),
                          self.kv_norm.weight, self.eps)
        positions = (torch.arange(n, device=h.device) * rate).unsqueeze(0).expand(b, -1)
        cos, sin = rotary(positions, pooled.dtype)
        return apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)


class Indexer(torch.nn.Module):
    """transformers' lightning indexer: per query the ``index_topk`` visible compressed entries it scores highest
    (``-1`` where fewer are visible)."""

    def __init__(self, hf_config, dtype) -> None:
        super().__init__()
        c = hf_config
        self.rate, self.heads, self.head_dim, self.topk = (c.compress_rates[CSA], c.index_n_heads, c.index_head_dim,
                                                           c.index_topk)
        self.compressor = Compressor(c, rate=self.rate, head_dim=self.head_dim, overlap=True, dtype=dtype)
        self.q_b_proj = _linear(c.q_lora_rank, self.heads * self.head_dim, dtype)
        self.weights_proj = _linear(c.hidden_size, self.heads, dtype)

    @torch.no_grad()
    def forward(self, h, h_q, q_residual, positions, rotary: Rotary) -> torch.Tensor:
        """Entries pooled over the whole sequence ``h`` ``[b, s, H]``; the queries ``h_q`` ``[b, s_q, H]`` (their
        ``q_residual``) at ``positions`` ``[b, s_q]``."""
        b, s_q, _ = h_q.shape
        keys = self.compressor(h, rotary)
        cos, sin = rotary(positions, h.dtype)
        q = apply_rope(self.q_b_proj(q_residual).view(b, s_q, -1, self.head_dim).transpose(1, 2), cos, sin)
        scores = torch.matmul(q.transpose(1, 2).float(), keys.transpose(-1, -2).float().unsqueeze(1))
        weights = self.weights_proj(h_q).float() * self.heads ** -0.5
        scores = (F.relu(scores) * self.head_dim ** -0.5 * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, T]
        visible = (positions + 1) // self.rate
        if keys.shape[1] == 0:
            return scores.topk(0, dim=-1).indices
        future = torch.arange(keys.shape[1], device=h.device).view(1, 1, -1) >= visible.unsqueeze(-1)
        chosen = scores.masked_fill(future, float("-inf")).topk(min(self.topk, keys.shape[1]), dim=-1).indices
        return torch.where(chosen >= visible.unsqueeze(-1), torch.full_like(chosen, -1), chosen)


class DeepseekV4Attention(torch.nn.Module):
    """One layer's attention (module docstring). ``forward(x [s, b, H], attention_mask)`` -> ``(out [s, b, H],
    None)``, ``s`` this rank's tokens."""

    def __init__(self, hf_config, *, layer: int, config) -> None:
        super().__init__()
        c, dtype = hf_config, config.params_dtype
        self.kind, self.eps, self.window = c.layer_types[layer], c.rms_norm_eps, c.sliding_window
        self.heads, self.head_dim, self.groups = c.num_attention_heads, c.head_dim, c.o_groups
        self.sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        self.q_a_proj = _linear(c.hidden_size, c.q_lora_rank, dtype)
        self.q_a_norm = torch.nn.Module()
        self.q_a_norm.weight = _vector(c.q_lora_rank)
        self.q_b_proj = _linear(c.q_lora_rank, self.heads * self.head_dim, dtype)
        self.kv_proj = _linear(c.hidden_size, self.head_dim, dtype)
        self.kv_norm = torch.nn.Module()
        self.kv_norm.weight = _vector(self.head_dim)
        self.o_a_proj = _linear(self.heads * self.head_dim // self.groups, self.groups * c.o_lora_rank, dtype)
        self.o_b_proj = _linear(self.groups * c.o_lora_rank, c.hidden_size, dtype)
        self.sinks = _vector(self.heads)
        self.rotary = Rotary(c, "main" if self.kind == SLIDING else "compress")
        if self.kind != SLIDING:
            rate = c.compress_rates[self.kind]
            self.compressor = Compressor(c, rate=rate, head_dim=self.head_dim, overlap=self.kind == CSA, dtype=dtype)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(c, dtype)
                for p in self.compressor.indexer.parameters():
                    p.requires_grad_(False)  # NOTE: transformers' indexer only chooses: no gradient, no update
                    p.takes_no_gradient = True  # NOTE: LoRA keeps it so (modules_to_save, adapters: replicated.py)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **_):
        from megatron.core.tensor_parallel import (gather_from_sequence_parallel_region,
                                                   scatter_to_sequence_parallel_region)

        x = hidden_states
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        whole, mine = _whole_sequence(x)
        out = self._attend(whole.transpose(0, 1), attention_mask, mine).transpose(0, 1).contiguous()
        if self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out)
        return out, None

    def _sliding_bias(self, b: int, queries: torch.Tensor, s: int, attention_mask, dtype) -> torch.Tensor:
        """``[b, 1, len(queries), s]``: the window's causal bias of the queries at ``queries`` over the ``s`` keys,
        and megatron's mask (those queries' rows)."""
        k = torch.arange(s, device=queries.device)
        masked = (k[None, :] > queries[:, None]) | (k[None, :] <= queries[:, None] - self.window)
        masked = masked[None, None].expand(b, 1, *masked.shape)
        if attention_mask is not None:
            masked = masked | attention_mask.to(queries.device).bool()
        return torch.zeros(masked.shape, device=queries.device, dtype=dtype).masked_fill(masked, torch.finfo(dtype).min)

    def _compressed(self, h, h_q, q_residual, positions, b: int):
        """(entries ``[b, 1, T, d]`` pooled over the whole sequence ``h``, their bias ``[b, 1, s_q, T]`` for the
        queries ``h_q`` at ``positions``) of a compressed layer."""
        entries = self.compressor(h, self.rotary)
        t, s_q = entries.shape[1], positions.shape[1]
        if self.kind == HCA:
            visible = (positions + 1) // self.compressor.rate
            future = torch.arange(t, device=h.device).view(1, 1, 1, -1) >= visible[:, None, :, None]
            return entries.unsqueeze(1), h.new_zeros((b, 1, s_q, t)).masked_fill(future, float("-inf"))
        chosen = self.compressor.indexer(h, h_q, q_residual, positions, self.rotary)
        chosen = torch.where(chosen >= 0, chosen, torch.full_like(chosen, t))
        bias = h.new_full((b, 1, s_q, t + 1), float("-inf")).scatter_(-1, chosen.unsqueeze(1), 0.0)
        return entries.unsqueeze(1), bias[..., :t]

    def _attend(self, h: torch.Tensor, attention_mask, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output of the queries at positions ``rows`` (None: every one) of the whole sequence ``h``
        ``[b, s, H]`` over all of its keys and compressed entries; ``attention_mask``: megatron's, those queries'
        rows."""
        b, s, _ = h.shape
        everyone = torch.arange(s, device=h.device)
        queries = everyone if rows is None else rows
        h_q = h if rows is None else h.index_select(1, rows)
        positions, key_positions = (p.unsqueeze(0).expand(b, -1) for p in (queries, everyone))
        cos, sin = self.rotary(positions, h.dtype)
        q_residual = rms_norm(self.q_a_proj(h_q), self.q_a_norm.weight, self.eps)
        q = rms_norm(self.q_b_proj(q_residual).view(b, len(queries), -1, self.head_dim).transpose(1, 2), None,
                     self.eps)
        q = apply_rope(q, cos, sin)
        kv = rms_norm(self.kv_proj(h), self.kv_norm.weight, self.eps).view(b, s, 1, self.head_dim).transpose(1, 2)
        kv = apply_rope(kv, *((cos, sin) if rows is None else self.rotary(key_positions, h.dtype)))
        bias = self._sliding_bias(b, queries, s, attention_mask, h.dtype)
        if self.kind != SLIDING:
            entries, entry_bias = self._compressed(h, h_q, q_residual, positions, b)
            kv = torch.cat([kv, entries], dim=2)
            bias = torch.cat([bias, entry_bias.to(bias.dtype)], dim=-1)
        scores = torch.matmul(q, kv.transpose(2, 3)) * self.head_dim ** -0.5 + bias
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, len(queries), -1)  # NOTE: fp32: the softmax's dtype
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
        out = apply_rope(torch.matmul(probs, kv), cos, -sin).transpose(1, 2)  # [b, s_q, heads, d]
        grouped = out.reshape(b, len(queries), self.groups, -1)
        weight = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.einsum("bsgi,gri->bsgr", grouped, weight).flatten(2))
