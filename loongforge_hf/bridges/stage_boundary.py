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
  HY-V4's shared indexer layers).
- A bridge whose layers cannot be parted arbitrarily declares ``stage_split_problem(ranges)`` (a reason a split's
  stages do not work, or None: Gemma 3n's and Gemma 4 E2B / E4B's layers reusing keys and values). ``pipeline_split``
  then keeps ``uneven_split``'s stages where they work and otherwise picks the most even split megatron's
  ``num_layers_in_first/last_pipeline_stage`` express that does (the least largest stage, then the least sum of
  squares); such a bridge also takes the user's own two fields through ``megatron_config``, checked alike. Virtual
  stages stay even (``ParallelConfig.check_model``): a split they part is refused, and so is a user's first / last
  size with them. Both refusals are ``UnsupportedConfigError`` naming the layout, before any collective.
"""

from __future__ import annotations

import math

from loongforge_hf.parallel.config import ParallelLayoutError

SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


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


def split_sizes(num_layers: int, pp: int, split: dict) -> list[int] | None:
    """The stage sizes megatron makes of ``split`` (``SPLIT_FIELDS``, each optional): the first / last stage's where
    given, the rest shared equally by the others, each at least one layer; None where megatron would refuse it."""
    first, last = (split.get(name) for name in SPLIT_FIELDS)
    if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1) for v in (first, last)):
        return None
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle < 0 or (rest != 0 if middle == 0 else rest <= 0 or rest % middle):
        return None
    return [*([first] if first is not None else []), *([rest // middle] * middle if middle else []),
            *([last] if last is not None else [])]


def _ranges(sizes: list[int]) -> list[range]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def stage_layer_ranges(num_layers: int, parallel) -> list[range]:
    """The decoder layers of each (virtual) pipeline stage, in layer order, as ``build_megatron_model`` splits them
    for a bridge without ``stage_split_problem`` (``pipeline_split`` gives such a bridge's)."""
    pp, vpp = parallel.pipeline_parallel_size, parallel.interleaved_stages
    if vpp:
        return _ranges([num_layers // (pp * vpp)] * (pp * vpp))
    return _ranges(split_sizes(num_layers, pp, uneven_split(num_layers, pp)))


def pipeline_split(bridge, parallel, megatron_config: dict | None = None) -> dict:
    """``SPLIT_FIELDS`` for megatron ({} for even stages and virtual ones): the user's in ``megatron_config``, else
    ``uneven_split``'s, else the most even split the bridge's ``stage_split_problem`` accepts (module docstring);
    ``UnsupportedConfigError`` / ``ParallelLayoutError`` naming the layout where none works (pure)."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError

    n, pp, vpp = bridge.hf_config.num_hidden_layers, parallel.pipeline_parallel_size, parallel.interleaved_stages
    problem = getattr(bridge, "stage_split_problem", lambda ranges: None)
    given = {k: megatron_config[k] for k in SPLIT_FIELDS if k in (megatron_config or {})}
    arch = bridge.architectures[0]
    if given:  # NOTE: check_megatron_config refuses them for a bridge without stage_split_problem
        if vpp:
            raise UnsupportedConfigError(f"megatron_config {given} with virtual_pipeline_parallel_size={vpp} is not "
                                         f"supported for {arch}: virtual pipeline stages split the layers evenly.")
        sizes = split_sizes(n, pp, given)
        if sizes is None:
            raise ParallelLayoutError(f"megatron_config {given}: megatron cannot split num_hidden_layers={n} over "
                                      f"pipeline_parallel_size={pp} so (the other stages share the rest equally, "
                                      "at least one layer each).")
        reason = problem(_ranges(sizes))
        if reason:
            raise UnsupportedConfigError(f"megatron_config {given} (stages of {sizes} layers) is not supported for "
                                         f"{arch}: {reason}.")
        return given
    if pp < 2:
        return {}
    layout = f"pipeline_parallel_size={pp}{f' with virtual_pipeline_parallel_size={vpp}' if vpp else ''}"
    reason = problem(stage_layer_ranges(n, parallel))
    if vpp and reason:
        raise UnsupportedConfigError(f"{layout} is not supported for {arch}: {reason}; virtual pipeline stages split "
                                     "the layers evenly here, use pipeline stages without them (the bridge then "
                                     "picks a split that works).")
    if vpp or not reason:
        return {} if vpp else uneven_split(n, pp)
    candidates = sorted(_splits(n, pp), key=lambda kw_sizes: (max(kw_sizes[1]), sum(s * s for s in kw_sizes[1])))
    for kw, sizes in candidates:
        if not problem(_ranges(sizes)):
            return kw
    raise UnsupportedConfigError(f"{layout} is not supported for {arch}: {reason}; no split of the {n} layers over "
                                 f"{pp} stages that megatron takes ({' / '.join(SPLIT_FIELDS)}) keeps them together.")


def _splits(num_layers: int, pp: int):
    """Each split megatron takes of ``num_layers`` over ``pp`` stages once, as (``SPLIT_FIELDS`` kwargs, sizes)."""
    seen = set()
    for first in (None, *range(1, num_layers + 1)):
        for last in (None, *range(1, num_layers + 1)):
            kw = {name: v for name, v in zip(SPLIT_FIELDS, (first, last)) if v is not None}
            sizes = split_sizes(num_layers, pp, kw)
            if sizes is not None and tuple(sizes) not in seen:
                seen.add(tuple(sizes))
                yield kw, sizes
