"""Which parameters a LoraConfig's ``target_parameters`` names (PEFT's ``ParamWrapper``): the routed experts' 3-D
stacks and the router of Qwen3-MoE, Mixtral, gpt-oss and Qwen3-VL-MoE, as PEFT adapts them on the transformers 5
model.

Choices:
- PEFT's config rewrite for these models (``as_peft_rewrites``) turns expert projection names into
  ``gate_up_proj`` / ``down_proj`` and the router's into ``gate.weight``; ``"all-linear"`` names all three. They are
  matched as PEFT's ``_inject_parameters`` matches them: every parameter of the HF module tree whose name is a target or
  ends with ``"." + target``, in ``named_modules`` order, then in the module's registration order: the order PEFT
  creates the adapters in (and draws their initial values in, after all module targets). As in PEFT,
  ``layers_to_transform`` and ``exclude_modules`` do not apply to parameters.
- Rank and alpha per parameter (and per module target: ``rank_and_alpha``): ``rank_pattern`` / ``alpha_pattern``
  resolved with PEFT's ``get_pattern_key`` on the full name, as PEFT's ``_create_and_replace``; PEFT's rewrite adds
  ``.*\\.gate_up_proj`` itself (gate and up fused: r and alpha doubled, so each half keeps PEFT's scaling).
- An expert stack ``[E, out, in]`` gets A ``[r * E, in]`` (expert e's rows ``e * r .. e * r + r - 1``) and B
  ``[out, r * E]`` (expert e's columns ``e, E + e, 2E + e, ...``: PEFT reads B as ``[out, r, E]``); the router
  ``[E, H]`` a plain A ``[r, H]``, B ``[E, r]``. A stack its module marks ``is_transposed`` (gpt-oss's, ``[E, in,
  out]``) keeps PEFT's in / out as they are there; its B's rows, gate and up alternating, take megatron's ``[gate;
  up]`` order through the bridge's mapping (``Target.b_to_megatron``).
- Llama 4 (``feed_forward.experts.gate_up_proj`` / ``down_proj``, ``feed_forward.router.weight``; no PEFT rewrite:
  ``target_parameters`` name them): its stacks are ``[E, in, out]`` (``x @ W_e``) but its module does not say so
  (``is_transposed``), so PEFT takes in and out the other way round: its A ``[r * E, out]`` works on the stack's
  output side and B ``[in, r * E]`` on its input, ``W_e + s * B_e A_e`` all the same. The targets keep PEFT's in /
  out (its shapes, on load and export) and say so (``Target.factors_swapped``); ``experts.megatron_factors`` turns
  them into the megatron orientation (A ``[E, r, in]`` = PEFT's B transposed, B ``[E, out, r]`` = its A transposed).
  Its router is an ``nn.Linear`` returning routing scores and logits: PEFT's LoRA layer on it (its name in
  ``target_modules``, ``"all-linear"`` included) fails in the forward, so that is refused
  (``refuse_own_forward_linears``), naming ``target_parameters=['feed_forward.router.weight']`` instead.
- Image-text models: the language layers are found under the text bridge's ``text_prefix`` (the checkpoint's name of
  the language model; ``"model"`` for a text model), each module-tree name taken to the checkpoint's by the plan's
  ``on_disk`` (``vision.checkpoint_names``): ``model.language_model.layers.N`` for Qwen3-VL-MoE / Qwen3.5-MoE,
  ``language_model.model.layers.N`` for Llama 4, whatever else a bridge declares.
- Qwen3-VL-MoE: the language layers' stacks and router (``model.language_model.layers.N.mlp...``), with no PEFT
  rewrite for this model (``target_parameters`` name them; ``gate_proj`` / ``up_proj`` / ``down_proj`` are the dense
  layers' linears). Its module's stacks are ``[E, 2I, H]`` / ``[E, H, I]`` whatever the checkpoint holds (the hub's
  transposed stacks are transposed by transformers at load), so the adapters' shapes and PEFT's names are the same
  for both on-disk layouts; only the base weights' mapping differs (``StackedGateUp(transposed=...)``).
- Names as PEFT saves them: ParamWrappers on one module nest in creation order, the first innermost, so with both
  stacks adapted ``gate_up_proj``'s adapter is ``<...>.mlp.experts.base_layer.lora_A.weight`` and ``down_proj``'s
  ``<...>.mlp.experts.lora_A.weight``; the router's ``<...>.mlp.gate.lora_A.weight``.
- Gemma 4's MoE block (``Gemma4ForCausalLM`` with ``enable_moe_block``; no PEFT rewrite for it): the stacks sit on the
  layer itself, ``layers.N.experts.gate_up_proj`` / ``down_proj`` (``[E, 2I, H]`` / ``[E, H, I]``, as Qwen3-MoE's);
  ``"all-linear"`` adapts the attention, the dense MLP (megatron's shared experts) and the router's ``router.proj``
  (an ``nn.Linear``: a module target of kind ``"router"``, its adapter reading the router's transformed input,
  ``gating_input``).
- DeepSeek-V4 / HY-V4 (``bridges/deepseek_v4_lora.py``): the routed experts' stacks and the router as Qwen3-MoE's
  (transformers' module tree stacks the experts; the checkpoint's one tensor per expert is read by the stacked
  mapping; DeepSeek-V4's routers by their own rules read the adapted gating's logits).
- AFMoE: PEFT's rewrite names its stacks and its router, ``mlp.router.gate.weight`` (sigmoid routing with a fixed
  bias, megatron's router re-classed as any other's).
- LongCat-Flash (its HF layer ``i`` two megatron layers, the MoE in ``2i``: ``bridge.lora_param_layer``): the routed
  experts' ``down_proj`` as Qwen3-MoE's; its ``gate_up_proj`` (rows of the zero experts too) is refused by its bridge.
- Refused, naming the way out: ``lora_dropout`` != 0 with parameter targets (PEFT refuses it too), experts under
  megatron's ``SequentialMLP`` (``LOONGFORGE_MOE_GROUPED_GEMM=0``), any other parameter.
"""

from __future__ import annotations

import math
import re

from loongforge_hf.lora.plan import LoraConfigError, Target

# NOTE: Gemma 4's MoE block keeps its experts on the layer itself (``layers.N.experts.*``); AFMoE's router is
# ``mlp.router.gate``
_PARAM = (r"\.layers\.(\d+)\.(?:mlp\.|feed_forward\.)?(?:experts\.gate_up_proj|experts\.down_proj|gate\.weight|"
          r"router\.weight|router\.gate\.weight)$")
SUPPORTED = ("'gate_up_proj' and 'down_proj' (routed experts) and 'gate.weight' / 'router.weight' (router) of "
             "Qwen3-MoE / Mixtral / gpt-oss / Qwen3-VL-MoE / Llama 4 (under 'feed_forward.'); 'mlp.experts."
             "gate_up_proj' / 'mlp.experts.down_proj' / 'mlp.gate.weight' of DeepSeek-V4 / HY-V4 (AFMoE's router: "
             "'mlp.router.gate.weight'); Gemma 4's "
             "'experts.gate_up_proj' / 'experts.down_proj' (its router: 'router.proj' in target_modules)")


def rank_and_alpha(config, key: str) -> tuple[int, float]:
    """(r, lora_alpha) of the module or parameter ``key`` (its full HF name): PEFT's ``rank_pattern`` /
    ``alpha_pattern`` lookup, else the config's ``r`` / ``lora_alpha``."""
    from peft.utils.other import get_pattern_key

    r = (config.rank_pattern or {}).get(get_pattern_key((config.rank_pattern or {}).keys(), key), config.r)
    alpha = (config.alpha_pattern or {}).get(get_pattern_key((config.alpha_pattern or {}).keys(), key),
                                             config.lora_alpha)
    if not isinstance(r, int) or r < 1:
        raise LoraConfigError(f"LoraConfig(rank_pattern=...) gives {key} r={r!r}: r must be a positive integer.")
    return r, alpha


def _matches(key: str, names) -> bool:
    return key in names or any(key.endswith(f".{n}") for n in names)


def param_pattern(bridge) -> re.Pattern:
    """The checkpoint names of the parameters that can be targets: under the language model's ``text_prefix``."""
    return re.compile("^" + re.escape(getattr(bridge, "text_prefix", "model")) + _PARAM)


def plan_param_targets(config, skeleton, bridge, on_disk=lambda name: name) -> list[Target]:
    """The parameter targets of (rewritten) ``config`` on ``skeleton``, in PEFT's creation order (``on_disk``: a
    module-tree name -> the checkpoint's, ``vision.checkpoint_names``)."""
    names = list(config.target_parameters or [])
    if not names:
        return []
    pattern = param_pattern(bridge)
    # NOTE: a bridge whose HF layer holds several megatron layers says which one holds the MoE (LongCat-Flash's 2i)
    to_layer = getattr(bridge, "lora_param_layer", lambda hf_layer: hf_layer)
    found: list[tuple[str, str, str, tuple[int, ...]]] = []   # (module, parameter, key, [E,] out, in)
    refused = []
    for module_name, module in skeleton.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            key = f"{module_name}.{pname}"
            if not _matches(key, names):
                continue
            m = pattern.match(on_disk(key))
            if m is None or not bridge.is_moe_layer(to_layer(int(m.group(1)))):
                refused.append(key)
            elif param.dim() == 3 and getattr(module, "is_transposed", False):  # NOTE: gpt-oss: [E, in, out]
                found.append((module_name, pname, key, (param.shape[0], param.shape[2], param.shape[1])))
            else:  # NOTE: Llama 4's [E, in, out] too: PEFT's in / out (module docstring)
                found.append((module_name, pname, key, tuple(param.shape)))
    if refused or not found:
        what = f"match {refused[:3]}, which cannot" if refused else "match no parameter that can"
        raise LoraConfigError(f"target_parameters={sorted(names)} on {type(skeleton).__name__} {what} carry a LoRA "
                              f"adapter here; supported: {SUPPORTED}.")
    if float(config.lora_dropout):
        raise LoraConfigError(f"lora_dropout={config.lora_dropout} with LoRA on the routed experts or the router "
                              f"(target_parameters={sorted(names)}): PEFT applies no dropout to parameter targets "
                              "and refuses it; set lora_dropout=0, or adapt only the attention projections "
                              "(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']).")
    if any("experts" in key for _, _, key, _ in found) and not bridge.grouped_experts:
        raise LoraConfigError("LoRA on the routed experts needs loongforge's grouped expert MLP; unset "
                              "LOONGFORGE_MOE_GROUPED_GEMM=0 (megatron's SequentialMLP is not supported).")

    per_module: dict[str, list[str]] = {}
    for module_name, pname, _, _ in found:
        per_module.setdefault(module_name, []).append(pname)
    targets = []
    swapped = bool(getattr(bridge, "hf_experts_in_out", False))  # NOTE: Llama 4 (module docstring)
    for module_name, pname, key, shape in found:
        layer = to_layer(int(pattern.match(on_disk(key)).group(1)))
        wrapped_after = len(per_module[module_name]) - 1 - per_module[module_name].index(pname)
        r, alpha = rank_and_alpha(config, key)
        common = dict(hf_module=module_name + ".base_layer" * wrapped_after, layer=layer, slot=0, r=r,
                      scaling=alpha / (math.sqrt(r) if config.use_rslora else r))
        if len(shape) == 3:   # [E, out, in]
            fc = "linear_fc1" if pname == "gate_up_proj" else "linear_fc2"
            mapping = _mapping(bridge, layer, f"mlp.experts.{fc}.weight")
            targets.append(Target(mapping=mapping, kind="experts", in_features=shape[2], out_features=shape[1],
                                  num_experts=shape[0], slot_name=pname, factors_swapped=swapped,
                                  module_path="decoder.layers.{layer}.mlp.experts", **common))
        else:                 # the router [E, H]
            mapping = _mapping(bridge, layer, "mlp.router.weight")
            targets.append(Target(mapping=mapping, kind="router", in_features=shape[1], out_features=shape[0],
                                  slot_name="router", **common))
    return targets


def refuse_own_forward_linears(refused: list[str], modules: dict) -> None:
    """Raise for a matched ``nn.Linear`` subclass whose forward returns something else than a tensor (Llama 4's
    router: routing scores and logits; tried on the meta skeleton): PEFT's LoRA layer adds its term to what the module
    returns and fails there."""
    import torch
    from torch import nn

    def returns_more(m: nn.Module) -> bool:
        if type(m).forward is nn.Linear.forward:
            return False
        try:
            return not isinstance(m(torch.empty(1, m.in_features, device="meta")), torch.Tensor)
        except RuntimeError:  # NOTE: a forward of other input shapes (DeepSeek-V4's grouped o_a_proj): refused by name
            return False

    own = [n for n in refused if isinstance(modules[n], nn.Linear) and returns_more(modules[n])]
    if own:
        cls, leaf = type(modules[own[0]]).__name__, own[0].rsplit(".", 1)[-1]
        param = ".".join(own[0].split(".")[-2:]) + ".weight"
        raise LoraConfigError(f"target_modules match {own[:4]}{' ...' if len(own) > 4 else ''} ({cls}: an nn.Linear "
                              "whose forward returns more than its output), which PEFT's LoRA layer cannot wrap (its "
                              f"forward fails there); adapt its weight as a parameter, target_parameters=['{param}'], "
                              f"and leave the module out: exclude_modules=['{leaf}'] (with 'all-linear') or a "
                              "target_modules list without it.")


def _mapping(bridge, layer: int, suffix: str):
    for m in bridge.mappings_for_layer(layer):
        if m.megatron.endswith(suffix):
            return m
    raise LoraConfigError(f"{bridge.architectures[0]} layer {layer} has no megatron tensor '*.{suffix}'.")


def as_peft_rewrites(config, skeleton, bridge):
    """A copy of ``config`` as PEFT rewrites it for ``skeleton``'s architecture (MoE models on transformers 5; any
    other model keeps it as it is)."""
    import copy

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a PEFT without the rewrite adapts modules by name only
        return config
    rewritten = copy.deepcopy(config)
    try:
        convert_peft_config_for_transformers(rewritten, model=skeleton, conversions=None)
    except ValueError as err:
        raise LoraConfigError(f"target_modules={config.target_modules!r} on {bridge.architectures[0]}: PEFT "
                              f"refuses it ({err}).") from err
    for name in ("target_modules", "target_parameters"):
        if isinstance(getattr(rewritten, name), (set, frozenset)):
            setattr(rewritten, name, sorted(getattr(rewritten, name)))
    return rewritten
