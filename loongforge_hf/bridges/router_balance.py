"""transformers' router load-balancing loss for the MoE bridges whose HF models compute it (Qwen3-MoE, Mixtral): the
config's ``output_router_logits`` with a nonzero ``router_aux_loss_coef`` (``config_map.router_aux_loss_coef_of``).

Choices:
- The formula is transformers' ``load_balancing_loss_func``: over the router logits of every MoE layer of one forward,
  ``E * sum_e f_e * P_e`` with ``f_e`` the top-k slots that chose expert ``e`` and ``P_e`` the sum of its softmax
  probability (over all experts), both summed over layers and tokens weighted by the attention mask, divided by
  ``R`` = layers x weighted tokens. megatron's own balancing losses (per layer, divided by top-k) stay off.
- ``BalanceRouter`` is megatron's ``TopKRouter`` in the MoE layers' router slot (``specs.py``). While a forward is
  tallied (``RouterBalance.begin``) each layer adds its three sums (slot counts, probability sums, weight sum) to
  the forward's ``Tally``; its chosen experts are the routing map megatron dispatches with. Token weights: the
  user's attention mask, 0 for the pads the engine adds for its layout (``trainer.data``), 1 everywhere for
  padding-free rows, as transformers counts them. ``Tally.finish`` sums the layers and the ranks that split the
  tokens (tensor-parallel ranks under sequence parallelism, context-parallel ranks) and returns the loss.
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
- One tally is open at a time, so the layers of one forward must run on one rank: pipeline parallelism is refused
  (``check_layout``), with the way out (``router_aux_loss_coef=0``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge_hf.bridges.config_map import router_aux_loss_coef_of


def _top_k_router():
    from megatron.core.transformer.moe.router import TopKRouter

    class BalanceRouter(TopKRouter):
        """megatron's ``TopKRouter`` that feeds the open ``Tally`` of ``self.balance`` (set by ``attach``)."""

        balance = None

        def routing(self, logits, padding_mask=None):
            probs, routing_map = super().routing(logits, padding_mask=padding_mask)
            tally = self.balance.tally if self.balance is not None else None
            if tally is not None:
                probs = tally.take(self, logits.reshape(-1, self.config.num_moe_experts), routing_map, probs)
            return probs, routing_map

    return BalanceRouter


_ROUTER = None


def balance_router_class() -> type:
    """The router module of the MoE specs of bridges with ``hf_balance_loss`` (one class per process)."""
    global _ROUTER
    if _ROUTER is None:
        _ROUTER = _top_k_router()
    return _ROUTER


class _SumsGrad(torch.autograd.Function):
    """Identity on the router's probabilities; its backward gives the layer's probability sums the gradient of the
    loss the tally's ``aux_loss`` went into (``_AuxOut``), times ``d aux / d sums``."""

    @staticmethod
    def forward(ctx, probs, sums, tally):
        ctx.tally = tally
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        tally = ctx.tally
        grad = None if tally.upstream is None else tally.upstream * tally.sums_grad
        return grad_probs, grad, None


class _AuxOut(torch.autograd.Function):
    """``aux_loss`` in the graph (its value; the input ``anchor`` only makes it require grad): its backward keeps the
    gradient that reached it (the coefficient and whatever scaled the loss after: gradient accumulation, a loss
    scale), which the layers' ``_SumsGrad`` then hand on. Made after the loss it joins, it runs before them."""

    @staticmethod
    def forward(ctx, value, anchor, tally):
        ctx.tally = tally
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.tally.upstream = grad.float()
        return None, None, None


class Tally:
    """One forward's router sums: per layer ``[slot counts (E), probability sums (E), weight sum]``."""

    def __init__(self, weights: torch.Tensor | None) -> None:
        self.weights = weights          # [batch, this rank's tokens] before sequence parallelism, or None: all 1
        self.layers: list[torch.Tensor] = []
        self.open = True                # False once finished: a recomputed forward only attaches the gradient
        self.group = None               # the ranks that split this forward's tokens
        self.sums_grad: torch.Tensor | None = None  # d aux / d (each layer's probability sums)
        self.upstream: torch.Tensor | None = None   # d objective / d aux, set in the backward (_AuxOut)
        self.with_grad = torch.is_grad_enabled()   # begun by a forward that builds a graph
        self.routed = 0                 # layers tallied (while open)
        self.attached = 0               # layers whose gradient hand-in points at this tally

    def _local_weights(self, router, rows: int) -> torch.Tensor | None:
        if self.weights is None:
            return None
        w = self.weights.t()            # megatron's token order: [seq, batch]
        tp = router.tp_group.size()
        if router.config.sequence_parallel and tp > 1:
            chunk = w.shape[0] // tp
            w = w[router.tp_group.rank() * chunk:(router.tp_group.rank() + 1) * chunk]
        w = w.reshape(-1)
        if w.numel() != rows:
            raise RuntimeError(f"router balance: {w.numel()} token weights for {rows} routed tokens.")
        return w

    def take(self, router, logits: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Add one layer's sums (while open); attach the gradient when the forward builds a graph."""
        scores = torch.softmax(logits.float(), dim=-1)
        w = self._local_weights(router, logits.shape[0])
        chosen = routing_map.float()
        if w is None:
            counts, sums = chosen.sum(0), scores.sum(0)
            total = torch.tensor([float(logits.shape[0])], device=logits.device)
        else:
            w = w.to(scores)
            counts, sums = (chosen * w[:, None]).sum(0), (scores * w[:, None]).sum(0)
            total = w.sum().reshape(1)
        if self.open:
            self.routed += 1
            self.layers.append(torch.cat([counts, sums.detach(), total]))
            self.group = router.tp_cp_group if router.config.sequence_parallel else router.cp_group
        if torch.is_grad_enabled() and sums.requires_grad:
            self.attached += 1
            if not self.open and (not self.with_grad or self.attached > self.routed):
                # NOTE: a layer recomputed in the backward takes the model's latest tally; here it is another
                # forward's (two forwards before one backward, or a forward in between): refused, not mis-scaled.
                raise RuntimeError("router balance: activation recompute with the router load-balancing loss needs "
                                   "each forward's backward to run before the next forward.")
            probs = _SumsGrad.apply(probs, sums, self)
        return probs

    def finish(self) -> torch.Tensor:
        """The forward's balancing loss (fp32 scalar); in the graph (``_AuxOut``) when the forward builds one, so a
        loss that adds ``coef * aux`` (and anything scaling that loss) sends the routers their gradient."""
        self.open = False
        if not self.layers:
            raise RuntimeError("router balance: no MoE layer routed any token in this forward.")
        total = torch.stack(self.layers).sum(0)
        if self.group is not None and self.group.size() > 1:
            dist.all_reduce(total, group=self.group)
        experts = (total.numel() - 1) // 2
        rows = total[-1].clamp(min=1.0)
        fraction = total[:experts] / rows
        loss = experts * (fraction * total[experts:2 * experts] / rows).sum()
        self.sums_grad = (fraction * (experts / rows)).to(total.dtype)
        self.layers = []
        if not (self.with_grad and torch.is_grad_enabled()):
            return loss
        anchor = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        return _AuxOut.apply(loss, anchor, self)


class RouterBalance:
    """The model's ``BalanceRouter`` modules and the tally they feed."""

    def __init__(self, routers: list) -> None:
        self.routers = routers
        self.tally: Tally | None = None
        for router in routers:
            router.balance = self

    def begin(self, attention_mask: torch.Tensor | None, shape: tuple[int, int], *, length: int, device) -> Tally:
        """Tally the next forward, of a ``shape`` batch with that ``attention_mask`` (None: every token counts)
        padded to ``length`` for the layout (the pads count 0); each rank weighs its context-parallel share."""
        self.tally = Tally(_context_parallel_share(_token_weights(attention_mask, shape, length=length,
                                                                  device=device)))
        return self.tally

    def end(self) -> None:
        """Tally nothing (a forward without the loss)."""
        self.tally = None


def attach(chunks) -> RouterBalance | None:
    """A ``RouterBalance`` over the chunks' ``BalanceRouter`` modules; None where there are none."""
    cls = balance_router_class()
    routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, cls)]
    return RouterBalance(routers) if routers else None


def check_layout(hf_config, bridge, *, pipeline_parallel_size: int, coef: float | None = None) -> None:
    """``ValueError`` where the loss is asked for (``coef``, default the config's) and cannot be computed (pure:
    every rank raises alike)."""
    coef = router_aux_loss_coef_of(hf_config) if coef is None else coef
    if not coef:
        return
    if not getattr(bridge, "hf_balance_loss", False):
        raise ValueError(f"router_aux_loss_coef={coef} with output_router_logits: {type(bridge).__name__} does not "
                         "compute transformers' router load-balancing loss; set router_aux_loss_coef=0 (or "
                         "output_router_logits=False).")
    if pipeline_parallel_size > 1:
        raise ValueError(f"router_aux_loss_coef={coef} with output_router_logits: transformers' router "
                         "load-balancing loss spans the MoE layers of one forward, which pipeline_parallel_size="
                         f"{pipeline_parallel_size} puts on several stages; not supported. Use "
                         "pipeline_parallel_size=1, or train without it (router_aux_loss_coef=0 or "
                         "output_router_logits=False in the config; SFTConfig(router_aux_loss_coef=0.0) for "
                         "LoongSFTTrainer).")


def active(model, output_router_logits: bool | None = None) -> tuple[RouterBalance, float] | None:
    """(the model's ``RouterBalance``, coefficient) when its config asks for the loss now (trl may switch it on after
    loading), or a forward's ``output_router_logits`` keyword does (it overrides the config's, as in transformers);
    None otherwise. Raises as ``check_layout``."""
    config = model.config
    if output_router_logits is None:
        coef = router_aux_loss_coef_of(config)
    else:
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if output_router_logits else 0.0
    check_layout(config, model.bridge, pipeline_parallel_size=model.parallel.pipeline_parallel_size, coef=coef)
    balance = getattr(model, "router_balance", None)
    if balance is None or not coef:
        if balance is not None:
            balance.end()
        return None
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
