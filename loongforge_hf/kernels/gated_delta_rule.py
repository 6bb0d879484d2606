"""The gated delta rule (Gated DeltaNet's linear attention: Qwen3.5, Qwen3-Next; Kimi Delta Attention's per-channel
form) in torch, chunked, fp32 state.

Choices:
- Per value head a state ``S`` of ``[k_dim, v_dim]``, zero at the start of a call unless ``initial_state`` is given
  (training and uncached forwards: no state comes in or goes out). Token ``t`` decays it by ``exp(g_t)``
  (``g_t <= 0``), writes the correction ``u_t = beta_t (v_t - (exp(g_t) S)^T k_t)`` along ``k_t`` and reads
  ``o_t = S_t^T q_t``.
- Per-channel decay (Kimi Delta Attention): ``g`` ``[batch, seq, v_heads, k_dim]`` decays each key row of the state
  by its own ``exp(g_t[c])`` (``diag(exp(g_t)) S``). The chunked form is the same with the pair decays
  ``exp(G_t - G_j)`` taken per key channel inside the products ``k_t . k_j`` and ``q_t . k_j`` (a ``[chunk, chunk,
  k_dim]`` tensor per chunk, as transformers' torch code: no ``exp(-G)`` factor that could overflow under a strong
  decay), the chunk's decay a ``[k_dim]`` vector; ``state_pass`` runs the torch loop for it (its Triton kernel takes
  a per-head decay only).
- A cached generate carries the state from call to call (``bridges/gated_deltanet.py``): ``initial_state`` /
  ``output_final_state`` (``[batch, v_heads, k_dim, v_dim]``, fp32). A call of one token with a state coming in (a
  decode step) runs that token's recurrence step directly (the chunked form would pad it to a whole chunk).
- q and k are L2-normalised over their channels as ``x * rsqrt(sum(x^2) + 1e-6)`` and q is scaled by
  ``k_dim^-1/2`` (transformers' torch fallback, which follows the fla kernels), all in fp32.
- Grouped value heads: q / k head ``i`` serves value heads ``i * r .. i * r + r - 1`` (``r = v_heads / k_heads``).
- Chunked form: inside a chunk of ``chunk_size`` tokens the corrections ``U`` solve one unit lower-triangular system
  ``(I + A) U = beta V - beta exp(G) K S0`` (``A[t, j] = beta_t exp(G_t - G_j) k_t . k_j`` for ``j < t``, ``G`` the
  decay's running sum inside the chunk, ``S0`` the state at the chunk's start), so the only loop is over chunks; the
  state crosses chunks in fp32. The same numbers as the token-by-token recurrence up to fp32 rounding (the tests
  compare with transformers' chunked and recurrent torch code).
- Backward (``_ChunkedRule``): the state's pass from chunk to chunk (``state_pass``) has a hand-written backward, a
  Triton kernel each way where ``_triton.use_triton`` allows, else a torch loop over the chunks (autograd through a
  per-chunk loop kept a full-size gradient per chunk slice and launched ~20 ops per chunk: on an H200 one
  4096-token row of Qwen3.5's 32 value heads took ~100 ms of host time for 33 ms of device time). The batched rest
  is recomputed in the backward from the inputs and differentiated by autograd there: the forward keeps only the
  inputs, each chunk's starting state and corrections.
- Inputs in any dtype; the output in the query's dtype, rounded once at the end; the final state in fp32.
"""

from __future__ import annotations

import functools

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (fla's convention, as transformers')."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, *, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False):
    """``query`` / ``key`` ``[batch, seq, k_heads, k_dim]``, ``value`` ``[batch, seq, v_heads, v_dim]``, ``g`` (log
    decay: ``[batch, seq, v_heads]``, or ``[batch, seq, v_heads, k_dim]`` per key channel) and ``beta``
    ``[batch, seq, v_heads]`` -> ``[batch, seq, v_heads, v_dim]``, and the final state
    ``[batch, v_heads, k_dim, v_dim]`` (fp32) after it when ``output_final_state``; ``initial_state``: the state
    before the first token (None: zero). See the module docstring."""
    batch, seq, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[2:]
    if v_heads % k_heads:
        raise ValueError(f"gated_delta_rule: {v_heads} value heads do not group over {k_heads} key heads.")
    if initial_state is not None and tuple(initial_state.shape) != (batch, v_heads, k_dim, v_dim):
        raise ValueError(f"gated_delta_rule: initial_state of shape {tuple(initial_state.shape)}, expected "
                         f"{(batch, v_heads, k_dim, v_dim)} [batch, v_heads, k_dim, v_dim].")
    if seq == 1 and initial_state is not None:
        q, k = _normalized(query, key)
        if v_heads != k_heads:
            q, k = (x.repeat_interleave(v_heads // k_heads, dim=2) for x in (q, k))
        out, state = _step(q[:, 0], k[:, 0], value[:, 0].float(), g[:, 0].float(), beta[:, 0].float(),
                           initial_state.float())
        out = out[:, None].to(query.dtype)
        return (out, state) if output_final_state else out
    state = key.new_zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float32) if initial_state is None \
        else initial_state.float()
    out, state = _ChunkedRule.apply(query, key, value, g.float(), beta.float(), state, chunk_size, query.dtype)
    return (out, state) if output_final_state else out


def gated_delta_rule_packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, bounds: list[list[int]], *, chunk_size: int = 64) -> torch.Tensor:
    """``gated_delta_rule`` over rows that pack documents, every document from a zero state, in one call: ``bounds``
    holds each row's document bounds ``[0, .., seq]``. Each document is laid out on whole chunks of its own (zero
    tokens after it: no decay, no write), the documents' chunks side by side in one sequence, and the state is not
    carried past a document's last chunk; the outputs are read back in place. The same numbers as one call per
    document (fp32 rounding apart) without a call per document."""
    batch, seq = key.shape[:2]
    if len(bounds) != batch or any(b[0] != 0 or b[-1] != seq or sorted(b) != b for b in bounds):
        raise ValueError(f"gated_delta_rule_packed: bounds {bounds} are not {batch} rows of sorted document bounds "
                         f"from 0 to {seq}.")
    slots, places, carry = _packed_layout(tuple(map(tuple, bounds)), seq, chunk_size, key.device)
    q, k, v, gl, bl = (in_slots(x, slots)[None] for x in (query, key, value, g.float(), beta.float()))
    initial = key.new_zeros(1, value.shape[2], key.shape[-1], value.shape[-1], dtype=torch.float32)
    out, _ = _ChunkedRule.apply(q, k, v, gl, bl, initial, chunk_size, query.dtype, carry)
    return out[0][places].reshape(batch, seq, *out.shape[2:])


@functools.lru_cache(maxsize=32)
def document_slots(bounds: tuple, seq: int, device: torch.device, *, lead: int = 0, multiple: int = 1):
    """Each row's documents (``bounds``: each row's ``[0, .., seq]``) laid out one after another, each after ``lead``
    zero slots and followed by zero slots up to a multiple of ``multiple`` slots: (the token of each slot, ``rows *
    seq`` for a zero; the slot of each token; the slot after each document's last), kept for the next layers of a
    forward (same bounds)."""
    zero, slots, places, ends = len(bounds) * seq, [], [], []
    for row, cuts in enumerate(bounds):
        for lo, hi in zip(cuts, cuts[1:]):
            if hi > lo:
                slots += [zero] * lead
                places += range(len(slots), len(slots) + hi - lo)
                slots += range(row * seq + lo, row * seq + hi)
                ends.append(len(slots))
                slots += [zero] * (-len(slots) % multiple)
    return tuple(torch.tensor(t, dtype=torch.long, device=device) for t in (slots, places, ends))


def in_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, seq, ...]`` laid out by ``document_slots``' slots: ``[slots, ...]``, zeros in the gaps."""
    flat = x.reshape(-1, *x.shape[2:])
    return torch.cat((flat, flat.new_zeros(1, *flat.shape[1:])))[slots]


@functools.lru_cache(maxsize=16)
def _packed_layout(bounds: tuple, seq: int, chunk_size: int, device: torch.device):
    """``gated_delta_rule_packed``'s layout: documents on whole chunks of their own (slots, places) and the carry mask
    of the chunks (0 after a document's last)."""
    slots, places, ends = document_slots(bounds, seq, device, multiple=chunk_size)
    carry = torch.ones(slots.numel() // chunk_size, device=device).index_fill_(0, (ends - 1) // chunk_size, 0.0)
    return slots, places, carry


def _normalized(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k L2-normalised in fp32, q scaled by ``k_dim^-1/2``."""
    return l2_normalize(query.float()) * query.shape[-1] ** -0.5, l2_normalize(key.float())


def _layout(q, k, v, g, beta, chunk_size: int):
    """``[b, s, heads, dim]`` (q / k on their key heads; ``g`` ``[b, s, heads]`` or per key channel) ->
    ``[b, v_heads, chunks, chunk, ...]`` fp32, q / k
    normalised and grouped onto the value heads, the sequence padded with zero tokens to whole chunks (no decay, no
    write: they change nothing before them)."""
    batch, seq, k_heads, _ = k.shape
    v_heads = v.shape[2]
    q, k = _normalized(q, k)
    if v_heads != k_heads:
        q, k = (x.repeat_interleave(v_heads // k_heads, dim=2) for x in (q, k))
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))        # NOTE: [batch, heads, seq, ...] from here on
    g, beta = (x.transpose(1, 2) for x in (g, beta))
    pad = (-seq) % chunk_size
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = torch.nn.functional.pad(g, (0, 0, 0, pad) if g.dim() == 4 else (0, pad))
        beta = torch.nn.functional.pad(beta, (0, pad))
    chunks = (seq + pad) // chunk_size
    q, k, v = (x.reshape(batch, v_heads, chunks, chunk_size, -1) for x in (q, k, v))
    g = g.reshape(batch, v_heads, chunks, chunk_size, *g.shape[3:])
    return q, k, v, g, beta.reshape(batch, v_heads, chunks, chunk_size)


def _prepare(q, k, v, g, beta, chunk_size: int, carry: torch.Tensor | None = None):
    """Everything of the chunked form without a chunk-to-chunk dependence (batched over chunks), from the rule's
    inputs: (``state_pass``'s w, u, k_end and decay; q as it reads a chunk's starting state; the reads of the chunk's
    own writes ``[.., chunk, chunk]``). ``carry`` ``[chunks]`` (None: all 1): 0 after a chunk whose state the next
    one must not see (a document's last chunk: the next starts from zero)."""
    q, k, v, g, beta = _layout(q, k, v, g, beta, chunk_size)
    per_channel = g.dim() == 5
    # NOTE: G, the decay since the chunk's start, [.., chunk, k_dim] per key channel, else [.., chunk, 1]
    running = g.cumsum(dim=-2) if per_channel else g.cumsum(dim=-1)[..., None]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    k_beta = k * beta[..., None]
    # NOTE: exp(G_t - G_j) for j <= t, 0 above the diagonal (masked before exp: the differences there are >= 0)
    if per_channel:
        pair_decay = (running[..., :, None, :] - running[..., None, :, :]).masked_fill(
            ~lower[..., None], float("-inf")).exp()                          # [.., chunk, chunk, k_dim]
        system = (k_beta[..., :, None, :] * k[..., None, :, :] * pair_decay).sum(-1)
        within = (q[..., :, None, :] * k[..., None, :, :] * pair_decay).sum(-1)
    else:
        pair_decay = (running[..., :, None, 0] - running[..., None, :, 0]).masked_fill(~lower, float("-inf")).exp()
        system = (k_beta @ k.transpose(-1, -2)) * pair_decay             # A below the diagonal (unitriangular solve)
        within = (q @ k.transpose(-1, -2)) * pair_decay                  # reads of this chunk's writes
    solve = dict(upper=False, unitriangular=True)
    u_free = torch.linalg.solve_triangular(system, v * beta[..., None], **solve)           # U with S0 = 0
    u_state = torch.linalg.solve_triangular(system, k_beta * running.exp(), **solve)        # U's S0 factor
    q_from_start = q * running.exp()                                      # reads of S0
    k_to_end = k * (running[..., -1:, :] - running).exp()                 # writes as seen at the chunk's end
    decay = running[..., -1, :].exp() if per_channel else running[..., -1, 0].exp()
    if carry is not None:
        k_to_end, decay = k_to_end * carry[:, None, None], decay * (carry[:, None] if per_channel else carry)
    return u_state, u_free, k_to_end, decay, q_from_start, within


def _chunked_grad(d_out: torch.Tensor, seq: int, chunk_size: int) -> torch.Tensor:
    """The output's gradient ``[b, s, v_heads, v_dim]`` in the chunked layout (fp32, zero on the padding)."""
    d = d_out.float().transpose(1, 2)
    pad = (-seq) % chunk_size
    if pad:
        d = torch.nn.functional.pad(d, (0, 0, 0, pad))
    return d.reshape(*d.shape[:2], -1, chunk_size, d.shape[-1])


class _ChunkedRule(torch.autograd.Function):
    """The chunked rule from q / k (key heads), values, log decays and betas as given: (output in ``out_dtype``, final
    state). Keeps only its inputs, the chunks' starting states and corrections for the backward (0.25 GiB for a
    4096-token row of Qwen3.5's 32 value heads in bf16, where autograd through the batched algebra kept 1.2 GiB) and
    recomputes the batched part there (no chunk-to-chunk dependence: cheap against the pass it saves)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial, chunk_size, out_dtype, carry=None):
        w, u, k_end, decay, q_start, within = _prepare(q, k, v, g, beta, chunk_size, carry)
        states, fresh, final = state_pass(w, u, k_end, decay, initial)
        out = q_start @ states + within @ fresh
        seq = q.shape[1]
        out = out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :seq].transpose(1, 2).to(out_dtype)
        ctx.chunk_size, ctx.carry = chunk_size, carry
        ctx.save_for_backward(q, k, v, g, beta, states, fresh)
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta, states, fresh = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
            w, u, k_end, decay, q_start, within = _prepare(*leaves, ctx.chunk_size, ctx.carry)
        d = _chunked_grad(d_out, q.shape[1], ctx.chunk_size)
        d_states, d_fresh = q_start.detach().transpose(-1, -2) @ d, within.detach().transpose(-1, -2) @ d
        d_w, d_u, d_k_end, d_decay, d_initial = _state_pass_grads(w.detach(), k_end.detach(), decay.detach(), states,
                                                                  fresh, d_states, d_fresh, d_final.float())
        grads = torch.autograd.grad((w, u, k_end, decay, q_start, within), leaves,
                                    (d_w, d_u, d_k_end, d_decay, d @ states.transpose(-1, -2),
                                     d @ fresh.transpose(-1, -2)))
        return (*grads, d_initial, None, None, None)


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's recurrence: ``q`` / ``k`` ``[b, h, k_dim]`` (normalised, grouped), ``v`` ``[b, h, v_dim]``,
    ``g`` ``[b, h]`` (or ``[b, h, k_dim]``), ``beta`` ``[b, h]``, ``state`` ``[b, h, k_dim, v_dim]`` -> its output
    ``[b, h, v_dim]``, the new state."""
    state = state * _decay_rows(g.exp())
    u = beta[..., None] * (v - (k[..., None, :] @ state)[..., 0, :])
    state = state + k[..., :, None] * u[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


def state_pass(w: torch.Tensor, u: torch.Tensor, k_end: torch.Tensor, decay: torch.Tensor,
               initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential part of the chunked rule, per row and value head, ``n`` chunks of ``c`` tokens: from ``S_0 =
    initial`` ``[b, h, k, v]``, chunk ``i`` writes ``F_i = u_i - w_i S_i`` (``u`` ``[b, h, n, c, v]``: its corrections
    from a zero state; ``w`` ``[b, h, n, c, k]``: their dependence on the state) and leaves ``S_{i+1} = decay_i S_i +
    k_end_i^T F_i`` (``k_end`` ``[b, h, n, c, k]``, ``decay`` ``[b, h, n]``, or ``[b, h, n, k]`` per key row of the
    state). Returns (each chunk's starting state
    ``S_i`` ``[b, h, n, k, v]``, ``F`` ``[b, h, n, c, v]``, the final state), fp32, without autograd
    (``_state_pass_grads`` is its backward): a Triton kernel where ``_triton.use_triton`` allows, else a torch loop."""
    from loongforge_hf.kernels._triton import use_triton

    w, u, k_end, decay, initial = (t.detach().float().contiguous() for t in (w, u, k_end, decay, initial))
    if use_triton(w) and decay.dim() == 3:
        from loongforge_hf.kernels import _delta_rule_triton

        return _delta_rule_triton.state_pass_forward(w, u, k_end, decay, initial)
    with torch.no_grad():
        return _state_pass_loop(w, u, k_end, decay, initial)


def _state_pass_grads(w, k_end, decay, states, fresh, d_states, d_fresh, d_final):
    """``state_pass``'s backward: the gradients of (w, u, k_end, decay, initial) from those of its three outputs."""
    from loongforge_hf.kernels._triton import use_triton

    w, k_end, decay, d_states, d_fresh, d_final = (
        t.contiguous() for t in (w, k_end, decay, d_states, d_fresh, d_final))
    if use_triton(w) and decay.dim() == 3:
        from loongforge_hf.kernels import _delta_rule_triton

        d_u, d_next, d_initial = _delta_rule_triton.state_pass_backward(w, k_end, decay, d_states, d_fresh, d_final)
    else:
        with torch.no_grad():
            d_u, d_next, d_initial = _state_pass_loop_backward(w, k_end, decay, d_states, d_fresh, d_final)
    # NOTE: the rest has no chunk-to-chunk dependence: one batched product each
    d_w = -(d_u @ states.transpose(-1, -2))
    d_k_end = fresh @ d_next.transpose(-1, -2)
    d_decay = (states * d_next).sum(dim=-1)
    if decay.dim() == 3:
        d_decay = d_decay.sum(dim=-1)
    return d_w, d_u, d_k_end, d_decay, d_initial


def _state_pass_loop(w, u, k_end, decay, state):
    """``state_pass`` in torch, one chunk at a time."""
    states = w.new_empty(*w.shape[:3], *state.shape[-2:])
    fresh = torch.empty_like(u)
    for i in range(w.shape[2]):
        states[:, :, i] = state
        fresh[:, :, i] = u[:, :, i] - w[:, :, i] @ state
        state = state * _decay_rows(decay[:, :, i]) + k_end[:, :, i].transpose(-1, -2) @ fresh[:, :, i]
    return states, fresh, state


def _state_pass_loop_backward(w, k_end, decay, d_states, d_fresh, d_final):
    """The reverse walk of ``state_pass``'s backward in torch: (d_u, the gradient of the state after each chunk,
    d_initial)."""
    d_u = torch.empty_like(d_fresh)
    d_next = w.new_empty(*w.shape[:3], *d_final.shape[-2:])
    d_state = d_final
    for i in reversed(range(w.shape[2])):
        d_next[:, :, i] = d_state
        d_u[:, :, i] = d_fresh[:, :, i] + k_end[:, :, i] @ d_state
        d_state = (d_state * _decay_rows(decay[:, :, i]) - w[:, :, i].transpose(-1, -2) @ d_u[:, :, i]
                   + d_states[:, :, i])
    return d_u, d_next, d_state


def _decay_rows(decay: torch.Tensor) -> torch.Tensor:
    """A step's decay ``[b, h]`` (per head) or ``[b, h, k]`` (per key row) as a factor of states ``[b, h, k, v]``."""
    return decay[..., None, None] if decay.dim() == 2 else decay[..., None]
