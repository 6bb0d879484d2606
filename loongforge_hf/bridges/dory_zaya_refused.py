"""Dory (``DoryForCausalLM``, ``model_type="dory"``) and ZAYA1 (``ZayaForCausalLM``, ``model_type="zaya"``) refused by
name (``registry.refuse_architectures``) with what each needs that is not built.

Choices:
- Dory, a looped nGPT (transformers' ``modeling_dory.py``). What maps to existing pieces: Afmoe's sigmoid output gate
  on the attention, Gemma 2's sandwich norms and Gemma 3's per-layer-type rope (sliding / full), a SwiGLU MLP. What is
  new, listed in the refusal:
  - the unit-sphere residual: every norm an L2 norm without a weight (sum, not mean, of squares), the residual an
    interpolation ``h + |lambda_1 * scale| * (norm(f(h)) - h)`` (``lambda_1`` / ``lambda_2``, ``ngpt_alpha_init``) in
    place of megatron's residual addition;
  - the looped section: layers ``n_input_layers`` to ``n_input_layers + n_recurrent_layers`` run
    ``n_recurrent_loops`` times with the same weights, each loop restarting from the normed state plus the normed
    input-section output (one layer object called several times a step, with a KV cache per loop or
    ``recurrent_kv_cache_mode="last_loop"``); Zamba's shared blocks (``zamba2_shared.py``) are called once a use
    from a fixed layer list, not in a loop;
  - learned scales megatron's attention and MLP have no slot for: ``sqk`` (squared, on the unit-norm queries after
    rope), ``s_gate`` (squared, inside the gate's sigmoid), ``suv_gate`` / ``suv_up`` on the MLP's two halves, L2
    sub-norms before ``o_proj`` / ``down_proj``, and the LM head's per-token ``logit_scale``.
- ZAYA1 (transformers' ``modeling_zaya.py``). What maps: Laguna's per-type partial rope, Qwen3-MoE's expert stacks,
  top-1 routing with a selection-only bias (``biased_routing.py``), a tied head. What is new, listed in the refusal:
  - CCA attention (``ZayaCCAProjection``): q / k concatenated through a causal depthwise then a grouped conv
    (``cca_time0`` / ``cca_time1``, with a conv state in the cache) plus averaged q / k residual paths, and values
    half from the current token (``v_proj_current``) and half from the previous token's ``v_proj_delayed``; then
    L2-normed q / k scaled to ``sqrt(head_dim)`` with a per-KV-head key temperature (``qk_norm.temp``);
  - the router: a ``router_hidden_size`` down projection carried from layer to layer (``router_states_scale``, the
    EDA state), an RMS norm and two GELU linears with biases, softmax over ``num_experts + 1`` classes where the last
    is a skip expert (no compute, weight zeroed), which megatron's router has no counterpart for;
  - the residual scalings (``(residual + residual_bias) * residual_scale`` after each sublayer, and the embedding's
    ``input_hidden_states_bias`` / ``input_hidden_states_scale``), the residual stream kept in fp32, an optional
    ``lm_head_bias``.
"""

from __future__ import annotations

from loongforge_hf.bridges.registry import refuse_architectures

DORY = ("it needs a looped nGPT not built here: unit-sphere L2 norms without weights and a residual interpolated "
        "towards the normed sublayer output at learned rates (lambda_1 / lambda_2, ngpt_alpha_init) in place of "
        "megatron's residual addition; a looped section (n_recurrent_layers run n_recurrent_loops times with shared "
        "weights, each loop re-adding the input section's output, a KV cache per loop or recurrent_kv_cache_mode); "
        "learned scales megatron's layers have no slot for (sqk on the queries, s_gate inside the output gate, "
        "suv_gate / suv_up on the MLP, L2 sub-norms before o_proj / down_proj, the LM head's logit_scale)")
ZAYA = ("it needs ZAYA's CCA attention and router, not built here: q / k mixed by a causal depthwise and grouped conv "
        "(cca_time0 / cca_time1, a conv state in the cache) with residual paths, values half from the previous "
        "token (v_proj_delayed), L2 q / k norms with a per-KV-head key temperature; a router carrying its "
        "router_hidden_size state from layer to layer (router_states_scale), an RMS norm and GELU MLP, softmax over "
        "num_experts + 1 with a skip expert; residual scalings (residual_scale / residual_bias, "
        "input_hidden_states_scale) on an fp32 residual stream")
refuse_architectures(DORY, "DoryForCausalLM")
refuse_architectures(ZAYA, "ZayaForCausalLM")
