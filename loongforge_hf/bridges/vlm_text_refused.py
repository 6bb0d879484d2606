"""Language models of image-text families refused by name with what megatron cannot run exactly yet
(``registry.refuse_architectures``); the ones bridged: Emu3 (``llama.py``), Gemma 4 Unified (``gemma4.py``), Cohere
Compass (``cohere.py``).

Choices:
- MiniMax-M3-VL's language model (``MiniMaxM3VLForCausalLM``, ``minimax_m3_vl_text``): its ``minimax_m3_sparse``
  layers attend through a lightning indexer that keeps, per query, the top ``index_topk_blocks`` blocks of
  ``index_block_size`` keys plus ``index_local_blocks`` local ones (block-sparse attention, no megatron counterpart
  and no exact kernel of ours); beside it a dense / sparse MLP per layer (``mlp_layer_types``), a shared expert,
  clamped SwiGLU-OAI experts (``swiglu_alpha``, ``swiglu_limit``) and zero-centred norms, which MiniMax-M2's bridge
  does not cover.
- dots3-note's language model (``Dots3NoteForCausalLM``, ``dots3_note`` / ``dots3_note_text``): multi-latent attention
  with per-layer fields (``per_layer_config``), latents rescaled by ``sqrt(hidden / rank)``, a norm on the rotary key
  head, a sigmoid output gate per head, windowed layers beside DeepSeek sparse attention (``indexed_attention``) layers
  and shared experts of their own width: several new pieces in megatron's MLA slots, none built yet.
"""

from __future__ import annotations

from loongforge_hf.bridges.registry import refuse_architectures

MINIMAX_M3 = ("block-sparse attention (the minimax_m3_sparse layers' lightning indexer choosing index_topk_blocks "
              "blocks of index_block_size keys per query), which megatron's attention does not have, beside "
              "per-layer dense / sparse MLPs, a shared expert and clamped SwiGLU-OAI experts")
DOTS3_NOTE = ("multi-latent attention with per-layer fields, rescaled latents, a normed rotary key head and a sigmoid "
              "gate per head, beside DeepSeek sparse attention and windowed layers: new pieces in megatron's MLA "
              "slots, not built yet")
refuse_architectures(MINIMAX_M3, "MiniMaxM3VLForCausalLM")
refuse_architectures(DOTS3_NOTE, "Dots3NoteForCausalLM")
