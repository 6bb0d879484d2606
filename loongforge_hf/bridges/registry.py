"""Which bridge serves which HF architecture. Bridges register themselves when ``loongforge_hf.bridges`` imports."""

from __future__ import annotations

from typing import Callable


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no bridge."""


_BRIDGES: dict[str, type] = {}
_BY_MODEL_TYPE: dict[str, type] = {}
_REFUSED: dict[str, str] = {}  # NOTE: architecture -> why it has no bridge


def register_bridge(*architectures: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        for arch in architectures:
            _BRIDGES[arch] = cls
        cls.architectures = tuple(architectures)
        return cls
    return deco


def register_model_type(*model_types: str) -> Callable[[type], type]:
    """A bridge for configs of ``model_types`` whatever architecture they name: transformers loads some with another
    family's class and writes that class's name on save (EXAONE 3: ``LlamaForCausalLM``, its own tensor names)."""
    def deco(cls: type) -> type:
        for model_type in model_types:
            _BY_MODEL_TYPE[model_type] = cls
        return cls
    return deco


def refuse_architectures(reason: str, *architectures: str) -> None:
    """Architectures without a bridge for ``reason`` (a new kind of layer megatron cannot run exactly): ``get_bridge``
    names it beside what is supported."""
    for arch in architectures:
        _REFUSED[arch] = reason


def supported_architectures() -> list[str]:
    return sorted(_BRIDGES)


def loads_as_causal_lm(hf_config) -> bool:
    """Whether transformers' ``AutoModelForCausalLM`` loads this image-text checkpoint (Gemma 3's as its image-text
    class, Qwen3.5's as its text model), so ``lf.AutoModelForCausalLM`` loads it, as the image-text model."""
    from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, image_text_architectures

    image_text_architectures()
    return any(getattr(VL_BRIDGES.get(arch), "causal_lm_auto", False)
               for arch in getattr(hf_config, "architectures", None) or [])


def get_bridge(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    if getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[hf_config.model_type](hf_config)
    for arch in archs:
        if arch in _BRIDGES:
            return _BRIDGES[arch](hf_config)
    from loongforge_hf.bridges.qwen2_5_vl import image_text_architectures

    image_text = [arch for arch in archs if arch in image_text_architectures()]
    if image_text:
        raise UnsupportedArchitectureError(f"{image_text[0]} is an image-text model: load it with "
                                           "lf.AutoModelForImageTextToText.from_pretrained(...).")
    refused = [arch for arch in archs if arch in _REFUSED]
    if refused:
        raise UnsupportedArchitectureError(f"{refused[0]} is not supported: {_REFUSED[refused[0]]}. Supported "
                                           f"architectures: {', '.join(supported_architectures())}.")
    named = ", ".join(archs) if archs else f"model_type={getattr(hf_config, 'model_type', None)!r}"
    raise UnsupportedArchitectureError(
        f"No loongforge-hf bridge for {named}. Supported architectures: {', '.join(supported_architectures())}.")
