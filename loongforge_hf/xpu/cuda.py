"""NVIDIA GPUs through CUDA and NCCL: megatron-core's native target; only the fixes for a missing Transformer Engine."""

from __future__ import annotations

import functools

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

    def device_name(self, device: torch.device | None = None) -> str:
        return torch.cuda.get_device_name(device)

    def compute_capability(self, device: torch.device | None = None) -> tuple[int, int] | None:
        return tuple(torch.cuda.get_device_capability(device))

    def multiprocessor_count(self, device: torch.device | None = None) -> int:
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        return _sm_count(index)

    supports_graphs = True

    def run_before_capture(self, run):
        """On a side stream, as CUDA graph captures want their warm-up."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = run()
        current.wait_stream(side)
        return out

    @staticmethod
    def stream_capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()

    def capture(self, run):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recorded = run()
        return graph.replay, recorded

    def time_ms(self, fn, reps: int) -> float:
        """Device time between two CUDA events around ``reps`` calls (no host synchronisation inside)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        name = torch.cuda.get_device_name()
        for key, (bf16, fp32) in _PEAKS.items():
            if key in name:
                return bf16 if dtype in (torch.bfloat16, torch.float16) else fp32
        return None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Dense (no sparsity) tensor-core peaks from NVIDIA's data sheets, FLOP/s: (bf16/fp16, tf32).
_PEAKS = {"H200": (989e12, 494e12), "H100": (989e12, 494e12), "A100": (312e12, 156e12), "B200": (2250e12, 1100e12)}
