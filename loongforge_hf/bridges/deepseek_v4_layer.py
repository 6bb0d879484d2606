"""DeepSeek-V4's decoder layer around megatron's MoE layer: manifold-constrained hyper-connections (``hc_mult``
residual streams), our attention module (``deepseek_v4_attention.py``), and the routers' rules (``sqrtsoftplus``
scores, hash routing by token id).

Choices:
- The residual is ``hc_mult`` streams, carried between megatron's layers as one ``[s, b, hc_mult * H]`` tensor; the
  first layer expands the embedding ``[s, b, H]`` into equal streams, and the decoder's final norm is ``Head``:
  transformers' ``DeepseekV4HyperHead`` (the streams collapsed by their sigmoid weights) then the RMS norm. Under
  pipeline parallelism a stage boundary carries the streams ``[s, b, hc_mult * H]`` (the bridges'
  ``pipeline_hidden_size``, read by ``stage_boundary``): the first stage's first layer expands the embedding, a later
  stage's first layer takes the streams it receives, and only the last stage has the hyper-head.
- ``HyperConnection`` is transformers' (fp32 weights, unweighted RMS norm of the flattened streams, sigmoid ``pre`` /
  ``2 * sigmoid`` ``post``, the ``comb`` softmax made doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn steps).
  Its weights act on this rank's tokens: under sequence parallelism their gradients are summed over TP
  (``sequence_parallel``), as the norms'. With ``comb=False`` it is HY-V4's ``HYV4HyperConnection`` (``pre`` /
  ``post`` only, ``post = hc_magnitude * sigmoid + hc_eps``): the streams pass on unmixed, the sum taken in fp32.
- HY-V4 (``v4_layer(..., attention=False)``) keeps the spec's attention (megatron's MLA with sparse attention,
  ``hy_v4.py``) in the attention slot.
- The MLP slot is megatron's ``MoELayer`` (router, token dispatcher, ``SequentialMLP`` experts with megatron's clamped
  SwiGLU, the shared expert split over TP). Top-k layers: megatron's router as ``router_balance.BalanceRouter`` with
  ``route_topk`` as its ``route`` (transformers' ``DeepseekV4TopKRouter``: ``sqrt(softplus(logits))``, top k of the
  scores plus the fixed ``e_score_correction_bias``, renormalised, times ``routed_scaling_factor``), so transformers'
  ``router_logits`` and balancing loss count them. Hash layers: ``HashRouter`` with ``route_hash`` (transformers'
  ``DeepseekV4HashRouter``: the experts ``tid2eid[input_id]``, a frozen ``[vocab, k]`` int64 buffer, weighted
  alike), left out of both as transformers leaves them. The token ids reach it through a pre-hook on the model's
  forward (``attach_routing``), this rank's sequence slice under sequence parallelism, in megatron's ``[s, b]``
  order (packed documents are refused before, on the whole batch: ``DeepseekV4Bridge.check_position_ids``). The ids
  of the last forward are kept for an activation-recompute pass of the same micro-batch.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.deepseek_v4_attention import rms_norm


class HyperConnection(torch.nn.Module):
    """transformers' ``DeepseekV4HyperConnection``: ``forward(streams [s, b, n, H])`` -> ``(post [s, b, n], comb
    [s, b, n, n], collapsed [s, b, H])``; with ``comb=False`` ``HYV4HyperConnection`` (comb None)."""

    def __init__(self, hf_config, *, sequence_parallel: bool, comb: bool = True) -> None:
        super().__init__()
        n, self.hc_eps, self.eps, self.comb = hf_config.hc_mult, hf_config.hc_eps, hf_config.rms_norm_eps, comb
        self.iters = hf_config.hc_sinkhorn_iters if comb else 0
        self.post_scale, self.post_eps = (2.0, 0.0) if comb else (float(hf_config.hc_magnitude), hf_config.hc_eps)
        rows = (2 + n) * n if comb else 2 * n
        self.fn = torch.nn.Parameter(torch.empty(rows, n * hf_config.hidden_size, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.empty(rows, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.empty(3 if comb else 2, dtype=torch.float32))
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel

    def forward(self, streams: torch.Tensor):
        n = streams.shape[-2]
        sizes = [n, n, n * n] if self.comb else [n, n]
        mixed = F.linear(rms_norm(streams.flatten(-2).float(), None, self.eps), self.fn.float())
        pre_w, post_w, *comb_w = mixed.split(sizes, dim=-1)
        pre_b, post_b, *comb_b = self.base.split(sizes)
        pre_s, post_s, *comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = self.post_scale * torch.sigmoid(post_w * post_s + post_b) + self.post_eps
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        if not self.comb:
            return post, None, collapsed
        comb = torch.softmax(comb_w[0].unflatten(-1, (n, n)) * comb_s[0] + comb_b[0].view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return post, comb, collapsed


def mix(post: torch.Tensor, comb: torch.Tensor | None, output: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block's output spread over the streams plus the streams mixed by ``comb`` (transformers' layer), or
    unmixed where ``comb`` is None (HY-V4's layer, in fp32)."""
    dtype = streams.dtype
    if comb is None:
        return (post.float().unsqueeze(-1) * output.float().unsqueeze(-2) + streams.float()).to(dtype)
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + mixed


class Head(torch.nn.Module):
    """The decoder's final norm: transformers' ``DeepseekV4HyperHead`` then ``model.norm`` (``[s, b, n * H]`` ->
    ``[s, b, H]``)."""

    def __init__(self, hf_config, *, sequence_parallel: bool) -> None:
        super().__init__()
        n, h = hf_config.hc_mult, hf_config.hidden_size
        self.n, self.eps, self.hc_eps = n, hf_config.rms_norm_eps, hf_config.hc_eps
        self.hc_fn = torch.nn.Parameter(torch.empty(n, n * h, dtype=torch.float32))
        self.hc_base = torch.nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = torch.nn.Parameter(torch.empty(1, dtype=torch.float32))
        self.weight = torch.nn.Parameter(torch.empty(h, dtype=torch.float32))
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        streams = x.unflatten(-1, (self.n, -1))
        mixes = F.linear(rms_norm(streams.flatten(-2).float(), None, self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(x.dtype)
        return rms_norm(collapsed, self.weight, self.eps)


@functools.cache
def _layer_class() -> type:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class DeepseekV4Layer(TransformerLayer):
        """megatron's layer (its norms and MoE from the spec) with our attention and two hyper-connections."""

        hf_config = None  # set on the subclass ``v4_layer`` makes
        own_attention, comb = True, True

        def __init__(self, config, submodules, layer_number: int = 1, **kwargs) -> None:
            from dataclasses import replace

            from megatron.core.transformer.spec_utils import ModuleSpec

            hf = self.hf_config
            if self.own_attention:
                submodules = replace(submodules, self_attention=ModuleSpec(module=_Attention,
                                                                           params={"hf_config": hf}))
            super().__init__(config, submodules, layer_number, **kwargs)
            sp = bool(config.sequence_parallel)
            self.attn_hc = HyperConnection(hf, sequence_parallel=sp, comb=self.comb)
            self.ffn_hc = HyperConnection(hf, sequence_parallel=sp, comb=self.comb)

        def forward(self, hidden_states, attention_mask=None, **kwargs):
            n, h = self.hf_config.hc_mult, self.hf_config.hidden_size
            if hidden_states.shape[-1] == h:  # NOTE: the first layer: the embedding as n equal streams
                streams = hidden_states.unsqueeze(-2).expand(*hidden_states.shape[:-1], n, h)
            else:
                streams = hidden_states.unflatten(-1, (n, h))
            post, comb, collapsed = self.attn_hc(streams)
            attended, _ = self.self_attention(self.input_layernorm(collapsed), attention_mask=attention_mask)
            streams = mix(post, comb, attended, streams)
            post, comb, collapsed = self.ffn_hc(streams)
            out, _ = self.mlp(self.pre_mlp_layernorm(collapsed))
            return mix(post, comb, out, streams).flatten(-2).contiguous(), None

    return DeepseekV4Layer


class _Attention(torch.nn.Module):
    """Builds ``DeepseekV4Attention`` in megatron's self-attention slot (megatron passes the layer number)."""

    def __new__(cls, config, layer_number: int, hf_config=None, **_):
        from loongforge_hf.bridges.deepseek_v4_attention import DeepseekV4Attention

        return DeepseekV4Attention(hf_config, layer=layer_number - 1, config=config)


def v4_layer(hf_config, *, attention: bool = True, comb: bool = True) -> type:
    """The layer class for megatron's block spec (``bridge.layer_module``); without ``attention`` the spec's attention
    module, without ``comb`` HY-V4's hyper-connections (module docstring)."""
    return type("DeepseekV4Layer", (_layer_class(),), {"hf_config": hf_config, "own_attention": attention,
                                                       "comb": comb})


def route_topk(logits: torch.Tensor, *, router, hf_config) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``DeepseekV4TopKRouter`` as megatron's (probs ``[T, E]``, map ``[T, E]``)."""
    scores = F.softplus(logits).sqrt()
    chosen = torch.topk(scores + router.expert_bias, hf_config.num_experts_per_tok, dim=-1).indices
    return _weights(scores, chosen, hf_config)


def route_hash(logits: torch.Tensor, *, router, hf_config, holder) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``DeepseekV4HashRouter``: the experts of each token's id (``router.tid2eid``)."""
    scores = F.softplus(logits).sqrt()
    ids = holder.input_ids  # [b, S]
    if ids is None:
        raise ValueError("DeepseekV4ForCausalLM's hash-routed layers choose experts by token id: pass input_ids "
                         "(not inputs_embeds).")
    b = ids.shape[0]
    s = logits.shape[0] // b
    start = holder.tp_rank * s if holder.sequence_parallel else 0
    local = ids[:, start:start + s].transpose(0, 1).reshape(-1)  # NOTE: megatron's [s, b] token order
    return _weights(scores, router.tid2eid[local.to(router.tid2eid.device)].long(), hf_config)


def _weights(scores: torch.Tensor, chosen: torch.Tensor, hf_config) -> tuple[torch.Tensor, torch.Tensor]:
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * hf_config.routed_scaling_factor
    probs = torch.zeros_like(scores).scatter(1, chosen, weights)
    return probs, torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)


def attach_routing(chunk, hf_config) -> None:
    """Give each router of ``chunk`` its rule and buffers (``expert_bias`` ``[E]`` fp32 or ``tid2eid`` ``[vocab,
    k]`` int64, filled by the loader) and keep the forward's input ids for the hash routers, which become
    ``HashRouter`` (not a ``BalanceRouter``: transformers' ``router_logits`` and balancing loss leave them out)."""
    from megatron.core import parallel_state as ps

    holder = SimpleNamespace(input_ids=None, tp_rank=ps.get_tensor_model_parallel_rank(),
                             sequence_parallel=bool(chunk.config.sequence_parallel))
    for layer in chunk.decoder.layers:
        router = layer.mlp.router
        del router.expert_bias  # NOTE: megatron's TopKRouter sets it to None without an expert bias
        if hf_config.mlp_layer_types[layer.layer_number - 1] == "hash_moe":  # NOTE: megatron's global number
            router.__class__ = _hash_router_class()
            router.register_buffer("tid2eid", torch.zeros(hf_config.vocab_size, hf_config.num_experts_per_tok,
                                                          dtype=torch.long))
            router.expert_bias = None
            router.route = functools.partial(route_hash, router=router, hf_config=hf_config, holder=holder)
        else:
            router.register_buffer("expert_bias", torch.zeros(hf_config.n_routed_experts, dtype=torch.float32))
            rule = functools.partial(route_topk, router=router, hf_config=hf_config)
            router.route = lambda logits, training, rule=rule: rule(logits)

    def keep_ids(module, args, kwargs):
        holder.input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    chunk.register_forward_pre_hook(keep_ids, with_kwargs=True)


@functools.cache
def _hash_router_class() -> type:
    from megatron.core.transformer.moe.router import TopKRouter

    class HashRouter(TopKRouter):
        """megatron's router whose choice is ``route`` (``route_hash``); it records and tallies nothing."""

        route = None

        def _apply_expert_bias(self, routing_map, padding_mask=None):
            pass

        def routing(self, logits, padding_mask=None):
            return self.route(logits.view(-1, self.config.num_moe_experts))

    return HashRouter
