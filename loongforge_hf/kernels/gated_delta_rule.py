"""The gated delta rule (Gated DeltaNet's linear attention: Qwen3.5, Qwen3-Next) in torch, chunked, fp32 state.

Choices:
- Per value head a state ``S`` of ``[k_dim, v_dim]``, zero at the start of a call unless ``initial_state`` is given
  (training and uncached forwards: no state comes in or goes out). Token ``t`` decays it by ``exp(g_t)``
  (``g_t <= 0``), writes the correction ``u_t = beta_t (v_t - (exp(g_t) S)^T k_t)`` along ``k_t`` and reads
  ``o_t = S_t^T q_t``.
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
  compare with transformers' chunked and recurrent torch code). Autograd differentiates it as written but for
  the state's pass from chunk to chunk (``state_pass``: its own backward, a Triton kernel each way where
  ``_triton.use_triton`` allows, else a torch loop over the chunks; autograd through a per-chunk loop kept a
  full-size gradient per chunk slice and launched ~20 ops per chunk: on an H200 one 4096-token row of Qwen3.5's 32
  value heads took ~100 ms of host time for 33 ms of device time).
- Inputs in any dtype; the output in the query's dtype, rounded once at the end; the final state in fp32.
"""

from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (fla's convention, as transformers')."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, *, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False):
    """``query`` / ``key`` ``[batch, seq, k_heads, k_dim]``, ``value`` ``[batch, seq, v_heads, v_dim]``, ``g`` (log
    decay) and ``beta`` ``[batch, seq, v_heads]`` -> ``[batch, seq, v_heads, v_dim]``, and the final state
    ``[batch, v_heads, k_dim, v_dim]`` (fp32) after it when ``output_final_state``; ``initial_state``: the state
    before the first token (None: zero). See the module docstring."""
    batch, seq, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[2:]
    if v_heads % k_heads:
        raise ValueError(f"gated_delta_rule: {v_heads} value heads do not group over {k_heads} key heads.")
    if initial_state is not None and tuple(initial_state.shape) != (batch, v_heads, k_dim, v_dim):
        raise ValueError(f"gated_delta_rule: initial_state of shape {tuple(initial_state.shape)}, expected "
                         f"{(batch, v_heads, k_dim, v_dim)} [batch, v_heads, k_dim, v_dim].")
    out_dtype = query.dtype
    q = l2_normalize(query.float()) * k_dim ** -0.5
    k = l2_normalize(key.float())
    if v_heads != k_heads:
        q, k = (x.repeat_interleave(v_heads // k_heads, dim=2) for x in (q, k))
    # NOTE: [batch, heads, seq, ...] from here on
    q, k, v = (x.transpose(1, 2) for x in (q, k, value.float()))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    state = q.new_zeros(batch, v_heads, k_dim, v_dim) if initial_state is None else initial_state.float()
    if seq == 1 and initial_state is not None:
        out, state = _step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], state)
        out = out[:, None].to(out_dtype)
        return (out, state) if output_final_state else out
    pad = (-seq) % chunk_size
    if pad:  # NOTE: zero tokens at the end (no decay, no write) change nothing before them
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    chunks = (seq + pad) // chunk_size
    q, k, v = (x.reshape(batch, v_heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, v_heads, chunks, chunk_size) for x in (g, beta))

    running = g.cumsum(dim=-1)                                              # G: the decay since the chunk's start
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # NOTE: exp(G_t - G_j) for j <= t, 0 above the diagonal (masked before exp: the differences there are >= 0)
    pair_decay = (running[..., :, None] - running[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay                 # A below the diagonal (unitriangular solve)
    solve = dict(upper=False, unitriangular=True)
    u_free = torch.linalg.solve_triangular(system, v * beta[..., None], **solve)           # U with S0 = 0
    u_state = torch.linalg.solve_triangular(system, k_beta * running.exp()[..., None], **solve)  # U's S0 factor
    within = (q @ k.transpose(-1, -2)) * pair_decay                      # reads of this chunk's writes
    q_from_start = q * running.exp()[..., None]                           # reads of S0
    k_to_end = k * (running[..., -1:] - running).exp()[..., None]         # writes as seen at the chunk's end

    states, fresh, state = state_pass(u_state, u_free, k_to_end, running[..., -1].exp(), state)
    out = (q_from_start @ states + within @ fresh).reshape(batch, v_heads, chunks * chunk_size, -1)[:, :, :seq]
    out = out.transpose(1, 2).to(out_dtype)
    return (out, state) if output_final_state else out


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's recurrence: ``q`` / ``k`` ``[b, h, k_dim]`` (normalised, grouped), ``v`` ``[b, h, v_dim]``,
    ``g`` / ``beta`` ``[b, h]``, ``state`` ``[b, h, k_dim, v_dim]`` -> its output ``[b, h, v_dim]``, the new state."""
    state = state * g.exp()[..., None, None]
    u = beta[..., None] * (v - (k[..., None, :] @ state)[..., 0, :])
    state = state + k[..., :, None] * u[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


def state_pass(w: torch.Tensor, u: torch.Tensor, k_end: torch.Tensor, decay: torch.Tensor,
               initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential part of the chunked rule, per row and value head, ``n`` chunks of ``c`` tokens: from ``S_0 =
    initial`` ``[b, h, k, v]``, chunk ``i`` writes ``F_i = u_i - w_i S_i`` (``u`` ``[b, h, n, c, v]``: its corrections
    from a zero state; ``w`` ``[b, h, n, c, k]``: their dependence on the state) and leaves ``S_{i+1} = decay_i S_i +
    k_end_i^T F_i`` (``k_end`` ``[b, h, n, c, k]``, ``decay`` ``[b, h, n]``). Returns (each chunk's starting state
    ``S_i`` ``[b, h, n, k, v]``, ``F`` ``[b, h, n, c, v]``, the final state), fp32, differentiable in every input."""
    return _StatePass.apply(*(t.float().contiguous() for t in (w, u, k_end, decay, initial)))


class _StatePass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, u, k_end, decay, initial):
        from loongforge_hf.kernels._triton import use_triton

        ctx.triton = use_triton(w)
        if ctx.triton:
            from loongforge_hf.kernels import _delta_rule_triton

            states, fresh, final = _delta_rule_triton.state_pass_forward(w, u, k_end, decay, initial)
        else:
            states, fresh, final = _state_pass_loop(w, u, k_end, decay, initial)
        ctx.save_for_backward(w, k_end, decay, states, fresh)
        return states, fresh, final

    @staticmethod
    def backward(ctx, d_states, d_fresh, d_final):
        w, k_end, decay, states, fresh = ctx.saved_tensors
        d_states, d_fresh, d_final = (t.contiguous() for t in (d_states, d_fresh, d_final))
        if ctx.triton:
            from loongforge_hf.kernels import _delta_rule_triton

            d_u, d_next, d_initial = _delta_rule_triton.state_pass_backward(w, k_end, decay, d_states, d_fresh,
                                                                            d_final)
        else:
            d_u, d_next, d_initial = _state_pass_loop_backward(w, k_end, decay, d_states, d_fresh, d_final)
        # NOTE: the rest has no chunk-to-chunk dependence: one batched product each
        d_w = -(d_u @ states.transpose(-1, -2))
        d_k_end = fresh @ d_next.transpose(-1, -2)
        d_decay = (states * d_next).sum(dim=(-1, -2))
        return d_w, d_u, d_k_end, d_decay, d_initial


def _state_pass_loop(w, u, k_end, decay, state):
    """``state_pass`` in torch, one chunk at a time (no autograd: ``_StatePass`` holds the backward)."""
    states = w.new_empty(*w.shape[:3], *state.shape[-2:])
    fresh = torch.empty_like(u)
    for i in range(w.shape[2]):
        states[:, :, i] = state
        fresh[:, :, i] = u[:, :, i] - w[:, :, i] @ state
        state = state * decay[:, :, i, None, None] + k_end[:, :, i].transpose(-1, -2) @ fresh[:, :, i]
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
        d_state = (d_state * decay[:, :, i, None, None] - w[:, :, i].transpose(-1, -2) @ d_u[:, :, i]
                   + d_states[:, :, i])
    return d_u, d_next, d_state
