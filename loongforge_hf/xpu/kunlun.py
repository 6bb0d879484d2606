"""Kunlun XPUs, following Kunlun's plugin convention for megatron-core.

Kunlun ships ``torch_xmlir`` (the torch device plugin) and ``xpu_plugin`` (megatron-core adaptations). The plugin is
switched on by ``XMLIR_MEGATRON_CORE_XPU_PLUGIN=1`` before megatron-core is imported and installed with
``xpu_plugin.init_megatron_core_xpu_plugin()``; the collective backend is the platform's (``torch_xmlir`` registers
it and names it ``xccl``; ``LOONGFORGE_KUNLUN_DIST_BACKEND`` overrides the name).
"""

from __future__ import annotations

import importlib
import os

import torch

from loongforge_hf.xpu.registry import Backend


class KunlunBackend(Backend):
    name = "kunlun"

    def __init__(self) -> None:
        self.dist_backend = os.environ.get("LOONGFORGE_KUNLUN_DIST_BACKEND", "xccl")
        self._done = False

    def setup(self) -> None:
        if self._done:
            return
        os.environ.setdefault("XMLIR_MEGATRON_CORE_XPU_PLUGIN", "1")
        importlib.import_module("torch_xmlir")
        plugin = importlib.import_module("xpu_plugin")
        plugin.init_megatron_core_xpu_plugin()
        self._done = True

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("xpu", torch.xpu.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.xpu.set_device(local_rank % torch.xpu.device_count())

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def device_count(self) -> int:
        return torch.xpu.device_count()
