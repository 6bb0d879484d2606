"""Device backends: the only place that knows a device's name.

Choices made here:
- Backends self-register (name, availability check, module path); ``LOONGFORGE_DEVICE`` picks one explicitly.
- An explicit choice that cannot work raises and names what is missing; the automatic choice is cuda when
  available, otherwise cpu.
- A backend owns the patches megatron-core needs on its device; they are applied once, in ``Backend.setup()``.
"""

from loongforge_hf.xpu.registry import Backend, available_backends, get_backend, register_backend, stream_capturing

__all__ = ["Backend", "available_backends", "get_backend", "register_backend", "stream_capturing"]
