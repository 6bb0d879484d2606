"""HunYuanDenseV1ForCausalLM (Tencent's Hunyuan-0.5B / 1.8B / 4B / 7B): Llama's layout with per-head q / k norms after
the rotary embedding; and that attention (``HunYuanAttention``), which HunYuan-MoE (``hunyuan_v1_moe.py``) shares.

Choices:
- q / k norms (``query_layernorm`` / ``key_layernorm``, Llama's RMSNorm over each head) run after the rotation in
  transformers. A rotation keeps each head's norm but not its channels, so the norm's weight does not commute with
  it: megatron's norm slots (before its rotation) cannot take them as they are. ``rope_first_attention`` hands the
  layer's rotary angles to its q / k norm slots (``RotateThenNorm``: the rotation of ``kernels.rope.rotary_sbhd``,
  then the RMSNorm) and calls megatron's attention without them. The angles are the ones megatron gives the layer,
  so context parallelism's shares and the KV cache's slots (it keeps keys after the norm, as transformers' cache)
  hold as for any rotary layer. The norm's weight makes the result depend on the absolute rotation, not only on
  distances, so the angles are the forward's ``position_ids``' as transformers' (``PositionRotary`` in GPTModel's
  rotary slot, fed by a hook on the model's forward; ``[s, b, 1, d]``), not megatron's by slot: left-padded rows
  (positions from the first real token) and packed documents (positions restarting) rotate as in transformers, and
  the KV cache's steps take generate's positions (``absolute_positions.reads_positions``).
- Rope: default, or transformers' fixed NTK-alpha (``rope_type="dynamic"`` with ``alpha``: the hub's), which only
  stretches the base, ``theta * alpha ** (d / (d - 2))``: megatron's plain rope with that base. Dynamic NTK without
  ``alpha`` (frequencies that follow the length) and every other type are refused (an attention factor would need
  the q / k norm slots the rotation takes).
- Refused: ``attention_bias`` (transformers puts a bias on ``o_proj`` too). The dense MLP is Llama's, no biases.
"""

from __future__ import annotations

import functools
import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.mappings import Mapping, replaced, with_replaced_names
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.kernels.rmsnorm import RMSNorm

_NORMS = {".self_attn.q_norm.": ".self_attn.query_layernorm.", ".self_attn.k_norm.": ".self_attn.key_layernorm."}


class RotateThenNorm(RMSNorm):
    """A q / k norm slot that rotates ``[s, b, heads, d]`` by ``angles`` (``[s, 1, 1, d]``, set per forward by
    ``rope_first_attention``) before the RMSNorm."""

    angles: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from loongforge_hf.kernels.rope import rotary_sbhd

        if self.angles is None:
            raise ValueError("HunYuan q / k norm: the layer got no rotary angles.")
        return super().forward(rotary_sbhd(x, self.angles))


@functools.cache
def rope_first_attention() -> type:
    """megatron's ``SelfAttention`` whose rotary embedding runs in its q / k norm slots, before the norms."""
    from megatron.core.transformer.attention import SelfAttention

    class RopeFirstSelfAttention(SelfAttention):
        def forward(self, *args, **kwargs):
            angles = kwargs.get("rotary_pos_emb")
            q, k = angles if isinstance(angles, tuple) else (angles, angles)
            self.q_layernorm.angles, self.k_layernorm.angles = q, k
            kwargs.update(rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None)
            try:
                return super().forward(*args, **kwargs)
            finally:
                self.q_layernorm.angles = self.k_layernorm.angles = None

    return RopeFirstSelfAttention


class PositionRotary(torch.nn.Module):
    """GPTModel's ``rotary_pos_emb`` slot: the angles of this forward's ``position_ids`` (``[b, s]``, this rank's
    tokens, put in ``positions`` by ``finish_model``'s hook before GPTModel reads the slot) with megatron's
    ``inv_freq``, ``[s, b, 1, d]`` fp32; megatron's own (by slot) where a forward gives none."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.positions: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, **kwargs) -> torch.Tensor:
        if self.positions is None:
            return self.inner(max_seq_len, offset, packed_seq=packed_seq, **kwargs)
        freqs = self.positions.t().float()[..., None] * self.inner.inv_freq.float().to(self.positions.device)
        return torch.cat((freqs, freqs), dim=-1)[:, :, None]


def _keep_positions(model, args, kwargs) -> None:
    positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    model.rotary_pos_emb.positions = None if positions is None or positions.dim() != 2 else positions


class HunYuanAttention:
    """Mixin for a HunYuan bridge: the q / k norms after the rotation, rotation by ``position_ids``, NTK-alpha rope,
    transformers' norm names (module docstring)."""

    qk_norm = True
    rotary_by_position_ids = True                              # absolute_positions.reads_positions
    extra_rope_types = ()

    def check_config(self) -> None:
        if getattr(self.hf_config, "attention_bias", False):
            raise C.UnsupportedConfigError(f"attention_bias=True is not supported for {self.architectures[0]}: it "
                                           "puts a bias on o_proj too.")
        super().check_config()

    def rope_parameters(self) -> dict:
        c = self.hf_config
        params = dict(getattr(c, "rope_parameters", None) or {})
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "dynamic" and params.get("alpha"):
            d = C.head_dim_of(c)
            return {"rope_type": "default", "rope_theta": params["rope_theta"] * params["alpha"] ** (d / (d - 2))}
        if kind == "dynamic":
            raise C.UnsupportedConfigError("rope_parameters.rope_type='dynamic' without alpha is not supported "
                                           "(frequencies that change with the length).")
        return C.rope_parameters(c, extra_types=self.extra_rope_types)

    def qk_module(self) -> type:
        return RotateThenNorm

    def attention_module(self) -> type:
        return rope_first_attention()

    def finish_model(self, model) -> None:
        """Rotate by ``position_ids`` (module docstring)."""
        model.rotary_pos_emb = PositionRotary(model.rotary_pos_emb)
        model.register_forward_pre_hook(_keep_positions, with_kwargs=True)

    def attention_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NORMS) for m in super().attention_mappings()]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {replaced(n, _NORMS): shape for n, shape in super().attention_shapes(prefix).items()}


@register_bridge("HunYuanDenseV1ForCausalLM")
class HunYuanDenseV1Bridge(HunYuanAttention, DenseBridge):
    pass
