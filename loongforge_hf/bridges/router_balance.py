"""transformers' router load-balancing loss for the MoE bridges whose HF models compute it (Qwen3-MoE, Mixtral, ERNIE
4.5 MoE): the config's ``output_router_logits`` with a nonzero ``router_aux_loss_coef``
(``config_map.router_aux_loss_coef_of``) in training (``active``); the model's forward returns it whenever
``output_router_logits`` is on, a coefficient of 0 included, as transformers' does (``forward_outputs``).

Choices:
- A bridge whose router outputs are not built says why in ``router_outputs_refusal`` (Doge's CDMoE):
  ``output_router_logits`` on, by the config or the forward's keyword, raises it (pure).
- The formula is transformers' ``load_balancing_loss_func``: over the router logits of every MoE layer of one forward,
  ``E * sum_e f_e * P_e`` with ``f_e`` the top-k slots that chose expert ``e`` and ``P_e`` the sum of its softmax
  probability (over all experts), both summed over layers and tokens weighted by the attention mask, divided by
  ``R`` = layers x weighted tokens. megatron's own balancing losses (per layer, divided by top-k) stay off.
- ``BalanceRouter`` is megatron's ``TopKRouter`` in the MoE layers' router slot (``specs.py``). While a forward is
  tallied (``RouterBalance.begin``) each layer adds its three sums (slot counts, probability sums, weight sum) to the
  forward's ``Tally``; its chosen experts are the routing map megatron dispatches with (a router with an expert bias,
  ERNIE 4.5's softmax one, which routes by ``biased_routing.route``, or MiniMax-M2's sigmoid one, megatron's
  ``expert_bias``: the top k without the bias, as transformers counts them). It also hands its logits to the forward's
  ``router_logits.RouterLogits`` while the model's forward records them (all it does for bridges with
  ``hf_router_logits`` alone, DeepSeek: ``balance`` None, ``routing`` is megatron's). Token weights: the user's
  attention mask, 0 for the pads the engine adds for its layout (``trainer.data``), 1 everywhere for padding-free rows,
  as transformers counts them. ``Tally.finish`` sums the layers and the ranks that split the tokens (tensor-parallel
  ranks under sequence parallelism, context-parallel ranks) and returns the loss.
- The gradient: ``Tally.finish`` returns the loss in the graph (``_AuxOut``), and each layer's probability sums join
  it through an identity op on the router's output (``_SumsGrad``). Whatever reaches ``aux_loss`` in the backward
  (``coef`` from ``loss = lm + coef * aux``, times anything that scaled the loss afterwards: gradient accumulation,
  a loss scale, a custom objective that leaves ``aux`` out: nothing) is kept, and the layers' sums get it times
  ``d aux / d sums = E * f / R``, known once the tally is finished. One path then serves a plain forward and
  activation recompute (the first, grad-free pass tallies; the pass recomputed inside the backward only attaches
  the gradient; a recompute that would take another forward's tally is refused), and no collective needs a
  backward: each rank's own tokens get their part, and megatron sums the router weight's gradient over the ranks
  that split the tokens (as for every weight replicated under sequence parallelism; over context-parallel ranks
  with the data-parallel reduction).
- Pipeline parallelism: each stage's forward tallies its own layers (a forward of a virtual stage, under megatron's
  schedules one tally per stage forward), adds what the stage before handed on and hands the sum to the next stage
  (``parallel/stage_link.py``); the last stage finishes it. In the backward the last stage sends ``d objective /
  d sums`` back along the stages: each stage receives it where its backward starts (a hook on its output) and its
  layers' ``_SumsGrad`` use it. Recomputed layers under pipelining take their forward's tally in forward order
  (the schedules run each chunk's backwards in the order of its forwards).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from loongforge_hf.bridges import biased_routing, moe_graphs
from loongforge_hf.bridges.balance_tally import Tally
from loongforge_hf.bridges.config_map import (UnsupportedConfigError, router_aux_loss_coef_field,
                                              router_aux_loss_coef_of)


def _top_k_router():
    from megatron.core.transformer.moe.router import TopKRouter

    class BalanceRouter(TopKRouter):
        """megatron's ``TopKRouter`` that feeds the open ``Tally`` of ``self.balance`` (set by ``attach``) and, while
        a forward records them, hands its logits to ``self.recorder`` (``router_logits.recording``)."""

        balance = None
        recorder = None
        norm_min = None  # set with a softmax router's expert bias (ERNIE 4.5): it routes by biased_routing.route
        route = None  # a bridge's own routing, logits [T, E] -> (probs, map) (PhiMoE's sparsemixer): in its place

        def _apply_expert_bias(self, routing_map, padding_mask=None):
            # NOTE: megatron's is torch.compile'd: every call pays dynamo's guard checks (~30 us a layer on an H200's
            # host, a decode step's cost) also where it has nothing to do: without an expert bias
            if self.enable_expert_bias:
                super()._apply_expert_bias(routing_map, padding_mask=padding_mask)

        def routing(self, logits, padding_mask=None):
            scores = None  # NOTE: ERNIE 4.5's fp32 softmax over all experts (biased_routing)
            if self.route is not None:
                probs, routing_map = self.route(logits.view(-1, self.config.num_moe_experts), self.training)
            elif self.norm_min is None:
                probs, routing_map = super().routing(logits, padding_mask=padding_mask)
            else:
                scores = torch.softmax(logits.view(-1, self.config.num_moe_experts).float(), dim=-1)
                probs, routing_map = biased_routing.route(scores, self.topk, self.expert_bias, self.norm_min,
                                                          logits.dtype)
            if self.recorder is not None:
                self.recorder.record(self, logits)
            if self.balance is not None and self.balance.tally is not None:
                # NOTE: transformers' balancing loss counts the top k without an expert bias (ERNIE 4.5's softmax
                # one; MiniMax-M2's sigmoid one, megatron's expert_bias: the top k of the logits is the softmax's)
                counted = routing_map
                if scores is not None:
                    counted = biased_routing.unbiased_map(scores, self.topk)
                elif self.enable_expert_bias or self.route is not None:
                    counted = biased_routing.unbiased_map(logits.view(-1, self.config.num_moe_experts), self.topk)
                probs = self.balance.take(self, logits, counted, probs)
            return probs, routing_map

    return BalanceRouter


_ROUTER = None


def balance_router_class() -> type:
    """The router module of the MoE specs of bridges with ``hf_balance_loss`` (one class per process)."""
    global _ROUTER
    if _ROUTER is None:
        _ROUTER = _top_k_router()
    return _ROUTER


class RouterBalance:
    """The model's ``BalanceRouter`` modules (none on a pipeline stage without MoE layers) and the tally they feed."""

    def __init__(self, routers: list, chunks, experts: int) -> None:
        from megatron.core import parallel_state as ps

        self.routers = routers
        self.experts = experts
        self.tally: Tally | None = None
        self.link = None  # pipeline parallelism: the stages' side channel, made when the loss is first on (active)
        self.pipelined = ps.get_pipeline_model_parallel_world_size() > 1
        self.recomputed: dict[int, deque] = {id(r): deque() for r in routers}  # pipelining: tallies awaiting it
        for router in routers:
            router.balance = self
        if self.pipelined:
            for chunk in chunks:
                chunk.register_forward_hook(self._stage_end)

    def link_stages(self, device) -> None:
        """Make the pipeline stages' side channel (collective: every rank, at the same point)."""
        from loongforge_hf.parallel.stage_link import stage_link

        if self.pipelined and self.link is None:
            self.link = stage_link(device)

    def _stage_end(self, chunk, args, output) -> None:
        tally = self.tally
        if tally is not None and tally.open and not chunk.post_process:
            tally.pass_on(output, first=chunk.pre_process)

    def take(self, router, logits: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        tally = self.tally
        if tally is None:
            return probs
        if self.pipelined and tally.with_grad:
            # NOTE: megatron's schedules run several forwards before their backwards; a layer checkpointed in a
            # forward (no grad) is recomputed in its backward, in forward order per layer
            queue = self.recomputed[id(router)]
            if not torch.is_grad_enabled() and tally.open:
                queue.append(tally)
            elif torch.is_grad_enabled() and not tally.open:
                if not queue:
                    raise RuntimeError("router balance: a recomputed layer without its forward's tally.")
                tally = queue.popleft()
        return tally.take(router, logits.reshape(-1, self.experts), routing_map, probs)

    def begin(self, attention_mask: torch.Tensor | None, shape: tuple[int, int], *, length: int, device,
              graph: bool | None = None) -> Tally:
        """Tally the next forward, of a ``shape`` batch with that ``attention_mask`` (None: every token counts)
        padded to ``length`` for the layout (the pads count 0); each rank weighs its context-parallel share.
        ``graph``: whether the loss joins the autograd graph (default: grad is enabled)."""
        self.tally = Tally(_context_parallel_share(_token_weights(attention_mask, shape, length=length,
                                                                  device=device)), self.experts, device, self.link)
        if graph is not None:
            self.tally.with_grad = graph
        return self.tally

    def finish_everywhere(self, tally: Tally) -> torch.Tensor:
        """``tally.finish()`` on every rank (the model's forward): the last pipeline stage's, broadcast."""
        if self.link is None:
            return tally.finish()
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        value = tally.finish() if ps.is_pipeline_last_stage(ignore_virtual=True) else \
            torch.zeros((), device=tally.device)
        dist.broadcast(value, src=dist.get_process_group_ranks(group)[-1], group=group)
        self.link.flush()
        self.tally = None  # NOTE: the forward is over on every stage: a later forward nobody began tallies nothing
        return value

    def step_start(self) -> None:
        """A training step starts (nothing awaits a recompute from an earlier one)."""
        for queue in self.recomputed.values():
            queue.clear()

    def step_end(self) -> None:
        if self.link is not None:
            self.link.flush()
        self.tally = None

    def end(self) -> None:
        """Tally nothing (a forward without the loss)."""
        self.tally = None


def attach(routers: list, chunks, bridge) -> RouterBalance | None:
    """A ``RouterBalance`` over the chunks' ``BalanceRouter`` modules (``routers``: ``router_logits.
    recording_routers``), for bridges whose HF model computes the loss (``hf_balance_loss``); None for others."""
    if not getattr(bridge, "hf_balance_loss", False):
        return None
    return RouterBalance(routers, chunks, bridge.num_experts())


def check_layout(hf_config, bridge, *, coef: float | None = None) -> None:
    """``ValueError`` where the loss is asked for (``coef``, default the config's) and cannot be computed (pure:
    every rank raises alike)."""
    coef = router_aux_loss_coef_of(hf_config) if coef is None else coef
    if not coef or getattr(bridge, "hf_ignores_aux_loss_coef", False):  # NOTE: Llama 4's model never adds the loss
        return
    if not getattr(bridge, "hf_balance_loss", False):
        raise ValueError(f"router_aux_loss_coef={coef} with output_router_logits: {type(bridge).__name__} does not "
                         "compute transformers' router load-balancing loss; set router_aux_loss_coef=0 (or "
                         "output_router_logits=False).")


def active(model) -> tuple[RouterBalance, float] | None:
    """(the model's ``RouterBalance``, coefficient) when its config asks for the loss now (trl may switch it on after
    loading): ``output_router_logits`` with a nonzero coefficient (training adds nothing otherwise); None otherwise.
    Raises as ``check_layout``."""
    return _switch(model, None, zero_coef=False)


def forward_outputs(model, output_router_logits: bool | None = None) -> tuple[RouterBalance, float] | None:
    """(the model's ``RouterBalance``, coefficient) when a forward returns transformers' router outputs (``aux_loss``,
    ``router_logits``): ``output_router_logits`` on, the forward keyword overriding the config's, as in transformers.
    The coefficient may be 0: transformers' model then still returns both and adds ``0 * aux_loss`` to the loss.
    None otherwise, and for bridges without them. Raises as ``check_layout``."""
    return _switch(model, output_router_logits, zero_coef=True)


def requested(model, coef: float) -> tuple[RouterBalance, float] | None:
    """(the model's ``RouterBalance``, ``coef``) for a trainer that asks each training forward for the loss with a
    coefficient of its own, whatever the config says (trl.DPOTrainer: ``output_router_logits=True`` and
    ``DPOConfig.router_aux_loss_coef``); None when ``coef`` is 0. Raises as ``check_layout``."""
    return _switch(model, bool(coef), zero_coef=False, coef=coef)


def _switch(model, output_router_logits: bool | None, *, zero_coef: bool, coef: float | None = None
            ) -> tuple[RouterBalance, float] | None:
    from loongforge_hf.bridges.router_logits import asked

    config = model.config.get_text_config()  # NOTE: an image-text model's: its language model's
    on = asked(config, output_router_logits)
    refusal = getattr(getattr(model.bridge, "text", model.bridge), "router_outputs_refusal", None)
    if on and refusal:  # NOTE: a model whose router outputs are not built (Doge's CDMoE router): pure
        raise UnsupportedConfigError(refusal)
    if on and moe_graphs.asked(getattr(getattr(model, "megatron", None), "config", None)):
        raise ValueError(f"{moe_graphs.ROUTER_OUTPUTS}: not with cuda_graph_impl='local'.")
    if coef is None:
        coef = router_aux_loss_coef_field(config) if on else 0.0
    check_layout(config, getattr(model.bridge, "text", model.bridge), coef=coef)
    balance = getattr(model, "router_balance", None)
    if balance is None or not on or not (coef or zero_coef):
        if balance is not None:
            balance.end()
        return None
    balance.link_stages(model.device)
    return balance, coef


def _token_weights(attention_mask: torch.Tensor | None, shape: tuple[int, int], *, length: int, device
                   ) -> torch.Tensor:
    """``[batch, length]`` fp32 weights of a ``shape`` batch: its attention mask (1 without one), then 0 for the pads
    up to ``length``."""
    w = torch.ones(shape, dtype=torch.float32, device=device) if attention_mask is None \
        else attention_mask.to(device, torch.float32)
    extra = length - w.shape[1]
    return torch.nn.functional.pad(w, (0, extra)) if extra else w


def _context_parallel_share(weights: torch.Tensor) -> torch.Tensor:
    """This context-parallel rank's tokens' weights (``parallel.context_parallel.cp_token_index``)."""
    from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_token_index

    _, cp_size, cp_rank = cp_group_and_size()
    if cp_size == 1:
        return weights
    return weights[:, cp_token_index(weights.shape[1], cp_size, cp_rank, device=weights.device)]
