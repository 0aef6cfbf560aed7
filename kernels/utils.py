"""Small helpers the kernel wrappers share: interpreter detection and device facts.

Why a module: every wrapper needs the same two questions answered the same way (are we in
Triton's CPU interpreter, where autotuning must be off? how many SMs must the grid fill?).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch


def is_interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests): kernels run in numpy, one program at a time."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns scalars into 1-element arrays and `int()`s them for
    `range(lo, hi)` bounds; numpy >= 2.4 refuses that (triton-lang/triton#9171, fixed
    upstream by `.squeeze()`). Apply the same fix from outside, only under the interpreter."""
    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_tandem_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._tandem_patched = True
    interpreter._patch_lang_tensor = patched


if is_interpreting():
    _patch_interpreter_scalar_index()


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 132 (an H100/H200) off-GPU, so heuristics that
    size grids pick the same split on CPU as on the target machine."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def has_pdl(device: torch.device) -> bool:
    """The device can launch kernels with programmatic dependent launch (CUDA, sm_90+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 ("ieee") for fp32 inputs so fp32 tests compare at
    1e-5; for bf16/fp16 the setting is ignored (tensor cores take them natively)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_kv_layer(kv_layer: torch.Tensor) -> None:
    """A layer's view `kv_cache[:, layer]`: [num_blocks, 2, block_size, Hkv, D]. The block
    stride is large (all layers of a block are contiguous); inside one K or V block the
    [block_size, Hkv, D] tile must be dense, which the kernels' address math relies on."""
    assert kv_layer.dim() == 5 and kv_layer.shape[1] == 2, "kv_layer: [blocks, 2, bs, Hkv, D]"
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    assert kv_layer.stride(4) == 1, "head_dim must be contiguous"
    assert kv_layer.stride(3) == head_dim, "[block_size, Hkv, D] must be contiguous"
    assert kv_layer.stride(2) == num_kv_heads * head_dim, "[block_size, Hkv, D] must be contiguous"


def fp8_max(kv_layer: torch.Tensor) -> float:
    """The FP8 cache's saturation bound for a kernel's `FP8_MAX` (0.0: not an FP8 cache)."""
    return torch.finfo(kv_layer.dtype).max if kv_layer.dtype == torch.float8_e4m3fn else 0.0


def gemm_output(
    x: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """The [M, n] output of a decode-size GEMM in x's dtype (`out`, checked, or a new one);
    checks `bias` ([n], contiguous) on the way. The GEMV and FP8 wrappers share it."""
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    if out is None:
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    assert out.shape == (x.shape[0], n) and out.stride(1) == 1 and out.dtype == x.dtype
    return out


def graph_time_us(fn, reps: int = 20, replays: int = 5) -> float:
    """CUDA: GPU microseconds per call of `fn`, without the launch cost from Python (which
    exceeds what small kernels run): one call outside the capture (compilation, cuBLAS's
    kernel choice), `reps` calls captured in a CUDA graph, `replays` replays timed by events."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * replays)
