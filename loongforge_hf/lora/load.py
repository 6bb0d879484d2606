"""Loading a PEFT adapter folder onto a loongforge model, as ``peft.PeftModel.from_pretrained(model, dir)`` does on a
transformers model.

Choices:
- The folder is what PEFT (or ``LoongLoraModelForCausalLM.save_pretrained``) writes: ``adapter_config.json`` (a
  ``LoraConfig``) and ``adapter_model.safetensors`` with PEFT's names (``base_model.model.<HF module>.lora_A.weight``
  / ``lora_B``, ``.lora_magnitude_vector`` with DoRA, ``base_model.model.<HF parameter>`` for ``modules_to_save``)
  at HF shapes. A pickle
  ``adapter_model.bin`` is read only with ``allow_pickle=True``, through ``torch.load(weights_only=True)``.
- The adapters are attached as ``get_peft_model`` attaches them (same plan, same slicing over TP, PP and fused
  layers), with the file's A and B instead of freshly drawn ones; ``modules_to_save`` tensors go through the base
  bridge's own mapping (the one its checkpoint loads with) into their megatron parameters.
- Names are the installed transformers' module names, as PEFT writes them; an adapter written against an older
  transformers (other module names) is renamed as PEFT renames it on loading (``_current_names``).
- Every tensor the config implies is checked (present, HF shape, floating point) before anything changes, with one
  error listing the problems. The checks read only the folder, which every rank reads alike, so a bad folder fails
  on every rank, before any collective.
- An adapter whose config says ``init_lora_weights="pissa"`` / ``"pissa_niter_<n>"`` / ``"olora"`` (as PEFT's plain
  ``save_pretrained`` writes it) loads as PEFT loads it: onto the original base model, whose weights are decomposed
  again (``init.decomposed_initial_weights``; ``pissa_niter_<n>`` draws afresh, as PEFT) and left as the residual,
  the file's A and B then taking the adapters' place. To load onto a saved residual model, set the config's
  ``init_lora_weights`` to True first, as PEFT's PiSSA example does. Collective then (every rank loads alike).
- ``is_trainable=False`` (PEFT's default) leaves every parameter frozen (evaluation, generation of logits);
  ``is_trainable=True`` leaves the adapters and ``modules_to_save`` trainable, to train on from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from loongforge_hf.bridges.checkpoint_files import CheckpointError
from loongforge_hf.lora.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from loongforge_hf.lora.plan import LoraConfigError

ADAPTER_PICKLE = "adapter_model.bin"
PREFIX = "base_model.model."


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """A local folder holding a PEFT adapter and no model of its own (transformers loads its base model then)."""
    folder = Path(path)
    return (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file()


def adapter_base_model(adapter_dir: str | os.PathLike) -> str:
    """The base model an adapter folder names (``base_model_name_or_path`` of its adapter_config.json)."""
    config_file = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{config_file}: not a readable adapter config ({err}).") from err
    if not base:
        raise CheckpointError(f"{config_file} names no base model (base_model_name_or_path): load the base model "
                              "with from_pretrained, then loongforge_hf.lora.load_adapter(model, adapter_dir).")
    return base


def read_adapter(adapter_dir: str | os.PathLike, *, allow_pickle: bool = False):
    """(``peft.LoraConfig``, {PEFT tensor name: tensor}) of an adapter folder; clear errors for what is missing."""
    from peft import LoraConfig

    folder = Path(adapter_dir)
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise CheckpointError(f"{folder} is not a PEFT adapter folder: {ADAPTER_CONFIG} is missing.")
    try:
        data = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{config_file}: not a readable JSON file ({err}).") from err
    if not isinstance(data, dict) or data.get("peft_type", "LORA") != "LORA":
        kind = data.get("peft_type") if isinstance(data, dict) else type(data).__name__
        raise LoraConfigError(f"{config_file}: loongforge-hf loads LoRA adapters; this one is {kind!r}.")
    config = LoraConfig.from_pretrained(str(folder))
    weights, pickled = folder / ADAPTER_WEIGHTS, folder / ADAPTER_PICKLE
    if weights.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return config, load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{weights}: corrupt or truncated safetensors file ({err}).") from err
    if pickled.is_file():
        if not allow_pickle:
            raise CheckpointError(f"{pickled} is a pickle file, which can run code when loaded; pass "
                                  "allow_pickle=True to read it (with torch.load(weights_only=True)), or save the "
                                  "adapter again with safetensors.")
        try:
            state = torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure means the file cannot be read safely
            raise CheckpointError(f"{pickled}: cannot be read with torch.load(weights_only=True) ({err}).") from err
        return config, state
    raise CheckpointError(f"{folder} has {ADAPTER_CONFIG} but no adapter weights ({ADAPTER_WEIGHTS} or "
                          f"{ADAPTER_PICKLE}).")


class _AdapterReader:
    """The ``modules_to_save`` tensors of an adapter file under their HF names, read like a checkpoint (the bridge
    mappings' ``load`` reads through this)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[PREFIX + name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[PREFIX + name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[PREFIX + name].dtype

    def get_slice(self, name: str, *, dim: int, start: int, stop: int, out=None) -> torch.Tensor:
        part = self.tensors[PREFIX + name].narrow(dim, start, stop - start)
        return part if out is None else out.copy_(part)


def _check_tensors(folder: Path, model, plan, tensors: dict[str, torch.Tensor]):
    """(the (A, B) of every target in float32, the trainable token rows or None, {HF name: PEFT name} of the resized
    embedding layers the file carries, DoRA's magnitudes by HF module or None); one error listing every missing or
    misshapen tensor."""
    from loongforge_hf.lora.tokens import DELTA, peft_names, tied_head_delta

    expected = {}
    for t in plan.targets:
        expected[f"{PREFIX}{t.hf_module}.{t.file_factors[0]}"] = t.a_shape
        expected[f"{PREFIX}{t.hf_module}.{t.file_factors[1]}"] = t.b_shape
        if plan.config.use_dora:
            expected[f"{PREFIX}{t.hf_module}.lora_magnitude_vector"] = (t.out_features,)
    for s in plan.saved:
        expected[PREFIX + s.hf_name] = tuple(plan.hf_shapes[s.hf_name])
    delta = f"{PREFIX}{plan.embedding_name}.{DELTA}"
    if plan.token_indices:
        expected[delta] = (len(plan.token_indices), model.config.hidden_size)
    # NOTE: PEFT writes the embedding layers whole when the vocabulary was resized: optional, but at this size
    vocabulary = {hf: name for hf, name in peft_names(plan, model.bridge.tied).items() if name in tensors}
    for hf, name in vocabulary.items():
        expected.setdefault(name, tuple(plan.hf_shapes.get(hf, plan.hf_shapes[f"{plan.embedding_name}.weight"])))
    head_delta = tied_head_delta(plan, model.bridge.tied, True)
    if head_delta in tensors:  # NOTE: a tied LM head's copy of the trained rows: the same tensor
        expected[head_delta] = (len(plan.token_indices), model.config.hidden_size)
    problems = []
    for name, shape in expected.items():
        found = tensors.get(name)
        if found is None:
            problems.append(f"{name!r}: missing (expected shape {shape})")
        elif tuple(found.shape) != shape:  # NOTE: a carried embedding of another size: _check_vocabulary, first
            problems.append(f"{name!r}: expected shape {shape}, found {tuple(found.shape)}")
        elif not found.is_floating_point():
            problems.append(f"{name!r}: stored as {found.dtype}, expected floating point")
    unused = sorted(set(tensors) - set(expected))
    if unused:
        problems.append(f"tensors its adapter_config.json does not describe: {unused[:5]}"
                        + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))
    if problems:
        shown = "\n  ".join(problems[:20])
        raise CheckpointError(f"The adapter at {folder} does not match this model and its adapter_config.json "
                              f"({len(problems)} problem(s)):\n  {shown}")
    pairs = [tuple(tensors[f"{PREFIX}{t.hf_module}.{f}"].float() for f in t.file_factors) for t in plan.targets]
    magnitudes = {t.hf_module: tensors[f"{PREFIX}{t.hf_module}.lora_magnitude_vector"] for t in plan.targets} \
        if plan.config.use_dora else None
    return pairs, tensors[delta] if plan.token_indices else None, vocabulary, magnitudes


_CARRIED_EMBEDDING = ("embed_tokens.weight", "embed_tokens.token_adapter.base_layer.weight",
                      "embed_tokens.base_layer.weight")


def carried_vocabulary(adapter_dir: str | os.PathLike) -> int | None:
    """The vocabulary size of the embedding an adapter file carries (saved from a model whose vocabulary was resized,
    as PEFT saves it), read from the safetensors header only; None when it carries none (or is a pickle file)."""
    from safetensors import safe_open

    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights.is_file():
        return None
    try:
        with safe_open(str(weights), framework="pt") as f:
            name = next((n for n in f.keys() if n.endswith(_CARRIED_EMBEDDING)), None)
            return None if name is None else f.get_slice(name).get_shape()[0]
    except Exception:  # noqa: BLE001 - an unreadable file is reported by read_adapter, with its reason
        return None


def _check_vocabulary(folder: Path, model, tensors: dict[str, torch.Tensor]) -> None:
    """An adapter saved from a model with a resized vocabulary carries the embedding (PEFT's files and ours): this
    model must have been resized alike first, as with PEFT."""
    rows = next((t.shape[0] for n, t in tensors.items() if t.dim() == 2 and n.endswith(_CARRIED_EMBEDDING)), None)
    if rows is not None and rows != model.config.vocab_size:
        raise CheckpointError(f"The adapter at {folder} was saved from a model with a vocabulary of {rows} tokens, "
                              f"this model has {model.config.vocab_size}: resize it first, "
                              f"model.resize_token_embeddings({rows}), as with PEFT.")


def _current_names(model, plan, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the installed transformers' module names: as they are when they hold every target's
    factors, else renamed as PEFT renames an adapter written against an older transformers when it loads one
    (``convert_peft_adapter_state_dict_for_transformers`` on the module tree: e.g. Gemma 3's transformers 4 names
    ``model.vision_tower.vision_model.*``, ``language_model.model.*``)."""
    if all(f"{PREFIX}{t.hf_module}.{t.file_factors[0]}" in tensors for t in plan.targets):
        return tensors
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
    except ImportError:  # a PEFT without the conversion loads names as they are
        return tensors
    from loongforge_hf.lora.plan import _hf_skeleton
    from loongforge_hf.lora.vision import LoongModelForImageTextToText

    skeleton = _hf_skeleton(model.bridge.hf_config, image_text=isinstance(model, LoongModelForImageTextToText))
    return convert_peft_adapter_state_dict_for_transformers(
        model=skeleton, peft_config=plan.config, adapter_state_dict=dict(tensors))


def load_adapter(model, adapter_dir: str | os.PathLike, *, is_trainable: bool = False, allow_pickle: bool = False):
    """Attach the PEFT adapter saved in ``adapter_dir`` to ``model`` (a ``LoongModelForCausalLM``), in place; returns
    the ``LoongLoraModelForCausalLM`` it becomes. Collective only in what the model's layers share (nothing here;
    a PiSSA / OLoRA adapter's decomposition)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.builder import layer_owners
    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora.export import vocabulary_tensors
    from loongforge_hf.lora.init import decomposed_initial_weights, is_decomposition
    from loongforge_hf.lora.model import attach_lora, check_stages_train, megatron_params_of, plan_for
    from loongforge_hf.lora.vision import text_bridge

    folder = Path(adapter_dir)
    config, tensors = read_adapter(folder, allow_pickle=allow_pickle)
    config.inference_mode = not is_trainable
    _check_vocabulary(folder, model, tensors)
    plan = plan_for(model, config)
    tensors = _current_names(model, plan, tensors)
    owners = layer_owners(model.megatron.config, model.parallel)
    if is_trainable:
        check_stages_train(model, plan, owners)
    initial, token_rows, vocabulary, magnitudes = _check_tensors(folder, model, plan, tensors)
    # NOTE: the resized embedding layers (base weights, frozen) go in through the bridge's mappings as the
    # modules_to_save do; a tied model's LM head is its embedding
    resized = vocabulary_tensors(model, set(vocabulary) - {s.hf_name for s in plan.saved})
    residual = None
    if is_decomposition(config.init_lora_weights):  # NOTE: PiSSA / OLoRA: PEFT decomposes the base weights again
        residual = decomposed_initial_weights(model, plan.targets, config.init_lora_weights)
    model = attach_lora(model, config, plan, initial, token_rows=None if token_rows is None else token_rows.float(),
                        magnitudes=magnitudes, residual=residual)
    # NOTE: the mappings read checkpoint names, the file has PEFT's (the module tree's: image-text models differ)
    reader = _AdapterReader({**tensors, **{PREFIX + hf: tensors[name] for hf, name in vocabulary.items()},
                             **{PREFIX + s.checkpoint_name: tensors[PREFIX + s.hf_name] for s in plan.saved}})
    ctx = shard_context(text_bridge(model), tp_rank=ps.get_tensor_model_parallel_rank(),
                        tp_size=ps.get_tensor_model_parallel_world_size(), padded_vocab=model.megatron.padded_vocab)
    with torch.no_grad():
        done = set()  # NOTE: StableLM's per-head norms: several saved HF tensors, one megatron tensor
        for saved in [*plan.saved, *resized]:
            for params, name in megatron_params_of(model, saved, owners, ps.get_pipeline_model_parallel_rank()):
                if id(param := params[name]) not in done:
                    param.copy_(saved.mapping.load(reader, ctx, saved.layer).to(param.dtype))
                    done.add(id(param))
    if not is_trainable:
        for p in model.parameters():
            p.requires_grad_(False)
    return model
