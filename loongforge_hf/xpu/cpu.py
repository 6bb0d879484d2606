"""CPU processes over gloo: megatron-core on a laptop or a CI machine without a GPU.

megatron-core 0.16 assumes CUDA in a handful of places. Each patch below names the upstream line it stands in for
(checked against megatron-core 0.16.1) and changes nothing else; the TP / PP / VPP / EP / CP smoke tests in
``tests/xpu/test_megatron_smoke.py`` and every multi-rank test exercise them.

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
    _patch_checkpoint_rng_state()
    _patch_cuda_literals()
    _patch_moe_split_sizes()
    _patch_uneven_all_gather()
    _patch_tied_embedding_sync()
    _patch_cuda_spelling()
    _patch_rope_cp_slice()
    apply_without_te_fixes()
    _PATCHED = True


def _patch_checkpoint_rng_state() -> None:
    """megatron's activation recompute (``tensor_parallel.random.CheckpointFunction``) saves and restores the device
    generator through ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (tensor_parallel/random.py:41 and :72, read
    by ``_get_all_rng_states`` / ``_set_all_rng_states`` at :444), which call ``torch.cuda.random.get_rng_state`` and
    ``_C._cuda_setRNGState``. On CPU the device generator is the CPU one: get and set its state instead (set twice on
    restore, to the same saved state, so the recomputed forward draws what the first one drew)."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


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
    for module_name in _CUDA_LITERAL_MODULES:
        _patch_torch_in_module(module_name)


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


def _patch_uneven_all_gather() -> None:
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim
    if getattr(original, "_loongforge_cpu", False):
        return

    # Stands in for tensor_parallel/mappings.py:148-150 `torch.distributed.all_gather(output_tensor_list, input_)` with
    # `output_split_sizes` (the MoE alltoall dispatcher gathers tokens over TP, a different count per rank): gloo's
    # all_gather needs equal sizes, so each rank's rows are padded to the largest count and the padding dropped.
    @functools.wraps(original)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = output_split_sizes
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1 \
                or torch.distributed.get_backend(group) != "gloo":
            return original(input_, group, output_split_sizes, use_global_buffer)
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    _gather_along_first_dim._loongforge_cpu = True
    mappings._gather_along_first_dim = _gather_along_first_dim


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


def _patch_rope_cp_slice() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    if getattr(rope_utils.get_pos_emb_on_this_cp_rank, "_loongforge_cpu", False):
        return

    # Stands in for models/common/embeddings/rope_utils.py:62-64, which builds the chunk index in pinned memory and
    # moves it with `.cuda()`; the CP load-balanced chunk selection (chunks r and 2*cp-1-r) is unchanged.
    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    get_pos_emb_on_this_cp_rank._loongforge_cpu = True
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def _literal_on_cpu(device):
    """The device a factory call of a patched megatron module gets: the CPU for a ``"cuda"`` string (the literals
    listed in ``_CUDA_LITERAL_MODULES``), and for any CUDA device where CUDA is unavailable; otherwise ``device``
    itself. NOTE: a ``torch.device`` taken from a tensor (``device=routing_map.device``) is kept where CUDA works:
    the patches stay for the whole process, and a CUDA tensor handed to megatron in it must stay on its GPU."""
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return device


class _TorchWithCpuDefault:
    """A view of the ``torch`` module whose ``zeros`` / ``ones`` / ``tensor`` / ``empty`` / ... turn a literal
    ``device="cuda"`` into the CPU (``_literal_on_cpu``). Installed as the module-global ``torch`` of a megatron
    module that writes such literals."""

    _FACTORIES = ("zeros", "ones", "tensor", "empty", "full", "arange", "empty_like", "zeros_like")

    def __getattr__(self, item):
        attr = getattr(torch, item)
        if item in self._FACTORIES:
            @functools.wraps(attr)
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _literal_on_cpu(kwargs["device"])
                return attr(*args, **kwargs)
            return factory
        return attr


# Modules of megatron-core 0.16.1 that create tensors with a literal `device="cuda"`, and the lines.
_CUDA_LITERAL_MODULES = {
    "megatron.core.pipeline_parallel.schedules": "596, 983, 2138 `torch.zeros([], dtype=torch.int, device=\"cuda\")`",
    "megatron.core.optimizer.optimizer": "473-485, 907 found_inf / _dummy_overflow_buf / _scale tensors",
    "megatron.core.optimizer.grad_scaler": "15, 88-94 scale tensors",
    "megatron.core.optimizer.clip_grads": "90, 103, 115, 174, 207 norm and counter tensors",
    "megatron.core.utils": "1207 local_multi_tensor_l2_norm result",
    "megatron.core.distributed.param_and_grad_buffer": "768 warm-up tensor",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "204 verification tensor",
    "megatron.core.dist_checkpointing.exchange_utils": "104-110, 326 exchange buffers",
    "megatron.core.tensor_parallel.data": "37 sizes tensor",
    "megatron.core.transformer.moe.moe_utils": "998 aux-loss tracker",
}


def _patch_torch_in_module(module_name: str) -> None:
    import importlib

    module = importlib.import_module(module_name)
    module.torch = _TorchWithCpuDefault()


class _CudaSpelling:
    """While active, CPU tensors answer ``.type()`` with CUDA names and ``.cuda()`` returns the tensor itself.

    Used only around megatron functions that check ``param.type() == 'torch.cuda.FloatTensor'`` or move state with
    ``.cuda()`` (listed in ``_CUDA_SPELLING_FUNCTIONS``), never process-wide.
    """

    def __enter__(self):
        self._type, self._cuda = torch.Tensor.type, torch.Tensor.cuda
        real_type = self._type

        def type_(t, dtype=None, non_blocking=False, **kw):
            if dtype is None and t.device.type == "cpu":
                return real_type(t).replace("torch.", "torch.cuda.", 1)
            return real_type(t, dtype, non_blocking, **kw)

        torch.Tensor.type = type_
        torch.Tensor.cuda = lambda t, *a, **k: t
        return self

    def __exit__(self, *exc):
        torch.Tensor.type, torch.Tensor.cuda = self._type, self._cuda
        return False


def _spelled(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaSpelling():
            return fn(*args, **kwargs)
    wrapper._loongforge_cpu = True
    return wrapper


def _patch_cuda_spelling() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    # optimizer/distrib_optimizer.py:420 and optimizer/optimizer.py:690 accept fp32 params only as
    # 'torch.cuda.FloatTensor'; optimizer/optimizer.py:375-380 and distrib_optimizer.py:1089 call `.cuda()`.
    dopt = distrib_optimizer.DistributedOptimizer
    build = dopt.__dict__["_build_model_and_main_param_groups"].__func__
    if not getattr(build, "_loongforge_cpu", False):
        dopt._build_model_and_main_param_groups = classmethod(_spelled(build))
    for cls, name in ((moptimizer.Float16OptimizerWithFloat16Params, "__init__"),
                      (moptimizer.MegatronOptimizer, "load_state_dict"),
                      (dopt, "load_parameter_state_from_dp_zero"), (dopt, "get_parameter_state_dp_zero")):
        fn = cls.__dict__.get(name)
        if fn is not None and not getattr(fn, "_loongforge_cpu", False):
            setattr(cls, name, _spelled(fn))
    # optimizer/clip_grads.py:167 asserts `param.grad.type() == 'torch.cuda.FloatTensor'`; optimizer.py imports it by
    # name.
    for name in ("clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        fn = getattr(clip_grads, name)
        if not getattr(fn, "_loongforge_cpu", False):
            wrapped = _spelled(fn)
            setattr(clip_grads, name, wrapped)
            if hasattr(moptimizer, name):
                setattr(moptimizer, name, wrapped)
