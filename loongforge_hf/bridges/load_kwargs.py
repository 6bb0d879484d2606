"""transformers' ``from_pretrained`` keywords beyond those loongforge_hf's own signature names.

Choices:
- Each keyword of transformers' ``PreTrainedModel.from_pretrained`` (read in 5.24) is honoured as there, accepted as
  having no effect here (logged at info level, saying why), or refused with a ``ValueError`` that says what to do
  instead: what would change the model or its training unseen (quantization, offloading, a torch tensor-parallel
  plan, several devices for one process) is refused, never ignored. docs/index.md has the table.
- Any other keyword is a config override, as in transformers: ``AutoConfig.from_pretrained(...,
  return_unused_kwargs=True, **kwargs)`` sets those that name a config attribute, so the bridge builds the model from
  the overridden config, ``model.config`` is it and ``save_pretrained`` writes it. What is left raises ``TypeError``,
  as transformers' model ``__init__`` does. With ``config=`` a config object nothing more is applied to it and every
  leftover raises, as there; ``config=`` a path is loaded (as transformers' model classes do; its Auto classes ignore
  a path).
- Overrides our forward would not honour (``output_attentions``, ``output_hidden_states``, ``return_dict=False``) are
  refused: transformers' models return more by default with them.
- All of it runs before the process group starts, alike on every rank; the one check that depends on the rank (a
  ``device_map`` naming a device index) runs inside the load's ``failing_alike`` block (``check_device``).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_LAYOUT = "pass tensor_parallel_size= / pipeline_parallel_size= (or parallel=) and launch one process per device"
# accepted with any value: they change nothing here (why, for the info log); None: transformers-internal, no log
_NO_EFFECT = {
    "low_cpu_mem_usage": "loading is already shard by shard: each rank reads only its own slices",
    "disable_mmap": "safetensors are read with positioned reads, not through a memory map",
    "ignore_mismatched_sizes": "nothing is re-initialised: a tensor whose shape does not match the config is an error",
    "allow_all_kernels": "hub kernels are not used",
    "offload_state_dict": "transformers ignores it too", "mirror": "transformers ignores it too",
    "from_tf": "transformers ignores it too", "from_flax": "transformers ignores it too",
    "_fast_init": None, "_from_auto": None, "_from_pipeline": None, "_commit_hash": None,
}
# accepted only with the value that changes nothing (the first), refused otherwise (the second says why)
_DEFAULT_ONLY = {
    "quantization_config": (None, "quantized loading is not supported (MXFP4 / FP8 checkpoints are dequantised on "
                                  "load: a config with dequantize=True is accepted); for FP8 training pass "
                                  "fp8='on' (docs/fp8.md)"),
    "tp_plan": (None, f"tensor parallelism is megatron-core's here: {_LAYOUT}"),
    "tp_size": (None, f"tensor parallelism is megatron-core's here: {_LAYOUT}"),
    "distributed_config": (None, f"tensor parallelism is megatron-core's here: {_LAYOUT}"),
    "device_mesh": (None, f"the process groups come from the parallel layout: {_LAYOUT}"),
    "max_memory": (None, f"each process holds its part of the model on its own device: {_LAYOUT}"),
    "offload_folder": (None, "offloading is not supported"),
    "offload_buffers": (False, "offloading is not supported"),
    "state_dict": (None, "weights are read from the checkpoint folder (write one with save_pretrained)"),
    "gguf_file": (None, "GGUF files are not read; safetensors are (pickle weights with allow_pickle=True)"),
    "key_mapping": (None, "tensor names are those of transformers' class for the architecture"),
    "weights_only": (True, "pickle weights are only ever read with torch.load(weights_only=True)"),
    "fusion_config": (None, "the fused modules are megatron-core's; transformers' fusions are not applied"),
    "use_kernels": (False, "hub kernels are not used: the kernels are megatron-core's and loongforge_hf's"),
    "kernel_config": (None, "hub kernels are not used: the kernels are megatron-core's and loongforge_hf's"),
    "adapter_kwargs": (None, "pass the adapter's folder or hub id as the model to load"),
    "adapter_name": ("default", "the adapter is loaded as PEFT's 'default' adapter"),
    "code_revision": (None, "no remote code is run for the model"),
    "proxies": (None, "huggingface_hub 1.x takes no proxies: set HTTPS_PROXY / HTTP_PROXY instead"),
}
# config fields whose override would make transformers' forward return more than ours does
_FORWARD_FIELDS = {"output_attentions": "attention weights are not materialised",
                   "output_hidden_states": "hidden states are not returned",
                   "return_dict": "pass return_dict=False to forward() instead"}
_SPREAD = ("balanced", "balanced_low_0", "sequential")


@dataclass
class LoadOptions:
    """The keywords sorted: those honoured, then ``overrides`` (config attributes, checked by ``load_config``)."""

    hub: dict = field(default_factory=dict)  # subfolder, force_download, tqdm_class: for resolve_checkpoint
    files: dict = field(default_factory=dict)  # variant, use_safetensors: for CheckpointReader
    config: Any = None
    output_loading_info: bool = False
    generation_config: Any = None
    attn_implementation: Any = None
    experts_implementation: Any = None
    device: torch.device | None = None  # the one device a device_map names
    overrides: dict = field(default_factory=dict)


def _dequantizes(quantization_config) -> bool:
    """Whether a ``quantization_config`` asks for what loading does anyway: MXFP4 or FP8 weights dequantised
    (transformers' ``Mxfp4Config(dequantize=True)``, gpt-oss's fine-tuning recipe)."""
    qc = quantization_config
    get = qc.get if isinstance(qc, dict) else (lambda key, default=None: getattr(qc, key, default))
    return get("quant_method") in ("mxfp4", "fp8") and get("dequantize", False) is True


def sort_load_kwargs(kwargs: dict, *, allow_pickle: bool) -> LoadOptions:
    """Sort ``kwargs`` (what ``from_pretrained`` has no parameter for); refuse what cannot be honoured."""
    kwargs = dict(kwargs)
    if kwargs.get("quantization_config") is not None and _dequantizes(kwargs["quantization_config"]):
        logger.info("from_pretrained(quantization_config=%r): MXFP4 / FP8 weights are dequantised on load anyway.",
                    kwargs.pop("quantization_config"))
    refused = {k: why for k, (default, why) in _DEFAULT_ONLY.items()
               if k in kwargs and not _is_default(kwargs.pop(k), default)}
    if refused:
        raise ValueError("from_pretrained: " + "; ".join(f"{k}: {why}" for k, why in refused.items()) + ".")
    for name in [k for k in kwargs if k in _NO_EFFECT]:
        value = kwargs.pop(name)
        if _NO_EFFECT[name]:
            logger.info("from_pretrained(%s=%r) has no effect: %s.", name, value, _NO_EFFECT[name])
    options = LoadOptions(
        hub={k: kwargs.pop(k) for k in ("subfolder", "force_download", "tqdm_class") if k in kwargs},
        files={k: kwargs.pop(k) for k in ("variant", "use_safetensors") if k in kwargs},
        config=kwargs.pop("config", None), output_loading_info=bool(kwargs.pop("output_loading_info", False)),
        generation_config=kwargs.pop("generation_config", None),
        attn_implementation=_implementation("attn_implementation", kwargs.pop("attn_implementation", None)),
        experts_implementation=_implementation("experts_implementation", kwargs.pop("experts_implementation", None)),
        device=single_device(kwargs.pop("device_map", None)))
    if options.files.get("use_safetensors") is False and not allow_pickle:
        raise ValueError("from_pretrained: use_safetensors=False reads pickle weights (pytorch_model.bin), which "
                         "are refused unless allow_pickle=True.")
    bad = {k: _FORWARD_FIELDS[k] for k, v in kwargs.items()
           if k in _FORWARD_FIELDS and (v is False if k == "return_dict" else bool(v))}
    if bad:
        raise ValueError("from_pretrained: " + "; ".join(f"{k}={kwargs[k]!r} is not supported ({why})"
                                                         for k, why in bad.items()) + ".")
    options.overrides = kwargs
    return options


def _is_default(value, default) -> bool:
    if default is None:
        return value is None or (isinstance(value, dict) and not value)
    return isinstance(value, type(default)) and value == default


def _implementation(name: str, value):
    """An ``attn_implementation`` / ``experts_implementation`` transformers knows (a str, or a dict per sub-config);
    it is recorded on the config, as transformers does, and changes nothing here."""
    if value is None:
        return None
    from transformers import modeling_utils as mu

    valid = ["eager", *(mu.ALL_ATTENTION_FUNCTIONS.valid_keys() if name == "attn_implementation" else
                        [*mu.ALL_EXPERTS_FUNCTIONS.keys(), *mu.ALL_FP8_EXPERTS_FUNCTIONS.keys()])]
    given = list(value.values()) if isinstance(value, dict) else [value]
    if any(v is not None and v not in valid for v in given):
        raise ValueError(f"from_pretrained: {name}={value!r} is not supported; transformers' values are {valid} "
                         "(hub kernels are not used).")
    what = "attention" if name == "attn_implementation" else "the experts"
    logger.info("from_pretrained(%s=%r): recorded on model.config as transformers does; %s run(s) on megatron-core "
                "with loongforge_hf's kernels whatever its value (packed sequences are handled alike).",
                name, value, what)
    return value


def single_device(device_map) -> torch.device | None:
    """The one device ``device_map`` names, its index None where transformers takes the local rank's (``"cuda"``);
    None for no map or ``"auto"`` (the layout places the model). Refuses maps over several devices or another kind
    of device than this run's backend's."""
    if device_map is None or isinstance(device_map, str) and device_map == "auto":
        if device_map is not None:
            logger.info("from_pretrained(device_map='auto'): each process holds its part of the model (the parallel "
                        "layout's) on its own device.")
        return None
    if isinstance(device_map, str) and device_map in _SPREAD or isinstance(device_map, dict) \
            and len(set(map(str, device_map.values()))) > 1:
        raise ValueError(f"from_pretrained: device_map={device_map!r} spreads the model over several devices of "
                         f"one process; here each process holds its part on one device: {_LAYOUT}.")
    value = next(iter(device_map.values()), None) if isinstance(device_map, dict) else device_map
    if value == "disk":
        raise ValueError(f"from_pretrained: device_map={device_map!r}: offloading is not supported.")
    from loongforge_hf.xpu import get_backend

    kind = get_backend().device().type
    if isinstance(value, int) and kind == "cpu":  # NOTE: an int is an accelerator's index, as in transformers
        raise ValueError(f"from_pretrained: device_map={device_map!r} places the model on accelerator {value}, but "
                         "this run's devices are 'cpu'; pass device_map=None, 'auto' or 'cpu'.")
    try:
        device = torch.device(kind, value) if isinstance(value, int) else torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"from_pretrained: device_map={device_map!r} names no device ({err}).") from err
    if device.type != kind:
        raise ValueError(f"from_pretrained: device_map={device_map!r} places the model on {device}, but this run's "
                         f"devices are {kind!r} (set by LOONGFORGE_DEVICE or what is installed); pass "
                         "device_map=None or 'auto'.")
    return device


def check_device(device: torch.device | None) -> None:
    """Once this process is bound to its device (rank-dependent: call it where ranks share their outcome)."""
    from loongforge_hf.xpu import get_backend

    mine = get_backend().device()
    if device is not None and device.type != "cpu" and device.index is not None and device.index != mine.index:
        raise ValueError(f"device_map names {device}, but this process (LOCAL_RANK={os.environ.get('LOCAL_RANK', 0)})"
                         f" uses {mine}: pass device_map={{'': local_rank}}, 'auto' or None.")


def load_config(folder: Path, options: LoadOptions, *, trust_remote_code: bool, hub: dict):
    """(the HF config the model is built from, the config ``folder``'s config.json gives where the two may differ,
    else None): the export writes the fields that differ into config.json, as transformers' save_pretrained does).
    ``hub``: resolve_checkpoint's keywords, for ``config=`` a hub id."""
    from transformers import AutoConfig, PretrainedConfig

    from .hub import resolve_checkpoint

    given, overrides = options.config, options.overrides
    if isinstance(given, PretrainedConfig):
        config, unused = copy.deepcopy(given), overrides  # NOTE: as transformers: applied to no config
    else:
        if given is not None and not isinstance(given, (str, os.PathLike)):
            raise TypeError(f"from_pretrained: config= must be a PretrainedConfig, a folder, a file or a hub id, "
                            f"not {type(given).__name__}.")
        source = folder if given is None else given if Path(given).is_file() else resolve_checkpoint(given, **hub)
        config, unused = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code,
                                                    return_unused_kwargs=True, **overrides)
    if unused:
        raise TypeError(f"from_pretrained got unexpected keyword arguments: {sorted(unused)} (neither "
                        f"from_pretrained keywords nor attributes of {type(config).__name__}"
                        + (", and config= was given" if given is not None else "") + ").")
    if overrides:
        logger.info("from_pretrained: config overrides %s.", overrides)
    if given is not None:
        config._name_or_path = str(folder)  # NOTE: as transformers names the model's, not the config's source
    for name in ("attn_implementation", "experts_implementation"):
        if getattr(options, name) is not None:
            setattr(config, f"_{name}", getattr(options, name))
    changed = given is not None or overrides
    on_file = (folder / "config.json").is_file()
    return config, AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code) if changed and on_file \
        else None


def loading_info(reader, bridge) -> dict:
    """transformers' ``output_loading_info``: nothing mismatched (that fails the load here), missing only the
    ``optional_tensors`` the checkpoint lacks that transformers does not ignore (``optional_tensors.py``; any other
    missing tensor fails the load), and the checkpoint tensors the model does not load as ``unexpected_keys``, as
    transformers lists them: DeepSeek's multi-token-prediction layers included, which transformers drops and the
    export here carries through unchanged; those its model class ignores (``_keys_to_ignore_on_load_unexpected``:
    ERNIE 4.5 MoE's ``mtp``) left out, matched as transformers does against the names it renames them to (A.X-K1's
    dense layers' ``post_mlp_layernorm``, ignored as ``mlp.post_mlp_layernorm``). The names listed are the
    checkpoint's own."""
    import re

    import transformers

    from .fp8_checkpoint import dequantizing_reader
    from .optional_tensors import missing_keys

    reader = dequantizing_reader(reader, bridge=bridge)
    names = set(reader.keys()) - set(bridge.expected_hf_shapes())
    archs = getattr(bridge.hf_config, "architectures", None) or [""]
    ignored = getattr(getattr(transformers, archs[0], None), "_keys_to_ignore_on_load_unexpected", None) or ()
    if ignored:
        pattern = re.compile("|".join(f"({p})" for p in ignored))
        renamed = transformers_names(reader.keys(), architecture=archs[0], model_type=bridge.hf_config.model_type)
        names = {n for n in names if pattern.search(renamed[n]) is None}
    return {"missing_keys": missing_keys(reader, bridge), "unexpected_keys": names, "mismatched_keys": set(),
            "error_msgs": []}


def transformers_names(names, *, architecture: str, model_type: str) -> dict[str, str]:
    """{checkpoint name: the name transformers renames it to on load}: the checkpoint conversion mapping of
    ``architecture`` (else of ``model_type``), its renamings then at most one converter, over the names in
    transformers' order (some renamings depend on keys seen before), as ``core_model_loading`` does."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_checkpoint_conversion_mapping(architecture) or get_checkpoint_conversion_mapping(model_type) or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return {n: rename_source_key(n, renamings, converters)[0] for n in sorted(names, key=dot_natural_key)}


def module_tree_names(bridge) -> dict[str, str]:
    """{transformers' module-tree name: the checkpoint's} for every tensor the bridge reads (computed once): its
    checkpoint names renamed by the ``WeightRenaming`` entries of transformers' conversion mapping for the model type,
    what ``from_pretrained`` does to them (LoRA's planner: ``checkpoint_name`` of DeepSeek-V4, HY-V4, A.X-K2, Hy3)."""
    table = bridge.__dict__.get("_lora_names")
    if table is None:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        renamings = [r for r in get_checkpoint_conversion_mapping(bridge.hf_config.model_type) or []
                     if type(r) is WeightRenaming]
        table = {apply_renamings(name, renamings): name for name in bridge.expected_hf_shapes()}
        bridge.__dict__["_lora_names"] = table
    return table


def finish_load(model, options: LoadOptions, info: dict | None):
    """The model, its ``generation_config`` replaced by the one given (as transformers copies it); with its loading
    info when asked."""
    if options.generation_config is not None:
        model.generation_config = copy.deepcopy(options.generation_config)
    return (model, info) if options.output_loading_info else model
