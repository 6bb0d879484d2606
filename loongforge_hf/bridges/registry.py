"""Which bridge serves which HF architecture. Bridges register themselves when ``loongforge_hf.bridges`` imports."""

from __future__ import annotations

from typing import Callable


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no bridge."""


_BRIDGES: dict[str, type] = {}


def register_bridge(*architectures: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        for arch in architectures:
            _BRIDGES[arch] = cls
        cls.architectures = tuple(architectures)
        return cls
    return deco


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
    for arch in archs:
        if arch in _BRIDGES:
            return _BRIDGES[arch](hf_config)
    from loongforge_hf.bridges.qwen2_5_vl import image_text_architectures

    image_text = [arch for arch in archs if arch in image_text_architectures()]
    if image_text:
        raise UnsupportedArchitectureError(f"{image_text[0]} is an image-text model: load it with "
                                           "lf.AutoModelForImageTextToText.from_pretrained(...).")
    named = ", ".join(archs) if archs else f"model_type={getattr(hf_config, 'model_type', None)!r}"
    raise UnsupportedArchitectureError(
        f"No loongforge-hf bridge for {named}. Supported architectures: {', '.join(supported_architectures())}.")
