"""One forward's tally of transformers' router load-balancing loss and its gradient hand-in (the choices are in
``router_balance.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumsGrad(torch.autograd.Function):
    """Identity on the router's probabilities; its backward gives the layer's probability sums the gradient of the
    loss the tally's ``aux_loss`` went into (``_AuxOut``), times ``d aux / d sums``."""

    @staticmethod
    def forward(ctx, probs, sums, tally):
        ctx.tally = tally
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        return grad_probs, ctx.tally.grad_sums, None


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
        tally = ctx.tally
        tally.grad_sums = grad.float() * tally.sums_grad
        if tally.link is not None:
            tally.link.send_prev(tally.grad_sums)  # NOTE: the earlier stages' layers (pipeline parallelism)
        return None, None, None


class Tally:
    """One forward's router sums: per layer ``[slot counts (E), probability sums (E), weight sum]``."""

    def __init__(self, weights: torch.Tensor, experts: int, device, link=None) -> None:
        self.weights = weights          # [batch, this rank's tokens] before sequence parallelism
        self.layers: list[torch.Tensor] = []
        self.open = True                # False once finished: a recomputed forward only attaches the gradient
        self.group = None               # the ranks that split this forward's tokens
        self.experts = experts
        self.device = device
        self.link = link                # pipeline parallelism: the stages' side channel (parallel/stage_link.py)
        self.sums_grad: torch.Tensor | None = None  # d aux / d (each layer's probability sums)
        self.grad_sums: torch.Tensor | None = None  # d objective / d (each layer's sums), set in the backward
        self.with_grad = torch.is_grad_enabled()   # begun by a forward that builds a graph
        self.routed = 0                 # layers tallied (while open)
        self.attached = 0               # layers whose gradient hand-in points at this tally

    def _local_weights(self, router, rows: int) -> torch.Tensor:
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
        w = self._local_weights(router, logits.shape[0]).to(scores)
        counts, sums = (routing_map.float() * w[:, None]).sum(0), (scores * w[:, None]).sum(0)
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

    def _stage_total(self) -> torch.Tensor:
        """This stage's layers' sums (over the ranks that split the tokens), then none left."""
        total = torch.zeros(2 * self.experts + 1, device=self.device)
        if self.layers:
            total = torch.stack(self.layers).sum(0)
            if self.group is not None and self.group.size() > 1:
                dist.all_reduce(total, group=self.group)
        self.layers = []
        return total

    def pass_on(self, output: torch.Tensor, first: bool) -> None:
        """The end of a pipeline stage's forward (not the last stage's): hand the sums on to the next stage; in a
        forward that builds a graph, close the tally and receive the layers' gradient where the backward starts."""
        total = self._stage_total()
        if not first:
            total += self.link.recv_prev(total)
        self.link.send_next(total)
        if torch.is_grad_enabled():
            self.open = False
            if self.with_grad and output.requires_grad:
                output.register_hook(lambda grad: self._grad_from_next(first))

    def _grad_from_next(self, first: bool) -> None:
        self.grad_sums = self.link.recv_next(torch.zeros(self.experts, device=self.device))
        if not first:
            self.link.send_prev(self.grad_sums)

    def finish(self) -> torch.Tensor:
        """The forward's balancing loss (fp32 scalar), on its last pipeline stage; in the graph (``_AuxOut``) when
        the forward builds one, so a loss that adds ``coef * aux`` (and anything scaling that loss) sends the
        routers their gradient."""
        self.open = False
        if not self.layers and self.link is None:
            raise RuntimeError("router balance: no MoE layer routed any token in this forward.")
        total = self._stage_total()
        if self.link is not None:
            total += self.link.recv_prev(total)
        experts = self.experts
        rows = total[-1].clamp(min=1.0)
        fraction = total[:experts] / rows
        loss = experts * (fraction * total[experts:2 * experts] / rows).sum()
        self.sums_grad = (fraction * (experts / rows)).to(total.dtype)
        if not (self.with_grad and torch.is_grad_enabled()):
            return loss
        anchor = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        return _AuxOut.apply(loss, anchor, self)
