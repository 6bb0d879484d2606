"""Resumable training checkpoints: megatron-core distributed checkpointing for weights and optimizer state.

Layout of ``checkpoint-N/`` (written under a temporary name and renamed when complete):
- the HF export of the model (what ``save_model`` writes) — usable on its own;
- ``megatron/``: model + distributed-optimizer state saved with ``megatron.core.dist_checkpointing`` in the
  ``fully_reshardable`` optimizer format, so a run can resume under another TP / PP / VPP / DP layout (with
  ``optimizer_precision="model"``: megatron's FP32Optimizer state, AdamW moments sharded like their parameters);
- ``scheduler.pt``: the LR schedulers' state; ``rng_state_{rank}.pth`` (Trainer's) and ``megatron_rng_{rank}.pt``
  (megatron's model-parallel RNG tracker, as state tensors: read with ``torch.load(weights_only=True)``);
  ``trainer_state.json`` (step, log history, data position).

Hybrid stacks (decoder layers holding different tensors) are keyed layer by layer; tensors whose TP ranks hold rows
of several sections are keyed section by section, replicated KV heads head by head (``parallel/tp_sections.py``);
``layout.json`` records the tensor-parallel size and that format, and a resume under another size is refused where
megatron's resharding would still reorder rows (``checkpoint_layout.py``).

Bad input: a write that fails on some ranks (disk full, an unusable folder) and a checkpoint that is incomplete or
corrupt are reported on every rank alike (``run_everywhere``: the ranks agree on the outcome before the next
collective), naming the file; ``check_training_checkpoint`` reads what it can before any collective of the resume.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from loongforge_hf.bridges.checkpoint_files import CheckpointError
from loongforge_hf.bridges.distribution import failing_alike
from loongforge_hf.trainer import optimizer_state
from loongforge_hf.parallel.tp_sections import sectioned_state
from loongforge_hf.trainer.checkpoint_layout import (check_resharding, declared_sections, layers_differ, read_layout,
                                                     write_layout)
from loongforge_hf.trainer.engine import optimizer_parts

logger = logging.getLogger(__name__)

MEGATRON_DIR = "megatron"
SCHEDULER_FILE = "scheduler.pt"
LAYOUT_FILE = "layout.json"
OPTIM_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state_dict(engine, *, is_loading: bool, sections: bool = True, blocks: bool = True) -> dict:
    """The model's and optimizer's sharded state; ``sections``: sectioned rows keyed by section, ``blocks``:
    replicated KV heads by head (``tp_sections``)."""
    chunks = [c.module for c in engine.chunks]
    metadata = {"non_homogeneous_layers": True} if layers_differ(chunks) else None
    state = {f"model{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(chunks)}
    if sections:
        state = sectioned_state(state, declared_sections(chunks, blocks=blocks))
    state["optimizer"] = optimizer_state.sharded_state_dict(engine.optimizer, state, is_loading=is_loading,
                                                            metadata=OPTIM_FORMAT)
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return f"disk full ({err})"
    from megatron.core.dist_checkpointing.core import CheckpointingException

    if isinstance(err, CheckpointingException):  # megatron's validation: its first line names the tensor
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if "\n" in str(err):  # torch.distributed.checkpoint's: every failed rank's traceback
        return _cause(err)
    return f"{type(err).__name__}: {err}"


def _cause(err: BaseException) -> str:
    """A torch.distributed.checkpoint error carries every failed rank's traceback: keep its last line, the cause."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    noise = ("File ", "^", "Traceback", "result =", "local_data", "all_reads", "local_plan", "CheckpointException")
    causes = [line for line in lines if not line.startswith(noise)]
    cause = causes[-1] if causes else (lines[0] if lines else type(err).__name__)
    return f"{type(err).__name__}: {cause}"


def run_everywhere(what: str, fn: Callable[[], None], *, on: bool = True) -> None:
    """Run ``fn`` where ``on`` and let every rank agree on the outcome (collective): an error on any rank is raised
    on every rank as a ``CheckpointError`` naming ``what`` and the rank, so none is left waiting in a collective."""
    from torch.distributed.checkpoint.api import CheckpointException  # NOTE: a BaseException, not an Exception

    with failing_alike(lambda err: f"{what}: {_describe(err)}", CheckpointError,
                       catch=(Exception, CheckpointException)):
        if on:
            fn()


def rng_states_to_save(tracker) -> dict[str, torch.Tensor]:
    """megatron's model-parallel RNG states as plain state tensors (a graph-safe tracker, under megatron's CUDA graphs,
    holds ``torch.Generator`` objects): a file ``torch.load(weights_only=True)`` reads, so resuming runs no pickled
    code."""
    return {name: state.get_state() if isinstance(state, torch.Generator) else state
            for name, state in tracker.get_states().items()}


def restore_rng_states(tracker, saved: dict[str, torch.Tensor]) -> None:
    """``saved`` (``rng_states_to_save``) back into ``tracker``: a ``torch.Generator`` it holds takes its state in
    place (CUDA graphs captured it by identity), a tensor state is replaced."""
    states = dict(tracker.get_states())
    for name, state in saved.items():
        current = states.get(name)
        if isinstance(current, torch.Generator):
            current.set_state(state)
        else:
            states[name] = state
    tracker.set_states(states)


def save_training_checkpoint(trainer, output_dir: str | os.PathLike) -> None:
    """Write megatron state, schedulers and RNG into ``output_dir`` (collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    output_dir = Path(output_dir)
    ckpt = output_dir / MEGATRON_DIR
    run_everywhere(f"could not create {ckpt}", lambda: ckpt.mkdir(parents=True, exist_ok=True), on=_rank() == 0)
    # NOTE: megatron's save validates the sharding on rank 0 alone, after gathering it, and then goes on into the
    # write's collectives: a validation error there would leave the other ranks waiting. It is checked here, agreed
    # on by every rank, and the save below skips it. The state is built first, on its own (local: a rank that fails
    # there, out of memory say, must not leave the others in the validation's gather). torch.distributed.checkpoint
    # raises on every rank when a write fails, but only the coordinator's error says why: run_everywhere gives every
    # rank that one.
    box = {}
    run_everywhere(f"the megatron state cannot be saved to {ckpt}",
                   lambda: box.setdefault("state", _sharded_state_dict(trainer.engine, is_loading=False)))
    run_everywhere(f"the megatron state cannot be saved to {ckpt}", lambda: _validate(box["state"]))
    strategy = _in_process_save_strategy()
    run_everywhere(f"could not write the megatron state to {ckpt}",
                   lambda: dist_checkpointing.save(box["state"], str(ckpt), sharded_strategy=strategy,
                                                   validate_access_integrity=False))
    run_everywhere(f"could not write {output_dir / LAYOUT_FILE}", lambda: write_layout(output_dir / LAYOUT_FILE),
                   on=_rank() == 0)
    run_everywhere(f"could not write {output_dir / SCHEDULER_FILE}",
                   lambda: torch.save(trainer.lr_scheduler.state_dict(), output_dir / SCHEDULER_FILE),
                   on=_rank() == 0)
    rng_file = output_dir / f"megatron_rng_{_rank()}.pt"
    run_everywhere(f"could not write {rng_file} (rank {_rank()})",
                   lambda: torch.save(rng_states_to_save(get_cuda_rng_tracker()), rng_file))


def _in_process_save_strategy():
    """megatron-core's ``torch_dist`` save strategy with its file writes done by threads of this process.

    megatron's writer (``FileSystemWriterAsync.write_preloaded_data_multiproc`` in megatron-core 0.16.1's
    ``dist_checkpointing/strategies/filesystem_async.py``) forks one process per file it writes. A fork of a training
    process copies whatever locks its other threads hold at that moment into a child that runs none of those threads:
    huggingface_hub's at-fork handler hung in the child when Trainer's background hub upload (``push_to_hub=True``)
    held its connection pool's lock, and a user callback's thread could do the same. Our saves are synchronous, so
    the same per-file writes (megatron's ``write_preloaded_data``, fsync included) run in threads here, as
    ``torch.distributed.checkpoint``'s own ``FileSystemWriter`` does; the results go through an in-process queue
    (megatron would create it with a spawned ``multiprocessing.Manager``, a process that re-runs the user's
    ``__main__`` module: a script without an ``if __name__ == "__main__":`` guard loaded the model again in it).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()

    class InProcessSave(TorchDistSaveShardedStrategy):
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            if request.async_fn is None:  # nothing to write on this rank
                return request
            transforms = [writer.transforms] if hasattr(writer, "transforms") else []
            return request._replace(async_fn=partial(_write_buckets_in_threads, transforms, writer.use_msc))

    return InProcessSave("torch_dist", 1)


def _write_buckets_in_threads(transforms: list, use_msc: bool, rank: int, buckets: list, results) -> None:
    """Write each of ``buckets`` (one file each) in a thread of its own and put ``{bucket index: write results}`` or
    the first error into ``results``, as megatron's forked writer does (same arguments after the first two)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    del rank  # megatron's writer logs it
    outputs, done = queue.Queue(), queue.Queue()

    def write(index: int, bucket) -> None:
        done.put(index)  # megatron's worker takes one item from it when it ends
        FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, outputs, done, True, use_msc=use_msc)

    with ThreadPoolExecutor(max_workers=max(1, len(buckets)), thread_name_prefix="loongforge-ckpt") as pool:
        for future in [pool.submit(write, i, bucket) for i, bucket in enumerate(buckets)]:
            future.result()
    written: dict | BaseException = {}
    while not outputs.empty():
        index, result = outputs.get()
        if isinstance(result, BaseException):
            written = result
            break
        written[index] = result
    results.put(written)


def _validate(state: dict) -> None:
    """megatron's save validation of ``state``: each shard written once, the whole of every tensor covered, the
    common state alike on every rank (collective; raises on rank 0 only)."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    save_preprocess(state, validate_access_integrity=True)  # NOTE: builds its factories in place, as save would


REQUIRED_FILES = (f"{MEGATRON_DIR}/metadata.json", f"{MEGATRON_DIR}/.metadata", f"{MEGATRON_DIR}/common.pt",
                  SCHEDULER_FILE, "trainer_state.json")


def check_training_checkpoint(checkpoint_dir: str | os.PathLike) -> None:
    """Raise a ``CheckpointError`` naming the file when ``checkpoint_dir`` is not a complete LoongTrainer checkpoint:
    a required file missing, trainer_state.json or megatron/metadata.json not JSON, or a megatron shard that its
    index (megatron/.metadata) names missing or shorter than the bytes it is said to hold. Local and alike on every
    rank (run before any collective of a resume)."""
    folder = Path(checkpoint_dir)
    if not (folder / MEGATRON_DIR).is_dir():
        raise CheckpointError(f"{folder} has no {MEGATRON_DIR}/ folder: it was not written by LoongTrainer, so it "
                              "cannot be resumed.")
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is an incomplete LoongTrainer checkpoint: {', '.join(missing)} missing.")
    for name in ("trainer_state.json", f"{MEGATRON_DIR}/metadata.json"):
        try:
            json.loads((folder / name).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise CheckpointError(f"{folder / name}: corrupt checkpoint file ({err}).") from err
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(folder / MEGATRON_DIR)).read_metadata().storage_data or {}
    except Exception as err:  # noqa: BLE001 - torch's pickled index: any failure means it is unreadable
        raise CheckpointError(f"{folder / MEGATRON_DIR / '.metadata'}: corrupt checkpoint index "
                              f"({type(err).__name__}: {err}).") from err
    needed: dict[str, int] = {}
    for info in storage.values():
        path = getattr(info, "relative_path", None)
        if isinstance(path, str):
            needed[path] = max(needed.get(path, 0), int(info.offset) + int(info.length))
    for path, size in sorted(needed.items()):
        file = folder / MEGATRON_DIR / path
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: {folder} is an incomplete LoongTrainer checkpoint.")
        if file.stat().st_size < size:
            raise CheckpointError(f"{file} is truncated ({file.stat().st_size} bytes, the checkpoint index needs "
                                  f"{size}): {folder} is a corrupt LoongTrainer checkpoint.")


def load_training_checkpoint(trainer, checkpoint_dir: str | os.PathLike) -> None:
    """Restore weights, optimizer, schedulers and RNG from ``checkpoint_dir`` (collective; any layout), checked first
    with ``check_training_checkpoint`` by the caller (LoongTrainer: before Trainer reads trainer_state.json)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    checkpoint_dir = Path(checkpoint_dir)
    ckpt = checkpoint_dir / MEGATRON_DIR
    engine = trainer.engine
    _materialize_adam_state(engine)
    # NOTE: local reads first, agreed on by every rank, so a bad file fails before the collective load.
    box = {}
    run_everywhere(f"{checkpoint_dir / LAYOUT_FILE}: cannot be read",
                   lambda: box.setdefault("layout", read_layout(checkpoint_dir / LAYOUT_FILE)))
    template = _sharded_state_dict(engine, is_loading=True, sections=bool(box["layout"].get("tp_sections")),
                                   blocks=bool(box["layout"].get("kv_blocks")))
    run_everywhere(f"{checkpoint_dir / SCHEDULER_FILE}: cannot be read",
                   lambda: box.setdefault("scheduler", torch.load(checkpoint_dir / SCHEDULER_FILE, weights_only=True)))
    rng_file = checkpoint_dir / f"megatron_rng_{_rank()}.pt"
    saved_world = len(list(checkpoint_dir.glob("megatron_rng_*.pt")))
    world = dist.get_world_size() if dist.is_initialized() else 1
    same_world = rng_file.is_file() and saved_world == world
    run_everywhere(f"{rng_file}: cannot be read (rank {_rank()})",
                   lambda: box.setdefault("rng", torch.load(rng_file, weights_only=True)), on=same_world)
    run_everywhere(f"{checkpoint_dir}: cannot be resumed in this layout",
                   lambda: check_resharding(engine, box["layout"], checkpoint_dir))
    run_everywhere(f"{ckpt}: cannot be resumed with this optimizer",
                   lambda: _check_optimizer_parts(len(optimizer_parts(engine.optimizer)) > 1, ckpt))
    run_everywhere(f"{ckpt}: the megatron state cannot be loaded into this model (was the checkpoint written for "
                   "another model?)", lambda: box.setdefault("loaded", dist_checkpointing.load(template, str(ckpt))))
    loaded = box.pop("loaded")
    for i, chunk in enumerate(engine.chunks):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    optimizer_state.load_state_dict(engine.optimizer, loaded["optimizer"])
    trainer.lr_scheduler.load_state_dict(box["scheduler"])
    if same_world:
        restore_rng_states(get_cuda_rng_tracker(), box["rng"])
    else:
        logger.warning("Resuming under a different world size (%d -> %d): model-parallel RNG streams restart.",
                       saved_world, world)


def _check_optimizer_parts(chained: bool, ckpt: Path) -> None:
    """The optimizer that wrote ``ckpt`` and this one (``chained``: more than one part, whose state is keyed
    ``chained_{i}.``, ``optimizer_state.py``) are both chains or both one part: a mixture-of-experts checkpoint
    written before the routed experts were expert parameters in every layout (one part where there was no expert
    parallelism) cannot fill a dense + expert chain. Local reads only."""
    from torch.distributed.checkpoint import FileSystemReader

    theirs = any(k.startswith("chained_") for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    if chained != theirs:
        how = ("a one-part optimizer (a mixture-of-experts model saved without expert parallelism by a loongforge-hf "
               "from before the routed experts were expert parameters in every layout)") if chained else \
            "a dense + expert optimizer chain, this model's optimizer has one part"
        raise CheckpointError(f"the checkpoint's optimizer state was written by {how}; resume it with the version and "
                              f"layout that wrote it, or start a new run from its weights: "
                              f"from_pretrained({str(ckpt.parent)!r}) reads the HF export beside megatron/.")


def _materialize_adam_state(engine) -> None:
    """Give every parameter of the inner AdamW(s) the state torch creates at its first step (zeros, step 0).

    megatron's DistributedOptimizer.state_dict() reads the common ``step`` of the inner optimizer, which a fresh
    optimizer does not have yet; the loaded checkpoint then overwrites all of it.
    """
    for opt in engine.inner_optimizers():
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def publish_checkpoint(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a complete temporary checkpoint folder into place (rank 0), replacing an older one: the old folder is
    moved aside first and deleted only once the new one is in place (collective; alike on every rank)."""
    def publish() -> None:
        if not os.path.lexists(final_dir):
            os.replace(tmp_dir, final_dir)
            return
        aside = final_dir.parent / f".{final_dir.name}.old-{os.getpid()}"
        os.replace(final_dir, aside)
        try:
            os.replace(tmp_dir, final_dir)
        except OSError:
            os.replace(aside, final_dir)
            raise
        shutil.rmtree(aside, ignore_errors=True)

    run_everywhere(f"could not move {tmp_dir} to {final_dir}", publish, on=_rank() == 0)
