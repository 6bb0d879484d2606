"""NVIDIA GPUs through CUDA and NCCL: megatron-core's native target; only the fixes for a missing Transformer Engine."""

from __future__ import annotations

import torch

from loongforge_hf.xpu.registry import Backend


class CudaBackend(Backend):
    name = "cuda"
    dist_backend = "nccl"

    def setup(self) -> None:
        from loongforge_hf.xpu.common import apply_without_te_fixes

        apply_without_te_fixes()

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def memory_per_device(self) -> float:
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        name = torch.cuda.get_device_name()
        for key, (bf16, fp32) in _PEAKS.items():
            if key in name:
                return bf16 if dtype in (torch.bfloat16, torch.float16) else fp32
        return None


# Dense (no sparsity) tensor-core peaks from NVIDIA's data sheets, FLOP/s: (bf16/fp16, tf32).
_PEAKS = {"H200": (989e12, 494e12), "H100": (989e12, 494e12), "A100": (312e12, 156e12), "B200": (2250e12, 1100e12)}
