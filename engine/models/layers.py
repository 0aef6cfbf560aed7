"""Layers shared by the dense decoder families (Llama, Qwen3).

Tensors are flattened over the batch: hidden states are [num_tokens, hidden]; each layer gets
the forward's `AttentionMetadata` and its slice of the KV cache. The numerics follow
transformers' modeling code op for op (fp32 RMSNorm, cos/sin from `inv_freq`), so that
greedy outputs match it token for token in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention import AttentionBackend, AttentionMetadata
from kernels.utils import graph_time_us

# Decode steps of this many rows run the fused GEMVs where `tune_gemv` set them: it times one
# row (the kernel takes up to kernels.gemv.MAX_M, but each further row streams the weight again).
GEMV_ROWS = 1


class Linear(nn.Linear):
    """nn.Linear that can pad a few-row input up to `pad_rows_to` rows before the GEMM.

    Why: for some decode shapes cuBLAS picks a much slower kernel at M=1 than at M=8 (on the
    H200, Qwen3-0.6B's o_proj, K=2048 -> N=1024: 13.2 µs at M=1, 6.6 µs at M=8;
    bench/gemm_small_m.py). `tune_small_m` measures each shape once at start-up and pads only
    where it pays."""

    pad_rows_to: int = 0
    # Up to GEMV_ROWS rows: this layer's GEMM, with the op before it folded in (the RMSNorm
    # before qkv/gate_up, the SiLU-mul before down), as kernels/gemv.py's kernel with this
    # tile. Set by `tune_gemv` where it measured faster than cuBLAS plus that op.
    gemv_config = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: write the result there (a CUDA graph's static buffer) without a copy."""
        m = x.shape[0]
        if self.gemv_config is not None and out is None and 0 < m <= GEMV_ROWS:
            from kernels.gemv import gemv

            return gemv(x, self.weight, self.bias, config=self.gemv_config)
        if 0 < m < self.pad_rows_to:
            y = F.linear(F.pad(x, (0, 0, 0, self.pad_rows_to - m)), self.weight, self.bias)[:m]
            return y if out is None else out.copy_(y)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)


def linear_into(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """layer(x) written into `out`: in the GEMM for our Linear, a copy for others (FP8)."""
    if isinstance(layer, Linear):
        return layer(x, out=out)
    return out.copy_(layer(x))


@torch.inference_mode()
def tune_small_m(model: nn.Module, rows: int = 8, min_gain: float = 0.15) -> dict:
    """CUDA: for each distinct Linear shape, time M=1 plain vs padded to `rows`; pad every
    Linear of a shape whose padded GEMM is at least `min_gain` faster. Returns the timings."""
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for mod in model.modules():
        if isinstance(mod, Linear):
            by_shape.setdefault((mod.in_features, mod.out_features), []).append(mod)
    report = {}
    for shape, mods in by_shape.items():
        layer = mods[0]
        x = torch.zeros(1, shape[0], dtype=layer.weight.dtype, device=layer.weight.device)
        times = []
        for pad in (0, rows):
            layer.pad_rows_to = pad
            times.append(graph_time_us(lambda: layer(x)))  # noqa: B023 - called right here
        pad = rows if times[1] < (1 - min_gain) * times[0] else 0
        for mod in mods:
            mod.pad_rows_to = pad
        report[f"{shape[0]}x{shape[1]}"] = {"m1_us": times[0], "padded_us": times[1], "pad": pad}
    return report


@torch.inference_mode()
def tune_gemv(model: nn.Module, min_gain: float = 0.05) -> dict:
    """CUDA: for each of a decoder layer's four projections, time at one row what the batch-1
    step runs today (the separate RMSNorm / SiLU-mul kernel, then cuBLAS as `tune_small_m` left
    it) against kernels/gemv.py's fused form at each candidate tile, over every layer's own
    weights in one CUDA graph (so they stream from HBM, as in a step, not from L2). Where the
    best tile is at least `min_gain` faster, every layer's projection takes it
    (`Linear.gemv_config`). Returns the timings per projection (us per layer)."""
    from engine.quantization import Fp8Linear
    from kernels.activation import silu_and_mul
    from kernels.gemv import CANDIDATES, gemv, rms_norm_gemv, silu_mul_gemv
    from kernels.rms_norm import fused_add_rms_norm

    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers or not all(
        isinstance(lin, Linear | Fp8Linear) for lin in _projections(layers[0])
    ):
        return {}
    first = layers[0]
    dev, dt = first.input_layernorm.weight.device, first.input_layernorm.weight.dtype
    hidden = first.input_layernorm.weight.shape[0]
    x = torch.randn(1, hidden, device=dev, dtype=dt)
    res = torch.randn(1, hidden, device=dev, dtype=dt)
    attn_out = torch.randn(1, first.self_attn.q_size, device=dev, dtype=dt)
    gate_up = torch.randn(1, 2 * first.mlp.intermediate_size, device=dev, dtype=dt)

    def today(name, layer):
        lin, norm = getattr_path(layer, name), _norm_before(layer, name)
        if norm is not None:
            return lambda: lin(fused_add_rms_norm(x, res, norm.weight, norm.eps)[0])
        return lambda: lin(silu_and_mul(gate_up) if name == "mlp.down_proj" else attn_out)

    def fused(name, layer, cfg):
        lin, norm = getattr_path(layer, name), _norm_before(layer, name)
        if norm is not None:
            return lambda: rms_norm_gemv(x, norm.weight, norm.eps, lin.weight, lin.bias, res,
                                         cfg, _scale(lin))  # fmt: skip
        if name == "mlp.down_proj":
            return lambda: silu_mul_gemv(gate_up, lin.weight, lin.bias, cfg, _scale(lin))
        return lambda: gemv(attn_out, lin.weight, lin.bias, config=cfg, weight_scale=_scale(lin))

    def per_layer_us(fns) -> float:
        return graph_time_us(lambda: [f() for f in fns], reps=2, replays=5) / len(fns)

    report = {}
    for name in PROJECTIONS:
        for layer in layers:
            getattr_path(layer, name).gemv_config = None
        base = per_layer_us([today(name, layer) for layer in layers])
        times = {
            cfg: per_layer_us([fused(name, layer, cfg) for layer in layers]) for cfg in CANDIDATES
        }
        best = min(times, key=times.get)
        use = times[best] < (1 - min_gain) * base
        for layer in layers:
            getattr_path(layer, name).gemv_config = best if use else None
            layer.gemv = any(lin.gemv_config is not None for lin in _projections(layer))
        report[name] = {"today_us": base, "gemv_us": times[best],
                        "tile": best.name, "fused": use}  # fmt: skip
    return report


def _scale(linear) -> torch.Tensor | None:
    """An `Fp8Linear`'s per-channel weight scales for kernels/gemv.py; None: a 16-bit weight."""
    return getattr(linear, "weight_scale", None)


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def getattr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _projections(layer) -> list:
    return [getattr_path(layer, name) for name in PROJECTIONS]


def _norm_before(layer, name: str):
    """The RMSNorm a projection's fused form folds in (None: o_proj, down_proj)."""
    return {"self_attn.qkv_proj": layer.input_layernorm,
            "mlp.gate_up_proj": layer.post_attention_layernorm}.get(name)  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE for any `rope_type` transformers knows (default, llama3, yarn, ...)."""

    def __init__(self, config: PretrainedConfig, head_dim: int):
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # broadcast over heads


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, qk_norm: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs heads % kv_heads == 0"
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.scale = head_dim**-0.5

    def forward(self, x, cos, sin, kv_layer, meta: AttentionMetadata, backend: AttentionBackend):
        q, k, v = self.split_qkv(self.qkv_proj(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = backend.forward(q, k, v, kv_layer, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))

    def forward_fused(self, x, positions, cos_sin_cache, kv_layer, meta, backend):
        """CUDA: (q/k-norm +) RoPE and the KV-cache store in one kernel over views of the qkv
        output (in decode steps, inside the attention kernel); the backend then attends."""
        o = self.rope_attend(self.qkv_proj(x), positions, cos_sin_cache, kv_layer, meta, backend)
        return self.o_proj(o.reshape(-1, self.q_size))

    def rope_attend(self, qkv, positions, cos_sin_cache, kv_layer, meta, backend):
        """Attention over the qkv rows after the q/k norms, RoPE and the K/V store: in the
        attention kernel where the backend can (`attend_rope`: Triton, decode steps), else the
        RoPE kernel first. Returns [T, Hq, D]."""
        if getattr(backend, "rope_in_attention", False) and meta.max_query_len == 1:
            from kernels.paged_decode_attention import DecodeRope

            q, k, v = self.split_qkv(qkv)
            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else ()
            eps = self.q_norm.eps if self.q_norm is not None else 1e-6
            rope = DecodeRope(k, v, meta.slot_mapping, positions, cos_sin_cache, *norms, eps=eps)
            o = backend.attend_rope(q, kv_layer, meta, self.scale, rope)
            if o is not None:
                return o
        q, k, v = self.rope_store(qkv, positions, cos_sin_cache, kv_layer, meta.slot_mapping)
        return backend.forward(q, k, v, kv_layer, meta, self.scale, kv_written=True)

    def qkv_rope(self, x, positions, cos_sin_cache, kv_layer, slot_mapping, out=None):
        """The fused path up to attention: qkv_proj (into `out` if given), then one kernel for
        the q/k norms, RoPE and the K/V store at `slot_mapping` (< 0: no store). Returns the
        q, k, v views [T, heads, head_dim] of the qkv rows."""
        qkv = self.qkv_proj(x) if out is None else linear_into(self.qkv_proj, x, out)
        return self.rope_store(qkv, positions, cos_sin_cache, kv_layer, slot_mapping)

    def rope_store(self, qkv, positions, cos_sin_cache, kv_layer, slot_mapping):
        """One kernel on the qkv rows: q/k norms, RoPE, the K/V store. Returns q, k, v views."""
        from kernels.rotary import rotary_embedding

        q, k, v = self.split_qkv(qkv)
        has_norm = self.q_norm is not None
        rotary_embedding(
            positions,
            q,
            k,
            cos_sin_cache,
            self.q_norm.weight if has_norm else None,
            self.k_norm.weight if has_norm else None,
            self.q_norm.eps if has_norm else 1e-6,
            v=v,
            kv_layer=kv_layer,
            slot_mapping=slot_mapping,
        )
        return q, k, v

    def split_qkv(self, qkv: torch.Tensor):
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        assert getattr(config, "hidden_act", "silu") == "silu", "only SiLU-gated MLPs"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_fused_act(self.gate_up_proj(x))

    def forward_fused_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(SiLU-and-mul kernel of the gate_up rows)."""
        from kernels.activation import silu_and_mul

        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    gemv: bool = False  # some projection has a GEMV tile (`tune_gemv`)

    def __init__(self, config: PretrainedConfig, head_dim: int, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, head_dim, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_layer, meta, backend):
        residual = x
        x = self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta, backend)
        x = residual + x
        residual = x
        x = self.mlp(self.post_attention_layernorm(x))
        return residual + x

    def forward_fused(self, x, residual, positions, cos_sin_cache, kv_layer, meta, backend):
        """CUDA, vLLM-style: the residual add is fused into the next RMSNorm. Returns
        (x, residual) with the layer's output = x + residual."""
        if self.gemv and x.shape[0] <= GEMV_ROWS:
            return self._forward_gemv(
                x, residual, positions, cos_sin_cache, kv_layer, meta, backend
            )
        x, residual = self.input_norm_fused(x, residual)
        x = self.self_attn.forward_fused(x, positions, cos_sin_cache, kv_layer, meta, backend)
        return self.mlp_fused(x, residual)

    def _forward_gemv(self, x, residual, positions, cos_sin_cache, kv_layer, meta, backend):
        """Batch 1 (GEMV_ROWS): each projection that `tune_gemv` gave a GEMV tile
        folds in the op before it (kernels/gemv.py), the others run as in `forward_fused`.
        The residual is a new tensor where a norm is folded in (the GEMV's inputs stay
        unwritten), in place otherwise."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = _norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
        o = attn.rope_attend(qkv, positions, cos_sin_cache, kv_layer, meta, backend)
        x = attn.o_proj(o.reshape(-1, attn.q_size))
        gate_up, residual = _norm_linear(
            x, residual, self.post_attention_layernorm, mlp.gate_up_proj
        )
        down = mlp.down_proj
        if down.gemv_config is None:
            return mlp.forward_fused_act(gate_up), residual
        from kernels.gemv import silu_mul_gemv

        y = silu_mul_gemv(gate_up, down.weight, down.bias, down.gemv_config, _scale(down))
        return y, residual

    def input_norm_fused(self, x, residual):
        """The fused path before qkv_proj: RMSNorm of x (the first layer: no residual yet, x
        becomes it) or of x + residual (in place). Returns (normed x, residual)."""
        from kernels.rms_norm import fused_add_rms_norm, rms_norm

        norm = self.input_layernorm
        if residual is None:
            return rms_norm(x, norm.weight, norm.eps), x
        return fused_add_rms_norm(x, residual, norm.weight, norm.eps)

    def mlp_fused(self, x, residual):
        """The fused path after o_proj: add + RMSNorm (in place), MLP. Returns (x, residual)
        with the layer's output = x + residual."""
        from kernels.rms_norm import fused_add_rms_norm

        norm = self.post_attention_layernorm
        x, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(x), residual


def _norm_linear(x, residual, norm: RMSNorm, linear: Linear):
    """linear(rms_norm(x [+ residual])) and the new residual: in one GEMV kernel where the
    linear has a tile (`tune_gemv`), else the (fused add +) RMSNorm kernel, then the GEMM."""
    if linear.gemv_config is not None:
        from kernels.gemv import rms_norm_gemv

        return rms_norm_gemv(x, norm.weight, norm.eps, linear.weight, linear.bias, residual,
                             linear.gemv_config, _scale(linear))  # fmt: skip
    from kernels.rms_norm import fused_add_rms_norm, rms_norm

    if residual is None:
        return linear(rms_norm(x, norm.weight, norm.eps)), x
    x, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    return linear(x), residual
