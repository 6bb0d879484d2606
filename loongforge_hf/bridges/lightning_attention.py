"""MiniMax's lightning attention layer (transformers' ``MiniMaxLightningAttention``) as a megatron-style token mixer
for the self-attention slot, this TP rank's heads.

Choices:
- Tensor parallelism splits by heads. One column-parallel ``in_proj`` holds this rank's rows of transformers'
  ``qkv_proj`` (head-major: each head's q, k, v rows together, so a rank's heads are one block of rows) and of
  ``output_gate``, in that order (one all-gather of the tokens under sequence parallelism); ``out_proj`` is
  row-parallel. The decay tables (``slope_rate``, ``query_decay``, ``key_decay``, ``diagonal_decay``: persistent
  buffers of transformers' layer, in the checkpoint) are this rank's heads' rows, loaded as they are and used as
  transformers uses them (``kernels.lightning_attention``).
- Forward as transformers': ``silu`` of the projection, padded tokens (the diagonal of megatron's ``[b, 1, s, s]``
  mask) zeroed after it as transformers' ``apply_mask_to_padding_states``, the block-wise decayed linear attention,
  RMSNorm over all heads' channels (eps 1e-6, transformers' default for this norm; each rank's sum of squares added up
  over the TP group, the weight split with the heads; Llama's rounding) times ``sigmoid(output_gate(x))``, then
  ``out_proj``.
- Packed documents (megatron's mask blocks attention between documents): the recurrence restarts at each document
  (one call of the kernel per document); transformers has no packed form, so each document reads as a sequence of
  its own. megatron's inference context / THD inputs are refused (``kv_cache.refuse_megatron_state_inputs``).
- Context parallelism (``_mix_cp``): each rank runs its two load-balanced chunks from the zero state, every chunk's
  final ``k^T v`` state is all-gathered (differentiable, ``recurrent_cp.gather_chunks``) and folded in sequence
  order into the state entering each of its chunks, whose decayed read is added to the chunk's tokens; document
  starts (the whole sequence's, ``delta_rule_cp.read_cp_layout``) restart a chunk's run and stop the carry.
- Cached generate (``kv_cache.py``: one of transformers' ``LinearAttentionLayer`` per lightning layer of the rank, as
  for the Gated DeltaNets): a step runs its ``given`` new tokens (those transformers' mask marks as padding zeroed)
  from the ``k^T v`` state ``[b, heads, head_dim, head_dim]`` of this rank's heads and keeps the new one; the
  layout's padding after them never enters it. Beam search reorders it with the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.olmo2 import _SumOverGroup
from loongforge_hf.bridges.recurrent_common import CachedStep, _token_layout, mixer_projections, tp_group_of
from loongforge_hf.parallel import tp_sections
from loongforge_hf.parallel.context_parallel import cp_group_and_size

NORM_EPS = 1e-6  # NOTE: transformers builds this norm with MiniMaxRMSNorm's default eps, not rms_norm_eps
TABLES = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


class LightningAttention(torch.nn.Module):
    """One lightning-attention layer's token mixer, this TP rank's heads (see the module docstring)."""

    def __init__(self, config, *, layer_number: int, num_layers: int, heads: int, head_dim: int, block_size: int,
                 pg_collection=None, **_: object) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from loongforge_hf.kernels.lightning_attention import decay_tables, slope_rates
        from loongforge_hf.xpu import get_backend

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp = config.tensor_model_parallel_size
        self.tp_group = tp_group_of(pg_collection)
        self.heads, self.head_dim, self.full_width = heads // tp, head_dim, heads * head_dim
        self.in_proj, self.out_proj = mixer_projections(config, in_size=4 * self.full_width,
                                                        out_size=self.full_width, tp_group=self.tp_group)
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        self.norm_weight = torch.nn.Parameter(torch.ones(self.heads * head_dim, dtype=config.params_dtype,
                                                         device=device))
        set_tensor_model_parallel_attributes(self.norm_weight, True, 0, 1)
        local = self.heads * head_dim
        tp_sections.declare_rows(self.in_proj, (3 * local, local))  # NOTE: this rank's heads' q / k / v, its gate
        rank = torch.distributed.get_rank(self.tp_group) if tp > 1 else 0
        slope = slope_rates(heads, layer=layer_number - 1, num_layers=num_layers)
        slope = slope[rank * self.heads:(rank + 1) * self.heads]
        for name, table in zip(TABLES, (slope, *decay_tables(slope, block_size))):
            self.register_buffer(name, table.to(device=device, dtype=config.params_dtype))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                inference_context=None, packed_seq_params=None, cached: CachedStep | None = None, **_: object):
        from loongforge_hf.kv_cache import refuse_megatron_state_inputs

        refuse_megatron_state_inputs("Lightning attention", inference_context, packed_seq_params)
        if cached is not None:
            return self._cached_forward(hidden_states, cached)
        group = cp_group_and_size()[0]
        mixed = self.in_proj(hidden_states)[0].transpose(0, 1)           # [b, s, local]: all tokens
        real, starts = _token_layout(attention_mask, mixed.shape[0], mixed.shape[1], group=group)
        q, k, v, gate = self._split(mixed, real)
        if group is not None:
            core = self._mix_cp(q, k, v, starts, group)
        else:
            core = self._mix(q, k, v) if starts is None else self._from_zero(q, k, v, starts)[0]
        return self.out_proj(self._output(core, gate).transpose(0, 1).contiguous())

    def _cached_forward(self, hidden_states: torch.Tensor, step: CachedStep):
        """A cached generate step: the step's first ``step.given`` tokens from the layer's state in the cache (zero
        before the prompt; padding marked by ``step.real`` zeroed), the new state kept; the layout's padding after
        them gives zero outputs."""
        from loongforge_hf.kernels.lightning_attention import lightning_attention

        mixed = self.in_proj(hidden_states)[0]                           # [s, b, local]: the layout's padding too
        q, k, v, gate = self._split(mixed.transpose(0, 1)[:, :step.given], step.real)
        layer = step.cache.layers[step.index]
        state = layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None
        core, state = lightning_attention(q, k, v, **{name: getattr(self, name) for name in TABLES},
                                          initial_state=state, output_final_state=True)
        step.cache.update_recurrent_state(state, step.index)
        out = F.pad(self._output(core, gate), (0, 0, 0, mixed.shape[0] - step.given))
        return self.out_proj(out.transpose(0, 1).contiguous())

    def _split(self, mixed: torch.Tensor, real: torch.Tensor | None):
        """``in_proj``'s output ``[b, s, local]`` -> q, k, v ``[b, heads, s, head_dim]`` (``silu``; zero where
        ``real`` ``[b, s]`` is False, None: nowhere) and the output gate ``[b, s, heads * head_dim]``."""
        batch, seq, _ = mixed.shape
        width = self.heads * self.head_dim
        qkv, gate = torch.split(mixed, [3 * width, width], dim=-1)
        qkv = F.silu(qkv)
        if real is not None:
            qkv = qkv * real[..., None].to(qkv.dtype)
        q, k, v = torch.split(qkv.reshape(batch, seq, self.heads, 3 * self.head_dim).transpose(1, 2),
                              self.head_dim, dim=-1)
        return q, k, v, gate

    def _output(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The heads' outputs ``[b, heads, s, head_dim]`` -> the gated norm's ``[b, s, heads * head_dim]``."""
        core = core.transpose(1, 2).reshape(*gate.shape)
        return torch.sigmoid(gate) * self._norm(core)

    def _mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from loongforge_hf.kernels.lightning_attention import lightning_attention

        return lightning_attention(q, k, v, **{name: getattr(self, name) for name in TABLES})

    def _mix_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor | None, group):
        """``_mix`` over this CP rank's two chunks (``[b, heads, 2c, d]``: chunks r and ``2 * cp - 1 - r``), as over
        the whole sequence. Each chunk runs from the zero state (restarting at its documents' starts: ``starts``
        ``[b, s]`` of the whole sequence, None: no row packed); every chunk's final state is all-gathered, and each
        rank folds them in sequence order into the state entering its chunks, ``S_in(j + 1) = exp(-slope * c)
        S_in(j) + S_j`` (no carry through a chunk where a document starts). A token ``t`` tokens into a chunk, before
        its first document start, adds ``(q * exp(-slope * t)) S_in``: the exact decayed sum over the earlier
        chunks' keys (the block boundaries are the chunk's, so the rounding differs from one run)."""
        from loongforge_hf.parallel.linear_scan_cp import incoming_states
        from loongforge_hf.parallel.recurrent_cp import chunk_order, gather_chunks

        _, order = chunk_order(group)
        c = q.shape[2] // 2
        runs = [self._from_zero(*(x[:, :, i * c:(i + 1) * c] for x in (q, k, v)), _cuts(starts, j, c))
                for i, j in enumerate(order)]
        finals = gather_chunks([final for _, final in runs], group)
        offsets = torch.arange(1, c + 1, device=q.device)
        passes = torch.exp(-self.slope_rate * c)  # NOTE: [heads, 1, 1]; none through a chunk where a document starts
        carries = [passes if starts is None else passes * (~starts[:, j * c:(j + 1) * c].any(-1)).to(
            q.device, q.dtype)[:, None, None, None] for j in range(max(order))]
        states = incoming_states([(carry.expand_as(final), final) for carry, final in zip(carries, finals)])
        outs = []
        for i, (j, (core, _)) in enumerate(zip(order, runs)):
            inter = torch.matmul(q[:, :, i * c:(i + 1) * c] * torch.exp(-self.slope_rate * offsets[:, None]), states[j])
            if starts is not None:  # NOTE: tokens from the chunk's first document start on read no earlier state
                own = starts[:, j * c:(j + 1) * c]
                first = torch.where(own.any(-1), own.byte().argmax(-1), c).to(q.device)
                inter = inter * (offsets[None] <= first[:, None])[:, None, :, None].to(inter.dtype)
            outs.append(core + inter)
        return torch.cat(outs, dim=2)

    def _from_zero(self, q, k, v, cuts: list[list[int]] | None):
        """``[b, heads, s, d]`` outputs from the zero state, restarting at each row's ``cuts`` (its documents' starts;
        None: no row packed), and the final ``k^T v`` state (the last document's)."""
        from loongforge_hf.kernels.lightning_attention import lightning_attention

        tables = {name: getattr(self, name) for name in TABLES}
        if cuts is None:
            return lightning_attention(q, k, v, **tables, output_final_state=True)
        outs, finals = [], []
        for row, inner in enumerate(cuts):
            bounds = [0, *inner, q.shape[2]]
            pieces = [lightning_attention(*(x[row:row + 1, :, a:b] for x in (q, k, v)), **tables,
                                          output_final_state=True) for a, b in zip(bounds, bounds[1:]) if b > a]
            outs.append(torch.cat([out for out, _ in pieces], dim=2))
            finals.append(pieces[-1][1])
        return torch.cat(outs), torch.cat(finals)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over all heads' channels (each rank's squares summed over the TP group), Llama's rounding."""
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.config.tensor_model_parallel_size > 1:
            squares = _SumOverGroup.apply(squares, self.tp_group)
        return self.norm_weight * (xf * torch.rsqrt(squares / self.full_width + NORM_EPS)).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from loongforge_hf.bridges.recurrent_common import mixer_sharded_state_dict

        own = {"norm_weight": self.norm_weight, **{name: getattr(self, name) for name in TABLES}}
        split = {name: 1 if name == "diagonal_decay" else 0 for name in own}
        return mixer_sharded_state_dict(self, prefix, sharded_offsets, metadata, own, split)


def _cuts(starts: torch.Tensor | None, chunk: int, c: int) -> list[list[int]] | None:
    """Each row's document starts inside chunk ``chunk`` (offsets from its first token), None where no row has one."""
    if starts is None or not bool(starts[:, chunk * c:(chunk + 1) * c].any()):
        return None
    return [torch.nonzero(row).flatten().tolist() for row in starts[:, chunk * c:(chunk + 1) * c]]
