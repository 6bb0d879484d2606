"""HF <-> megatron-core bridges: one small declaration per architecture, shared machinery beside them."""

from loongforge_hf.bridges import llama, mistral, qwen2, qwen3  # noqa: F401 - registration
from loongforge_hf.bridges.config_map import UnsupportedConfigError
from loongforge_hf.bridges.registry import (UnsupportedArchitectureError, get_bridge, register_bridge,
                                            supported_architectures)

__all__ = ["UnsupportedArchitectureError", "UnsupportedConfigError", "get_bridge", "register_bridge",
           "supported_architectures"]
