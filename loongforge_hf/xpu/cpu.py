"""CPU processes over gloo: megatron-core on a laptop or a CI machine without a GPU.

megatron-core 0.16 assumes CUDA in a handful of places. Each patch below names the upstream line it stands in for
(checked against megatron-core 0.16.1) and changes nothing else; ``tests/xpu/test_cpu_backend.py`` covers each one
and the TP / PP / VPP / EP / CP smoke tests exercise them together.

Choices:
- ``torch.cuda.current_device()`` answers ``torch.device("cpu")``. megatron-core uses it ~175 times as "the
  device of this rank" (rotary embeddings, schedules, p2p buffers, MoE dispatch); one answer covers them all.
  Applied only when CUDA is unavailable, so a GPU in the same process is never affected.
- The model-parallel RNG tracker forks the CPU generator instead of the CUDA one.
- Literal ``device="cuda"`` tensors (default causal mask, schedules' token counters) are rebuilt on the CPU.
- ``torch.cuda.Stream`` / events used by the MoE all-to-all dispatcher become no-op stand-ins: CPU work is
  synchronous, so there is nothing to overlap or wait for.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from loongforge_hf.xpu.common import apply_without_te_fixes
from loongforge_hf.xpu.registry import Backend

MEGATRON_CORE_CHECKED = "0.16.1"
_PATCHED = False


class CpuBackend(Backend):
    name = "cpu"
    dist_backend = "gloo"

    def setup(self) -> None:
        apply_megatron_patches()
        # NOTE: a tiny model on 2 cores runs faster with one intra-op thread per process when several ranks share them.
        if "OMP_NUM_THREADS" not in os.environ and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
            torch.set_num_threads(1)

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


class _NoopStream:
    """Stands in for ``torch.cuda.Stream``: CPU kernels run in program order, so waits and records are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _NoopEvent()

    def synchronize(self) -> None:
        pass


class _NoopEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _make_cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's RNG tracker with the CPU generator in place of the CUDA one.

        Stands in for ``CudaRNGStatesTracker.add`` / ``.fork`` (megatron/core/tensor_parallel/random.py), which call
        ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed``.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig = self.states_[orig_name]
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def apply_megatron_patches() -> None:
    """Apply the CPU patches once per process."""
    global _PATCHED
    if _PATCHED:
        return
    if not torch.cuda.is_available():
        # Stands in for every `torch.cuda.current_device()` in megatron-core 0.16.1, e.g.
        # models/common/embeddings/rotary_pos_embedding.py:162 `self.inv_freq.to(device=torch.cuda.current_device())`.
        torch.cuda.current_device = _cpu_current_device
        # transformer/moe/token_dispatcher.py and pipeline_parallel/utils.py:334 create side streams/events.
        torch.cuda.Stream = _NoopStream
        torch.cuda.Event = _NoopEvent
        torch.cuda.current_stream = lambda *a, **k: _NoopStream()
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.synchronize = lambda *a, **k: None

    _patch_rng_tracker()
    _patch_cuda_literals()
    _patch_moe_split_sizes()
    _patch_tied_embedding_sync()
    apply_without_te_fixes()
    _PATCHED = True


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls = _make_cpu_rng_tracker_class()
    original = mrandom.initialize_rng_tracker

    # Stands in for tensor_parallel/random.py:initialize_rng_tracker, which builds a CudaRNGStatesTracker.
    @functools.wraps(original)
    def initialize_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                               use_cudagraphable_rng=False, force_reset=False):
        if force_reset:
            mrandom._CUDA_RNG_STATE_TRACKER = None
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        if mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            return
        mrandom._CUDA_RNG_STATE_TRACKER = tracker_cls()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    # `model_parallel_cuda_manual_seed` (random.py:378) seeds CUDA before adding states.
    if not torch.cuda.is_available():
        torch.cuda.manual_seed = lambda seed: None
        torch.cuda.manual_seed_all = lambda seed: None


def _patch_cuda_literals() -> None:
    from megatron.core.transformer import utils as tutils

    # Stands in for transformer/utils.py:35 `torch.ones(sq, sq, device="cuda")` in get_default_causal_mask.
    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    # Stands in for transformer/utils.py:40 `torch.ones(sq, skv, dtype=torch.bool, device="cuda")`.
    def get_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    from megatron.core.fusions import fused_softmax

    # fusions/fused_softmax.py:8 imports both helpers by name, so its module globals are replaced as well.
    for module in (tutils, fused_softmax):
        module.get_default_causal_mask = get_default_causal_mask
        module.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    _patch_torch_in_module("megatron.core.pipeline_parallel.schedules")


def _patch_moe_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    # Stands in for transformer/moe/moe_utils.py:1093 `if torch.is_tensor(tensor) and tensor.is_cuda:` as used by
    # token_dispatcher.py:879-886: on CPU the split sizes stayed tensors, which all_to_all_single rejects.
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_tied_embedding_sync() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_loongforge_cpu", False):
        return

    # Stands in for models/common/language_module/language_module.py:244 `weight.data = weight.data.cuda()`, run when
    # tied embeddings span pipeline stages: on CPU the tensor stays where it is.
    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = saved

    setup_embeddings_and_output_layer._loongforge_cpu = True
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


class _TorchWithCpuDefault:
    """A view of the ``torch`` module whose ``zeros`` / ``ones`` / ``tensor`` / ``empty`` turn ``device="cuda"``
    into the CPU. Installed as the module-global ``torch`` of a megatron module that writes such literals."""

    _FACTORIES = ("zeros", "ones", "tensor", "empty", "full", "arange")

    def __getattr__(self, item):
        attr = getattr(torch, item)
        if item in self._FACTORIES:
            @functools.wraps(attr)
            def factory(*args, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)
            return factory
        return attr


def _patch_torch_in_module(module_name: str) -> None:
    import importlib

    module = importlib.import_module(module_name)
    # Stands in for pipeline_parallel/schedules.py:596, 983, 2138
    # `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`.
    module.torch = _TorchWithCpuDefault()
