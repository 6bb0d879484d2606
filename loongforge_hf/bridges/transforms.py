"""Pure tensor transforms between HF and megatron-core weight layouts: tensors in, tensors out.

Choices:
- Weights are ``[out, in]`` and biases ``[out]``; every transform works on dim 0, so one function serves both.
- Fused QKV follows megatron-core's ``linear_qkv``: per KV group, the query heads of that group, then its key head,
  then its value head; groups one after another. Head counts are those of the tensors given, so a tensor-parallel rank
  passes its local counts and the layout of its shard comes out right (megatron splits QKV by whole KV groups).
- Gated MLP ``linear_fc1`` is ``[gate; up]`` along dim 0, per rank; a rank's local fc1 splits the same way.
- The vocabulary is padded to a multiple of ``multiple * tensor_parallel_size`` (megatron's
  ``make_vocab_size_divisible_by`` rule) with zero rows, and truncated back to the HF size on export.
- Nothing here knows about process groups or files; bad arguments raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import torch


def _positive(**values: int) -> None:
    for field, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}.")


def _heads_per_group(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    _positive(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}).")
    return num_heads // num_kv_heads


def _check_rows(tensor: torch.Tensor, rows: int, what: str) -> None:
    if tensor.dim() == 0 or tensor.shape[0] != rows:
        raise ValueError(f"{what} must have {rows} rows, got shape {tuple(tensor.shape)}.")


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> torch.Tensor:
    """HF ``q_proj``/``k_proj``/``v_proj`` (weights or biases) -> megatron-core ``linear_qkv``."""
    per_group = _heads_per_group(num_heads, num_kv_heads, head_dim)
    _check_rows(q, num_heads * head_dim, f"q (num_heads={num_heads} x head_dim={head_dim})")
    _check_rows(k, num_kv_heads * head_dim, f"k (num_kv_heads={num_kv_heads} x head_dim={head_dim})")
    _check_rows(v, num_kv_heads * head_dim, f"v (num_kv_heads={num_kv_heads} x head_dim={head_dim})")
    if not q.shape[1:] == k.shape[1:] == v.shape[1:]:
        raise ValueError(f"q, k, v must agree past dim 0, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    rest = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(num_kv_heads, per_group * head_dim, *rest),
            k.reshape(num_kv_heads, head_dim, *rest),
            v.reshape(num_kv_heads, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape((num_heads + 2 * num_kv_heads) * head_dim, *rest)


def qkv_blocks(*, num_heads: int, num_kv_heads: int, head_dim: int,
               v_head_dim: int | None = None) -> list[tuple[int, int, int, int]]:
    """Where ``fuse_qkv`` puts each row of q, k and v: ``(which, row in it, row in the fused tensor, rows)``.

    ``which`` is 0 for q, 1 for k, 2 for v; one block per KV group and projection, in fused order. Lets a caller
    read each block straight into its place in the fused tensor (and write each back out) without concatenating.
    ``v_head_dim``: value heads narrower than query / key heads (MiMo-V2-Flash); None: ``head_dim``.
    """
    per_group = _heads_per_group(num_heads, num_kv_heads, head_dim)
    vd = head_dim if v_head_dim is None else v_head_dim
    q_rows, width = per_group * head_dim, (per_group + 1) * head_dim + vd
    blocks = []
    for g in range(num_kv_heads):
        base = g * width
        blocks.append((0, g * q_rows, base, q_rows))
        blocks.append((1, g * head_dim, base + q_rows, head_dim))
        blocks.append((2, g * vd, base + q_rows + head_dim, vd))
    return blocks


def split_qkv(
    qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core ``linear_qkv`` -> HF ``(q, k, v)``; the inverse of ``fuse_qkv``."""
    per_group = _heads_per_group(num_heads, num_kv_heads, head_dim)
    _check_rows(
        qkv,
        (num_heads + 2 * num_kv_heads) * head_dim,
        f"qkv ((num_heads={num_heads} + 2 x num_kv_heads={num_kv_heads}) x head_dim={head_dim})",
    )
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *rest).contiguous(),
        k.reshape(num_kv_heads * head_dim, *rest).contiguous(),
        v.reshape(num_kv_heads * head_dim, *rest).contiguous(),
    )


def first_replicas(rows: torch.Tensor, *, replicas: int, head_dim: int) -> torch.Tensor:
    """K (or V) rows of ``heads x replicas`` heads, each head's replicas side by side, -> the first replica of each
    head (more TP ranks than KV heads: rank ``t`` holds a replica of head ``t // replicas``)."""
    _positive(replicas=replicas, head_dim=head_dim)
    if replicas == 1:
        return rows
    if rows.dim() == 0 or rows.shape[0] % (replicas * head_dim):
        raise ValueError(f"rows must hold whole replicated heads ({replicas} replicas x head_dim={head_dim}), got "
                         f"shape {tuple(rows.shape)}.")
    rest = rows.shape[1:]
    return rows.reshape(-1, replicas, head_dim, *rest)[:, 0].reshape(-1, *rest).contiguous()


def replicate_heads(rows: torch.Tensor, *, replicas: int, head_dim: int) -> torch.Tensor:
    """The inverse of ``first_replicas``: each head's rows repeated ``replicas`` times, side by side."""
    _positive(replicas=replicas, head_dim=head_dim)
    if replicas == 1:
        return rows
    rest = rows.shape[1:]
    return rows.reshape(-1, 1, head_dim, *rest).expand(-1, replicas, head_dim, *rest).reshape(-1, *rest)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj``/``up_proj`` -> megatron-core gated ``linear_fc1`` (``[gate; up]``)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must have one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}."
        )
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension.")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core gated ``linear_fc1`` -> HF ``(gate, up)``; the inverse of ``fuse_gate_up``."""
    if fc1.dim() == 0 or fc1.shape[0] % 2:
        raise ValueError(f"fc1 must have an even number of rows (gate then up), got shape {tuple(fc1.shape)}.")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def padded_vocab_size(vocab_size: int, *, tensor_parallel_size: int, multiple: int = 128) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple * tensor_parallel_size``."""
    _positive(vocab_size=vocab_size, tensor_parallel_size=tensor_parallel_size, multiple=multiple)
    step = multiple * tensor_parallel_size
    return -(-vocab_size // step) * step


def pad_vocab(weight: torch.Tensor, padded_size: int) -> torch.Tensor:
    """``weight`` with zero rows appended along dim 0 up to ``padded_size`` rows."""
    if weight.dim() == 0 or not isinstance(padded_size, int) or padded_size < weight.shape[0]:
        raise ValueError(
            f"Cannot pad a vocabulary tensor of shape {tuple(weight.shape)} to {padded_size!r} rows."
        )
    if padded_size == weight.shape[0]:
        # NOTE: nothing to pad: the tensor itself, not a copy (a copy was a second pass over the embedding and LM
        # head, the largest tensors of a small model). Callers that need memory of their own copy it themselves.
        return weight
    pad = weight.new_zeros((padded_size - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


def truncate_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The first ``vocab_size`` rows of ``weight`` (a view): drops the padding rows added by ``pad_vocab``."""
    if weight.dim() == 0 or not isinstance(vocab_size, int) or not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(
            f"Cannot truncate a vocabulary tensor of shape {tuple(weight.shape)} to {vocab_size!r} rows."
        )
    return weight[:vocab_size]


def shard_range(size: int, *, rank: int, world: int, name: str = "") -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s equal share of ``size`` rows split over ``world`` ranks."""
    label = f"{name}: " if name else ""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"{label}world must be a positive integer, got {world!r}.")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"{label}rank must be in [0, {world}), got {rank!r}.")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"{label}size must be a non-negative integer, got {size!r}.")
    if size % world:
        raise ValueError(f"{label}size {size} cannot be split evenly over {world} ranks.")
    chunk = size // world
    return rank * chunk, (rank + 1) * chunk


def _rope_blocks(weight: torch.Tensor, block: int, rope_dim: int) -> torch.Tensor:
    _positive(block=block, rope_dim=rope_dim)
    if rope_dim % 2 or rope_dim > block:
        raise ValueError(f"rope_dim must be even and at most block ({block}), got {rope_dim}.")
    if weight.dim() == 0 or weight.shape[0] % block:
        raise ValueError(f"weight rows must be a multiple of block={block}, got shape {tuple(weight.shape)}.")
    return weight.reshape(weight.shape[0] // block, block, *weight.shape[1:])


def interleave_rope_rows(weight: torch.Tensor, *, block: int, rope_dim: int) -> torch.Tensor:
    """Per block of ``block`` rows, the last ``rope_dim`` rows from halves ``[a; b]`` to pairs ``a0 b0 a1 b1 ...``."""
    blocks = _rope_blocks(weight, block, rope_dim).clone()
    rope = blocks[:, block - rope_dim:]
    half = rope_dim // 2
    pairs = torch.stack([rope[:, :half], rope[:, half:]], dim=2)  # [n, half, 2, ...]
    blocks[:, block - rope_dim:] = pairs.reshape(rope.shape)
    return blocks.reshape(weight.shape)


def deinterleave_rope_rows(weight: torch.Tensor, *, block: int, rope_dim: int) -> torch.Tensor:
    """The inverse of ``interleave_rope_rows``: rotary rows from pairs back to halves."""
    blocks = _rope_blocks(weight, block, rope_dim).clone()
    rope = blocks[:, block - rope_dim:]
    blocks[:, block - rope_dim:] = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return blocks.reshape(weight.shape)
