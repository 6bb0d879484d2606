"""MambaForCausalLM (state-spaces' Mamba) and FalconMambaForCausalLM (TII's Falcon-Mamba-7B): a pure stack of Mamba-1
blocks, each an RMS pre-norm, the Mamba-1 mixer and the residual add, then ``backbone.norm_f`` and the LM head (tied to
the embedding by default).

Choices:
- Each block is one megatron ``TransformerLayer`` with its MLP's slots empty, as Mamba2's (``mamba2_lm.py``, whose
  bridge this one extends: names, final norm, LM head, the config view with attention sizes), with our
  ``MambaMixer`` (``mamba1.py``) in the self-attention slot: the layouts and the tensor table are
  ``mamba1_layers.py``'s. Falcon-Mamba's mixer is the same with weightless RMS norms (``mixer_rms_eps``) over the
  time steps and the state's ``B`` / ``C``.
- ``residual_in_fp32``: as Mamba2's (the same in fp32; ours keeps the model's dtype in bf16).
- Refused before any collective: ``use_bias`` (``in_proj`` / ``out_proj`` biases), ``hidden_act`` other than silu,
  and what ``mamba1_layers.py`` refuses (``intermediate_size`` that does not split over TP, the static cache).
  Context parallelism passes the Mamba-1 states between the CP chunks (``mamba1.py``).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.mamba1_layers import Mamba1Layers
from loongforge_hf.bridges.mamba2_lm import Mamba2Bridge, attention_sizes
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("MambaForCausalLM", "FalconMambaForCausalLM")
class MambaBridge(Mamba1Layers, Mamba2Bridge):
    def __init__(self, hf_config) -> None:
        super(Mamba2Bridge, self).__init__(attention_sizes(hf_config, heads=hf_config.intermediate_size))

    @property
    def layout_heads(self) -> int:
        return self.hf_config.intermediate_size

    def check_config(self) -> None:
        c, arch = self.hf_config, self.arch_name
        C.refuse_set_fields(c, arch, (("use_bias", "biases of the Mamba in_proj / out_proj"),))
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                           "the Mamba conv and gate use it).")

    def mamba_dims(self) -> dict:
        c = self.hf_config
        return dict(d_inner=c.intermediate_size, d_state=c.state_size, dt_rank=int(c.time_step_rank),
                    conv_kernel=c.conv_kernel, conv_bias=bool(c.use_conv_bias),
                    rms_eps=getattr(c, "mixer_rms_eps", None))
