"""What crosses a pipeline stage boundary, and which layers each stage holds.

Choices:
- A bridge whose decoder carries more than the hidden states between layers declares the width per token
  (``pipeline_hidden_size()``: DeepSeek-V4's and HY-V4's ``hc_mult`` residual streams, Gemma 3n's AltUp streams and
  per-layer inputs). megatron's schedules size each receive ``[s, b, hidden_size]``, so under pipeline parallelism
  the config then gets ``variable_seq_lengths`` (megatron sends each boundary tensor's shape first; a user's
  ``False`` is refused by name) and ``MegatronModel.stage_hidden_size`` tells our own point-to-point code
  (``runtime._interleaved_forward_once``) the width.
- ``uneven_split``: megatron's first / last stage sizes where the layers do not divide evenly; ``stage_layer_ranges``:
  the decoder layers of each (virtual) stage as ``builder.build_megatron_model`` splits them (the first chunk's for
  the vision tower's placement, ``multimodal/chunk.py``; where layers land for bridges that refuse some splits:
  HY-V4's shared indexer layers, Gemma 3n's KV-sharing layers).
"""

from __future__ import annotations

import math

from loongforge_hf.parallel.config import ParallelLayoutError


def wider_boundary(bridge) -> int | None:
    """The width per token a stage boundary carries when the bridge declares one other than ``hidden_size``."""
    width = bridge.pipeline_hidden_size() if hasattr(bridge, "pipeline_hidden_size") else None
    return None if width in (None, bridge.hf_config.hidden_size) else width


def boundary_problems(bridge, megatron_config: dict) -> list[str]:
    """``check_megatron_config``'s problems with a wider boundary: ``variable_seq_lengths=False``."""
    width = wider_boundary(bridge)
    if width is None or megatron_config.get("variable_seq_lengths") is not False:
        return []
    return [f"variable_seq_lengths=False: {bridge.architectures[0]}'s pipeline stages send {width} values per token, "
            f"not hidden_size={bridge.hf_config.hidden_size} (megatron's fixed receive shape); leave it unset"]


def boundary_settings(bridge, pipeline_parallel_size: int, megatron_config: dict) -> dict:
    """The TransformerConfig fields a wider boundary needs under pipeline parallelism (none set by the user)."""
    if pipeline_parallel_size > 1 and wider_boundary(bridge) is not None and \
            "variable_seq_lengths" not in megatron_config:
        return {"variable_seq_lengths": True}
    return {}


def uneven_split(num_layers: int, pp: int) -> dict:
    """Kwargs for megatron that put ``num_layers`` on ``pp`` stages as evenly as megatron can express."""
    if num_layers % pp == 0:
        return {}
    for first in range(math.ceil(num_layers / pp), num_layers):
        for last in (None, *range(1, num_layers)):
            rest = num_layers - first - (last or 0)
            middle = pp - 1 - (last is not None)
            if middle == 0 and rest == 0 or middle > 0 and rest > 0 and rest % middle == 0:
                kw = {"num_layers_in_first_pipeline_stage": first}
                if last is not None:
                    kw["num_layers_in_last_pipeline_stage"] = last
                return kw
    raise ParallelLayoutError(f"num_hidden_layers={num_layers} cannot be split over pipeline_parallel_size={pp}.")


def stage_layer_ranges(num_layers: int, parallel) -> list[range]:
    """The decoder layers of each (virtual) pipeline stage, in layer order, as ``build_megatron_model`` splits them."""
    pp, vpp = parallel.pipeline_parallel_size, parallel.interleaved_stages
    if vpp:
        sizes = [num_layers // (pp * vpp)] * (pp * vpp)
    else:
        kw = uneven_split(num_layers, pp)
        first, last = kw.get("num_layers_in_first_pipeline_stage"), kw.get("num_layers_in_last_pipeline_stage")
        if first is None:
            sizes = [num_layers // pp] * pp
        else:
            middle = pp - 1 - (last is not None)
            rest = num_layers - first - (last or 0)
            sizes = [first, *([rest // middle] * middle if middle else []), *([last] if last is not None else [])]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes)]
