"""``fp8="adaptive"``'s decisions: bf16 or FP8 for each GEMM of a linear layer, by shape, timed on the GPU in use.

Choices:
- Each distinct (GEMM, M, N, K) met is timed once, bf16 against FP8 with the quantisation included (the forward's
  FP8 time includes quantising ``w`` and ``w^T``, which the input-gradient GEMM then reuses), as the median of a few
  repetitions, best of three (``xpu`` backend's ``time_ms``).
- FP8 is used only where it saves at least ``MIN_SAVING_FRACTION`` of the bf16 time and ``MIN_SAVING_MS`` per call
  (``fp8_pays``). The timing sees the device only; an FP8 GEMM also costs the host two quantisation launches and
  their python, and it rounds. A GEMM that saves a few microseconds pays neither: on workload (a) of
  ``bench_train.py`` (28 layers, hidden 1024) choosing FP8 for the one forward GEMM per layer timed 6% faster
  (0.012 ms) made the step no faster and its time noisier (median 0.945x-0.995x bf16 in two runs on an H100).
- Decisions are cached in a JSON file keyed by GPU name, recipe, GEMM and shape (``LOONGFORGE_HF_FP8_CACHE`` or the
  ``cache_path`` given, default ``~/.cache/loongforge_hf/fp8_autotune.json``), written atomically since ranks of one
  node may share it, and reused offline; an unreadable file is timed again, with a warning.
- A grouped expert module is timed as a whole (``decide_experts``): the forward (and, when it trains, the backward)
  of all its local experts, bf16 (``grouped_mlp.grouped_gated_mlp``) against FP8 (``fp8_linear.fp8_experts``), at a
  power-of-two number of routed rows spread evenly over the experts, keyed ``experts:E`` (``experts_fwd:E``) with
  M = rows, N = 2 x the expert width, K = hidden, on the module's own weights (detached: no copy of them). The FP8
  time includes quantising the weights (the per-step cache keeps parameters only), so with several micro-batches per
  step FP8 is a little cheaper than timed.
- Each decision is logged (logger ``loongforge_hf.fp8``) with the component and module that met it; ``table()``
  lists them.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loongforge_hf.kernels.fp8 import check_recipe, gemm_dgrad, gemm_fwd, gemm_wgrad, is_blockwise, quantize_blocks

logger = logging.getLogger("loongforge_hf.fp8")

DEFAULT_CACHE = Path("~/.cache/loongforge_hf/fp8_autotune.json")
MIN_SAVING_FRACTION = 0.05
MIN_SAVING_MS = 0.05


def fp8_pays(bf16_ms: float, fp8_ms: float) -> bool:
    """Whether an FP8 GEMM timed at ``fp8_ms`` against ``bf16_ms`` is worth taking (see the module notes)."""
    return bf16_ms - fp8_ms >= max(MIN_SAVING_FRACTION * bf16_ms, MIN_SAVING_MS)


def _time_ms(fn, *, warmup: int = 3, reps: int = 10) -> float:
    for _ in range(warmup):
        fn()
    from loongforge_hf.xpu import get_backend

    return min(get_backend().time_ms(fn, reps) for _ in range(3))


def _gemm_pair(gemm: str, m: int, n: int, k: int, recipe: str, device: torch.device, dtype: torch.dtype):
    """(bf16 callable, fp8 callable) computing one GEMM of a linear layer with output [m, n] and contraction k."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    if gemm == "fwd":          # x [m, k] @ w[n, k].T
        x, w = rand(m, k), rand(n, k)
        return (lambda: x @ w.t()), (lambda: gemm_fwd(x, w, recipe))
    if gemm == "dgrad":        # dy [m, k] @ w [k, n]   (the layer's weight is [k, n])
        dy, w = rand(m, k), rand(k, n)
        # NOTE: the forward GEMM quantised w.T with w (gemm_fwd): not timed here again
        wtq = quantize_blocks(w.t(), check_finite=False) if is_blockwise(recipe) else None
        return (lambda: dy @ w), (lambda: gemm_dgrad(dy, w, recipe, wtq))
    dy, x = rand(k, m), rand(k, n)  # wgrad: dy.T [m, k] @ x [k, n]
    return (lambda: dy.t() @ x), (lambda: gemm_wgrad(dy, x, recipe))


def _experts_pair(fc1: torch.Tensor, fc2: torch.Tensor, m: int, recipe: str, train: bool, activation=None):
    """(bf16 callable, fp8 callable): forward (+ backward) of the experts of weights ``fc1`` ``[E, 2F, H]`` and
    ``fc2`` ``[E, H, F]`` over ``m`` rows spread evenly, with the module's ``activation`` between the projections
    (None: SwiGLU). The module's own weights are used (detached: no copy of them, their gradients untouched); only
    the activations, the gradients and the FP8 copies are allocated."""
    from loongforge_hf.kernels.fp8_linear import fp8_experts
    from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp
    from loongforge_hf.kernels.swiglu import swiglu

    experts, _, h = fc1.shape
    g = torch.Generator(device=fc1.device).manual_seed(0)
    counts = torch.full((experts,), m // experts, dtype=torch.int64, device=fc1.device)
    counts[: m % experts] += 1
    x, dy = (torch.randn(m, h, device=fc1.device, dtype=fc1.dtype, generator=g) for _ in range(2))
    x.requires_grad_(train)
    w1, w2 = fc1.detach().requires_grad_(train), fc2.detach().requires_grad_(train)

    def timed(mlp):
        def call():
            # NOTE: grad mode on even where the decision is asked under no_grad (a recomputed layer's first pass)
            with torch.enable_grad():
                x.grad = w1.grad = w2.grad = None
                mlp(x, w1, w2, counts, None).backward(dy)
        return call if train else torch.no_grad()(lambda: mlp(x, w1, w2, counts, None))

    return (timed(lambda *a: grouped_gated_mlp(*a, activation=activation or swiglu)),
            timed(lambda *a: fp8_experts(*a, recipe=recipe, activation=activation)))


def activation_key(activation) -> str:
    """The cache-key suffix of an expert module's activation: none for SwiGLU (None or the module), a clamped GLU's
    name with its constants (``:clamped_glu(limit=7.0,alpha=1.0,offset=0.0)``)."""
    from loongforge_hf.kernels.clamped_glu import ClampedGLU
    from loongforge_hf.kernels.swiglu import SwiGLU

    if activation is None or isinstance(activation, SwiGLU):
        return ""
    if isinstance(activation, ClampedGLU):
        return f":clamped_glu(limit={activation.limit},alpha={activation.alpha},offset={activation.offset})"
    return f":{type(activation).__name__}"


@dataclass
class Fp8Autotuner:
    """bf16-or-FP8 per GEMM shape, timed once per GPU model and cached in a JSON file."""
    recipe: str
    cache_path: Path | None = None
    entries: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    def __post_init__(self) -> None:
        check_recipe(self.recipe)
        path = self.cache_path or os.environ.get("LOONGFORGE_HF_FP8_CACHE") or DEFAULT_CACHE
        self.cache_path = Path(path).expanduser()
        if self.cache_path.is_file():
            try:
                data = json.loads(self.cache_path.read_text())
                self.entries = dict(data["entries"]) if data.get("format") == 1 else {}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                logger.warning("fp8 autotune cache %s is unreadable (%s); timing again.", self.cache_path, err)
                self.entries = {}

    @staticmethod
    def key(gpu: str, recipe: str, gemm: str, m: int, n: int, k: int) -> str:
        return f"{gpu}|{recipe}|{gemm}|{m}x{n}x{k}"

    def record(self, gpu: str, gemm: str, m: int, n: int, k: int, *, bf16_ms: float, fp8_ms: float) -> dict:
        # NOTE: times only; the choice is ``fp8_pays`` of them (an entry of an older rule holds a "fp8" flag, unused)
        entry = {"gpu": gpu, "recipe": self.recipe, "gemm": gemm, "m": m, "n": n, "k": k,
                 "bf16_ms": round(bf16_ms, 5), "fp8_ms": round(fp8_ms, 5)}
        self.entries[self.key(gpu, self.recipe, gemm, m, n, k)] = entry
        return entry

    def lookup(self, gpu: str, gemm: str, m: int, n: int, k: int) -> dict | None:
        return self.entries.get(self.key(gpu, self.recipe, gemm, m, n, k))

    def save(self) -> None:
        """Write the cache atomically (ranks of one node may share the file)."""
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.cache_path.parent, prefix=".fp8_autotune.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": 1, "entries": self.entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.cache_path)

    def decide(self, gemm: str, m: int, n: int, k: int, *, device: torch.device, dtype: torch.dtype,
               where: str, pair=None) -> bool:
        """FP8 or not for one GEMM (``gemm`` fwd / dgrad / wgrad) of shape ``m x n x k``, timed on a cache miss
        (``pair()``: the bf16 and FP8 callables to time, by default the GEMM's own)."""
        from loongforge_hf.xpu import get_backend

        gpu = get_backend().device_name(device) if device.type == "cuda" else device.type
        entry = self.lookup(gpu, gemm, m, n, k)
        if entry is None:
            if pair is None:
                bf16, fp8 = map(torch.no_grad(), _gemm_pair(gemm, m, n, k, self.recipe, device, dtype))
            else:
                bf16, fp8 = pair()
            entry = self.record(gpu, gemm, m, n, k, bf16_ms=_time_ms(bf16), fp8_ms=_time_ms(fp8))
            self.save()
        use = fp8_pays(entry["bf16_ms"], entry["fp8_ms"])
        self.rows.append((where, gemm, f"{m}x{n}x{k}", entry["bf16_ms"], entry["fp8_ms"], use))
        logger.info("fp8 adaptive: %s %s %dx%dx%d bf16 %.4f ms fp8 %.4f ms -> %s", where, gemm, m, n, k,
                    entry["bf16_ms"], entry["fp8_ms"], "fp8" if use else "bf16")
        return use

    def decide_experts(self, fc1: torch.Tensor, fc2: torch.Tensor, rows: int, *, train: bool, where: str,
                       activation=None) -> bool:
        """FP8 or not for a grouped expert module (weights fc1 ``[E, 2F, H]``, fc2 ``[E, H, F]``, its
        ``activation``: None for SwiGLU) at ``rows`` routed rows: forward and, with ``train``, backward of all its
        experts, timed as a whole. Another activation than SwiGLU (DeepSeek-V4's clamped SwiGLU) is timed and
        cached apart (``activation_key`` in the entry's GEMM)."""
        experts, two_f, h = fc1.shape
        gemm = f"experts{'' if train else '_fwd'}:{experts}{activation_key(activation)}"
        return self.decide(gemm, rows, two_f, h, device=fc1.device, dtype=fc1.dtype, where=where,
                           pair=lambda: _experts_pair(fc1, fc2, rows, self.recipe, train, activation))

    def table(self) -> str:
        """Every decision made in this process: component/module, GEMM, shape (MxNxK), times, choice."""
        lines = [f"{'module':<60} {'gemm':<6} {'MxNxK':<20} {'bf16 ms':>9} {'fp8 ms':>9}  choice"]
        lines += [f"{w:<60} {g:<6} {s:<20} {b:>9.4f} {f:>9.4f}  {'fp8' if c else 'bf16'}"
                  for w, g, s, b, f, c in self.rows]
        return "\n".join(lines)
