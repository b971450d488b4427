"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over a flattened token stream.

Differences between the members are config switches: qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3),
tied embeddings, GQA, and the rotary variant. The arithmetic follows transformers' reference order
(RMSNorm in float32, rotary tables cast to the model dtype) so greedy output matches it token for token.
Projections are fused (qkv, gate+up) to cut the number of matmuls per layer. A projection (and the token embedding,
and so a tied LM head) is either a float parameter or weights kept quantized (engine/quant: a QuantLinear, or a
ConcatLinear where the fused parts differ in format), as the checkpoint hands them in.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...cpu import build as cpu_build, ops as cpu_ops
from ..attention import AttentionMetadata
from ..dtypes import cpu_supports_bf16 as _onednn_bf16
from ..model_config import ModelConfig
from ...quant import ConcatLinear, QuantLinear, concat

#: a weight as a checkpoint hands it in: float, or kept in a quantized block format
Weight = torch.Tensor | QuantLinear
Quantized = (QuantLinear, ConcatLinear)
#: the (fused) projections of a layer: its attribute names and its ``mm`` keys
PROJECTIONS = ("qkv", "o", "gate_up", "down")
#: a projection's multiply: x [T, in] -> [T, out] (a float matmul, a packed kernel, a QuantLinear)
Multiply = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / float(sc["factor"])
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quantized: frozenset[str] = frozenset()):
        """``quantized``: the projections (PROJECTIONS names) that arrive quantized: no float parameter is allocated
        for them; load_hf_state_dict sets them."""
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_size, self.kv_size = H * D, Hkv * D
        self.input_norm = nn.Parameter(torch.ones(E, dtype=dtype), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(E, dtype=dtype), requires_grad=False)
        shapes = {"qkv": (self.q_size + 2 * self.kv_size, E), "o": (E, H * D),
                  "gate_up": (2 * cfg.intermediate_size, E), "down": (E, cfg.intermediate_size)}

        def projection(name: str) -> nn.Parameter | None:
            if name in quantized:
                return None
            return nn.Parameter(torch.empty(shapes[name], dtype=dtype), requires_grad=False)

        # (registered in this order: the state dict's order, which kv_transfer.fingerprint hashes)
        self.qkv = projection("qkv")
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size, dtype=dtype), requires_grad=False)
            if cfg.qkv_bias and "qkv" not in quantized
            else None
        )
        self.o = projection("o")
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(D, dtype=dtype), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(D, dtype=dtype), requires_grad=False)
        self.gate_up = projection("gate_up")
        self.down = projection("down")
        # each a float parameter whenever its plain multiply below is the one in mm (load_hf_state_dict replaces
        # the multiply of a quantized one): mypy cannot follow that, hence the ignores
        self.mm: dict[str, Multiply] = {
            "qkv": lambda x: F.linear(x, self.qkv, self.qkv_bias),  # type: ignore[arg-type]  # see above
            "o": lambda x: F.linear(x, self.o),  # type: ignore[arg-type]  # see above
            "gate_up": lambda x: F.linear(x, self.gate_up),  # type: ignore[arg-type]  # see above
            "down": lambda x: F.linear(x, self.down),  # type: ignore[arg-type]  # see above
        }

    def forward(self, h, delta, rope: "_Rope", k_cache, v_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream h plus the previous layer's pending output delta (added here, fused
        with the norm). Returns (h, delta) for the next layer; the stream's value is h + delta."""
        cfg = self.cfg
        T = h.shape[0]
        eps = cfg.rms_norm_eps
        h, x = add_rms_norm(h, delta, self.input_norm, eps, rope.fused)
        qkv = self.mm["qkv"](x)
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.qk_norm:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(T, H + Hkv, D)
            qk = torch.cat([rms_norm(qk[:, :H], self.q_norm, eps), rms_norm(qk[:, H:], self.k_norm, eps)], dim=1)
            qk = rope.apply(qk.view(T, -1), H + Hkv, D)
        else:
            qk = rope.apply(qkv, H + Hkv, D)  # q and k heads rotated together: one pass (in place when fused)
            v = qkv[:, self.q_size + self.kv_size :]
        q = qk[:, : self.q_size].view(T, H, D)
        k = qk[:, self.q_size : self.q_size + self.kv_size].view(T, Hkv, D)
        attn = backend.forward(q, k, v.view(T, Hkv, D), k_cache, v_cache, meta, D**-0.5)
        h, x = add_rms_norm(h, self.mm["o"](attn.reshape(T, -1)), self.post_norm, eps, rope.fused)
        return h, self.mm["down"](silu_mul(self.mm["gate_up"](x), rope.fused))


def add_rms_norm(h, delta, weight, eps: float, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta) * weight); fused adds in place into h in one pass over the rows."""
    if fused:
        return h, cpu_ops.add_rmsnorm(h, delta, weight, eps)
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def silu_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """silu(gate) * up of the fused gate+up projection; fused: one pass of the C kernel."""
    if fused and gate_up.stride(1) == 1:
        return cpu_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class _Rope:
    """One step's rotary embedding: the fused kernel reads the tables at the positions and rotates in place;
    otherwise the step's cos/sin rows are gathered once and every layer multiplies."""

    def __init__(self, model: "LlamaModel", positions: torch.Tensor, fused: bool):
        self.fused = fused
        self.model = model
        if fused:
            self.positions = positions.contiguous()
        else:
            self.cos = model.cos_table[positions]
            self.sin = model.sin_table[positions]

    def apply(self, x: torch.Tensor, nheads: int, head_dim: int) -> torch.Tensor:
        """x [T, >= nheads*head_dim], heads at the start of each row; returns the rotated [T, nheads*head_dim]."""
        T = x.shape[0]
        if self.fused:
            cpu_ops.rope_(x, nheads, head_dim, self.model.cos_table, self.model.sin_table, self.positions)
            return x[:, : nheads * head_dim]
        qk = x[:, : nheads * head_dim].view(T, nheads, head_dim)
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        return (qk * cos + rotate_half(qk) * sin).view(T, -1)


class _Layers(nn.ModuleList):
    """The model's layers: an nn.ModuleList of LlamaLayer (the subclass only tells the type checker so)."""

    if TYPE_CHECKING:
        def __iter__(self) -> Iterator[LlamaLayer]: ...


class LlamaModel(nn.Module):
    cos_table: torch.Tensor  # buffers (register_buffer)
    sin_table: torch.Tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quantized: frozenset[str] = frozenset()):
        """``quantized``: the weights that arrive quantized ("embed", "lm_head" and PROJECTIONS names): no float
        parameter is allocated for them (see :meth:`from_weights`)."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed = None if "embed" in quantized else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = _Layers(LlamaLayer(cfg, dtype, quantized) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype), requires_grad=False)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = None if "lm_head" in quantized else nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        # a float parameter whenever this multiply is the one in mm (see LlamaLayer's)
        self.mm: dict[str, Multiply] = {"lm_head": lambda x: F.linear(x, self.lm_head)}  # type: ignore[arg-type]
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_table", emb.sin().to(dtype), persistent=False)
        self._norms_checked = False
        # (key, the FrLayer table or None, the row limit, the multiplies the key's ids are of): see _layer_table
        self._table_cache: tuple[tuple[int, ...], ctypes.Array | None, int | None, list[Multiply]] | None = None

    @classmethod
    def from_weights(cls, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                     tensors: dict[str, Weight]) -> "LlamaModel":
        """The model holding ``tensors`` (Hugging Face names; float tensors or QuantLinear): float parameters only
        for the weights that come as floats."""
        quantized = frozenset(kind for name, t in tensors.items() if isinstance(t, QuantLinear)
                              for kind in [_weight_kind(name)] if kind is not None)
        model = cls(cfg, dtype, max_positions, quantized)
        model.load_hf_state_dict(tensors)
        return model

    def _embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embedding rows of ``ids`` in the model dtype; a quantized table dequantizes only those rows."""
        if not isinstance(self.embed, QuantLinear):
            return F.embedding(ids, self.embed)  # type: ignore[arg-type]  # a float parameter unless quantized
        return self.embed.rows(ids.reshape(-1), self.dtype).view(*ids.shape, self.embed.k)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (before the last norm)."""
        h = self._embedding(input_ids)
        fused = h.device.type == "cpu" and cpu_ops.supports(h.dtype)  # float32 or bfloat16 kernels
        if fused and not self.cfg.qk_norm:
            return self._forward_glued(h, positions, kv_caches, meta, backend)
        rope = _Rope(self, positions, fused)
        delta = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            h, delta = layer(h, delta, rope, kc, vc, meta, backend)
        return h if delta is None else h + delta

    def _forward_glued(self, h, positions, kv_caches, meta, backend) -> torch.Tensor:
        """The layers with the CPU kernels, flattened: LlamaLayer.forward's arithmetic, with the glue bound once for
        the step (cpu_ops.StepGlue: checks once, reused norm and activation buffers, pointer calls) and no module
        call or rotary object per layer. At batch 1 the step is mostly these calls' Python overhead outside the
        projections and attention."""
        cfg = self.cfg
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = h.shape[0]
        if not self._norms_checked:
            for layer in self.layers:
                for w in (layer.input_norm, layer.post_norm):
                    if w.dtype != h.dtype or w.shape != (cfg.hidden_size,) or not w.is_contiguous():
                        raise ValueError(f"norm weight {tuple(w.shape)} {w.dtype} does not fit the model")
            self._norms_checked = True
        # the rotary kernel writes the new keys and values too where the backend lets it (one pass, one call)
        kc0 = kv_caches[0][0] if kv_caches else None
        write_kv = (getattr(backend, "accepts_written_kv", False) and kc0 is not None and kc0.dtype == h.dtype
                    and kc0.device == h.device and kc0.is_contiguous())
        glue = cpu_ops.StepGlue(h, positions.contiguous(), self.cos_table, self.sin_table, cfg.rms_norm_eps, H + Hkv,
                                D, (H + 2 * Hkv) * D, cfg.intermediate_size, meta.slot_mapping if write_kv else None)
        norm, rope_, rope_kv_, silu_mul_ = glue.add_rmsnorm, glue.rope_, glue.rope_kv_, glue.silu_mul
        attend = functools.partial(backend.forward, kv_written=True) if write_kv else backend.forward
        heads, scale = [H, Hkv, Hkv], D**-0.5
        program = backend.decode_program(meta, H, D) if write_kv and hasattr(backend, "decode_program") else None
        # (profiled: per kernel, so the profile sees each)
        if program is not None and kc0 is not None and D <= 256 and not cpu_ops.profiling():
            table = self._layer_table(kv_caches, T)
            if table is not None:
                glue.decode_layers(table, kc0, kv_caches[0][1], program, H, scale)
                return h
        delta = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            mm = layer.mm
            qkv = mm["qkv"](norm(delta, layer.input_norm))
            if write_kv:
                rope_kv_(qkv, kc, vc)  # q and k heads rotated together in place, k and v into the pools
            else:
                rope_(qkv)
            q, k, v = qkv.view(T, -1, D).split(heads, dim=1)
            x = norm(mm["o"](attend(q, k, v, kc, vc, meta, scale).reshape(T, -1)), layer.post_norm)
            delta = mm["down"](silu_mul_(mm["gate_up"](x)))
        return h if delta is None else h.add_(delta)

    def _layer_table(self, kv_caches, T: int) -> ctypes.Array | None:
        """The layers as StepGlue.decode_layers reads them (a ctypes array of cpu_ops.FrLayer: norm weights,
        projections, pools), or None where a projection would not run kernels decode_layers calls at T rows (see
        _decode_projection). Cached while the projections are the same objects (the cache holds them, so their ids
        stay theirs) and the pools the same memory."""
        layers = list(self.layers)
        fns = [f for layer in layers for f in layer.mm.values()]
        # the norms straight from each layer's parameter dict: Module.__getattr__ made them 2/3 of this check's time
        norms = [p[n] for layer in layers for p in (layer._parameters,) for n in ("input_norm", "post_norm")]
        key = (*map(id, fns), *(c.data_ptr() for pair in kv_caches for c in pair),
               *(w.data_ptr() if w is not None else 0 for w in norms))
        if self._table_cache is None or self._table_cache[0] != key:
            kind = cpu_ops.PackedLinearBF16 if self.dtype == torch.bfloat16 else cpu_ops.PackedLinear
            rows: list[ctypes.Structure] = []
            limit, fits = None, True
            for layer, (kc, vc) in zip(self.layers, kv_caches):
                mms = [layer.mm[n] for n in ("qkv", "o", "gate_up", "down")]
                projections = [_decode_projection(f, kind) for f in mms]
                if None in projections:
                    fits = False
                    break
                # (a packed kernel's multiply: _with_kernel's rows)
                kernel_rows = [getattr(f, "rows", None) for f in mms if not isinstance(f, Quantized)]
                limit = min([r for r in kernel_rows if r is not None] + ([limit] if limit else []), default=None)
                qkv, o, gate_up, down = projections
                rows.append(cpu_ops.FrLayer(input_norm=layer.input_norm.data_ptr(),
                                            post_norm=layer.post_norm.data_ptr(), qkv=qkv, o=o, gate_up=gate_up,
                                            down=down, k_cache=kc.data_ptr(), v_cache=vc.data_ptr()))
            table = (cpu_ops.FrLayer * len(rows))(*rows) if fits else None
            self._table_cache = (key, table, limit, fns)
        _, table, limit, _ = self._table_cache
        return None if table is None or (limit is not None and T > limit) else table

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the rows that sample (the final norm is applied only to those)."""
        return self.mm["lm_head"](rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)).float()

    def pack_cpu_weights(self, batch_hint: int = 32, small_rows: int = 512) -> bool:
        """Reorders projection weights once for the CPU's fastest matmul, instead of on every call.

        float32: flowrt's own kernel (cpu_ops.PackedLinear: weights in panels of 16 output features, a 6 x 16 tile
        of the result in registers) for every projection and the LM head, at every row count. With the weights
        streaming from memory as in a real step (python bench/gemm_cold.py: all 30 layers of SmolLM2-135M + LM
        head, 2 threads, Zen3 AVX2) it is 1.2-1.4x oneDNN's prepacked path at 1-32 rows (decode), level with the
        best of oneDNN and MKL (within +-5%, run to run) at 128-512 and 1.03-1.05x MKL at 2,048 (prefill); one
        path and one extra copy of the weights instead of two. Without it (no compiler, no AVX2): oneDNN prepacked
        for the LM head and for steps of at most `small_rows` tokens (1.35-1.6x MKL at 16-64 rows), MKL beyond.
        The plain weights stay: the float32 paths fall back to them when the kernels are turned off
        (cpu_ops.set_enabled(False)).
        bfloat16: with AVX512-BF16 and no AMX flowrt's own kernel (cpu_ops.PackedLinearBF16) for every projection
        at every row count (see _packed_bf16), else oneDNN prepacked (~1.2-1.6x F.linear on few-row matmuls,
        bit-identical); either way one packed copy, the plain weights are dropped (the tied embedding keeps its
        own copy). Only float projections are packed: quantized ones (engine/quant) run their own kernels. Returns
        False, changing nothing, where no packing applies.
        """
        if self.norm.device.type != "cpu":
            return False
        projections = self._float_projections()  # quantized projections run their own kernels: never packed
        if not projections:
            return False
        if self.dtype == torch.float32:
            return self._pack_fp32_kernel(projections) or self._pack_fp32_onednn(projections, batch_hint, small_rows)
        if self.dtype != torch.bfloat16 or not _onednn_bf16():
            return False

        for p in projections:
            p.mm[p.name] = _packed_bf16(p.weight, p.bias, batch_hint)
            if p.owner is not self or not self.cfg.tie_word_embeddings:  # the tied embedding keeps its own copy
                delattr(p.owner, p.name)
        return True

    def _pack_fp32_kernel(self, projections: list["_Projection"]) -> bool:
        kernels = []
        for p in projections:
            kernel = cpu_ops.PackedLinear.create(p.weight, p.bias)
            if kernel is None:
                return False
            kernels.append(kernel)
        for p, kernel in zip(projections, kernels):
            p.mm[p.name] = _unless_disabled(kernel, p.mm[p.name])
        return True

    def _pack_fp32_onednn(self, projections: list["_Projection"], batch_hint: int, small_rows: int) -> bool:
        try:
            if not torch.backends.mkldnn.is_available():
                return False
            packed = [_packed(p.weight, p.bias, batch_hint) for p in projections]
        except (AttributeError, RuntimeError):
            return False
        for p, fn in zip(projections, packed):
            # the LM head always runs prepacked; projections only up to small_rows rows (MKL beyond)
            p.mm[p.name] = fn if p.name == "lm_head" else _by_rows(fn, p.mm[p.name], small_rows)
        return True

    def load_hf_state_dict(self, tensors: dict[str, Weight]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Quantized ones (QuantLinear) are kept as they
        are (fused by row-stacking their blocks); a fused projection whose parts mix float and quantized ones, or
        a quantized weight where a float parameter was allocated, is dequantized into the float parameter.
        Raises naming a missing tensor or a shape that does not fit."""
        cfg = self.cfg

        def get(name: str) -> Weight:
            t = tensors.get(name)
            if t is None:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return t

        def get_float(name: str) -> torch.Tensor:
            t = get(name)
            if isinstance(t, QuantLinear):
                raise ValueError(f"tensor {name!r} is quantized where flowrt reads it as float")
            return t

        def take(name: str) -> torch.Tensor:
            t = get(name)
            return t.dequantize(self.dtype) if isinstance(t, QuantLinear) else t.to(self.dtype)

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(value)  # a copy: loaded tensors may be views of a memory-mapped file

        def weight(owner: nn.Module, attr: str, names: list[str], name: str, shape: tuple[int, int],
                   biases: list[str] | None = None) -> None:
            """owner.attr from the tensors ``names`` (row-stacked): kept quantized where all are and no float parameter
            waits for them, else written into the float parameter (no concatenated temporary)."""
            parts = [get(n) for n in names]
            rows = sum(p.shape[0] for p in parts)
            if (rows, parts[0].shape[1]) != shape or any(p.shape[1] != shape[1] for p in parts):
                got = [tuple(p.shape) for p in parts]
                raise ValueError(f"tensor {name!r} has shapes {got}, expected {shape} in all")
            bias = None if biases is None else [get_float(b).float() for b in biases]
            param = getattr(owner, attr)
            quant = [p for p in parts if isinstance(p, QuantLinear)]
            if param is None and len(quant) == len(parts):
                if bias is not None:
                    quant = [QuantLinear(p.qtype, p.data, p.n, p.k, b) for p, b in zip(quant, bias)]
                setattr(owner, attr, quant[0] if len(quant) == 1 else concat(quant))
                return
            if param is None:
                param = nn.Parameter(torch.empty(shape, dtype=self.dtype), requires_grad=False)
                setattr(owner, attr, param)
            torch.cat([take(n) for n in names], out=param.data)
            if bias is not None:
                qkv_bias = getattr(owner, "qkv_bias", None)
                if qkv_bias is None:
                    qkv_bias = owner.qkv_bias = nn.Parameter(torch.empty(rows, dtype=self.dtype), requires_grad=False)
                put(qkv_bias, torch.cat(bias).to(self.dtype), name.replace(".weight", ".bias"))

        E, V = cfg.hidden_size, cfg.vocab_size
        weight(self, "embed", ["model.embed_tokens.weight"], "model.embed_tokens.weight", (V, E))
        put(self.norm, take("model.norm.weight"), "model.norm.weight")
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            weight(self, "lm_head", ["lm_head.weight"], "lm_head.weight", (V, E))
        if isinstance(self.lm_head, Quantized):
            self.mm = {"lm_head": self.lm_head}
        H, Hkv, D, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            put(layer.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(layer.post_norm, take(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm.weight")
            weight(layer, "qkv", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], a + "qkv_proj.weight",
                   ((H + 2 * Hkv) * D, E), [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
                   if cfg.qkv_bias else None)
            weight(layer, "o", [a + "o_proj.weight"], a + "o_proj.weight", (E, H * D))
            if cfg.qk_norm:
                put(layer.q_norm, take(a + "q_norm.weight"), a + "q_norm.weight")
                put(layer.k_norm, take(a + "k_norm.weight"), a + "k_norm.weight")
            weight(layer, "gate_up", [m + "gate_proj.weight", m + "up_proj.weight"], m + "gate_up_proj.weight",
                   (2 * inter, E))
            weight(layer, "down", [m + "down_proj.weight"], m + "down_proj.weight", (E, inter))
            for name in PROJECTIONS:
                if isinstance(getattr(layer, name), Quantized):
                    layer.mm[name] = getattr(layer, name)

    def weight_classes(self) -> dict[str, list]:
        """The weights by class (what stats() reports a format for), in layer order: each a float tensor, a
        QuantLinear / ConcatLinear, or a packed projection's multiply (bf16 drops the plain weight). A tied LM head is
        the embedding itself."""
        def of(owner, attr: str, mm: dict, key: str):
            w = getattr(owner, attr, None)
            return w if w is not None else mm[key]

        layers = self.layers
        return {
            "embed": [self.embed],
            "attn_qkv": [of(ly, "qkv", ly.mm, "qkv") for ly in layers],
            "attn_output": [of(ly, "o", ly.mm, "o") for ly in layers],
            "ffn_gate_up": [of(ly, "gate_up", ly.mm, "gate_up") for ly in layers],
            "ffn_down": [of(ly, "down", ly.mm, "down") for ly in layers],
            "lm_head": [of(self, "lm_head", self.mm, "lm_head")],
            "norms": [self.norm, *(w for ly in layers
                                   for w in (ly.input_norm, ly.post_norm, getattr(ly, "q_norm", None),
                                             getattr(ly, "k_norm", None)) if w is not None)],
        }

    def resident_tensors(self) -> list[torch.Tensor]:
        """Every tensor the weights hold: float parameters, quantized blocks (and their biases), packed copies."""
        out = [t for t in self.state_dict().values()]
        for q in self._quantized():
            parts = q.parts if isinstance(q, ConcatLinear) else [q]
            out += [t for p in parts for t in (p.data, p.bias) if t is not None]
        for mm in [self.mm, *(ly.mm for ly in self.layers)]:
            out += [t for f in mm.values() for t in getattr(f, "resident", ())]
        return out

    def named_weights(self):
        """(name, tensor) of every weight: the state dict, then the quantized projections' blocks (as uint8)."""
        yield from self.state_dict().items()
        seen = set()
        for prefix, owner in [("", self), *((f"layers.{i}.", ly) for i, ly in enumerate(self.layers))]:
            for attr in ("embed", "lm_head", *PROJECTIONS):
                q = owner.__dict__.get(attr)
                if isinstance(q, Quantized) and id(q) not in seen:
                    seen.add(id(q))
                    for j, part in enumerate(q.parts if isinstance(q, ConcatLinear) else [q]):
                        yield f"{prefix}{attr}.{j}.{part.qtype.name}", part.data
                        if part.bias is not None:
                            yield f"{prefix}{attr}.{j}.bias", part.bias

    def _quantized(self) -> list:
        """The quantized weights, each once (a tied LM head is the embedding)."""
        found = {id(q): q for q in (w for ws in self.weight_classes().values() for w in ws) if isinstance(q, Quantized)}
        return list(found.values())

    def _float_projections(self) -> list["_Projection"]:
        """The float projections pack_cpu_weights may pack (the LM head first)."""
        out = []
        if isinstance(self.lm_head, torch.Tensor):
            out.append(_Projection(self, self.mm, "lm_head", self.lm_head, None))
        for layer in self.layers:
            for name in PROJECTIONS:
                w = getattr(layer, name)
                if isinstance(w, torch.Tensor):
                    out.append(_Projection(layer, layer.mm, name, w, layer.qkv_bias if name == "qkv" else None))
        return out


@dataclass
class _Projection:
    """A float projection where it lives: ``owner.<name>`` is the weight, ``mm[name]`` its multiply."""

    owner: nn.Module
    mm: dict
    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None


def _weight_kind(hf_name: str) -> str | None:
    """What a Hugging Face tensor name is part of: "embed", "lm_head", a PROJECTIONS name, or None (norms, biases)."""
    if hf_name == "model.embed_tokens.weight":
        return "embed"
    if hf_name == "lm_head.weight":
        return "lm_head"
    for part, kind in ((".q_proj.weight", "qkv"), (".k_proj.weight", "qkv"), (".v_proj.weight", "qkv"),
                       (".o_proj.weight", "o"), (".gate_proj.weight", "gate_up"), (".up_proj.weight", "gate_up"),
                       (".down_proj.weight", "down")):
        if hf_name.endswith(part):
            return kind
    return None


def _packed(weight, bias, batch_hint: int):
    w = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    fn = lambda x: torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")  # noqa: E731
    fn.resident = (w,)  # type: ignore[attr-defined]  # a function attribute: the packed copy, for the resident weight bytes (stats' weights_bytes)
    return fn


def _onednn_on_amx() -> bool:
    """Whether the bf16 projections keep oneDNN because the CPU has AMX (tests present a CPU without it)."""
    return "amx_bf16" in cpu_build.cpu_flags()


def _packed_bf16(weight, bias, batch_hint: int):
    """flowrt's AVX512-BF16 kernel (cpu_ops.PackedLinearBF16) at every row count, its packed weights the only copy;
    oneDNN prepacked where that kernel is unavailable or the CPU has AMX (oneDNN runs bf16 on AMX tiles there; the
    kernel was not measured against that). Measured (python bench/gemm_bf16.py, AMD EPYC with AVX512-BF16, no AMX,
    cold weights, in-process A/B, one thread's CPU time), against oneDNN prepacked: every SmolLM2-135M shape at 1-64
    rows 1.09-2.35x; qkv / o / gate_up / down 1.04-1.13x at 128 and 512 rows, 0.99-1.08x at 2,048; the LM head 1.05x
    at 128 rows, 0.99x at 512 (it computes only the rows that need logits). One path and one copy of the weights
    (~270 MB less than keeping oneDNN's beside it for SmolLM2-135M). While the CPU kernels are turned off (tests,
    A/B benchmarks) oneDNN runs on the weights unpacked from the panels, packed on first use."""
    if _onednn_on_amx():
        return _packed(weight, bias, batch_hint)
    kernel = cpu_ops.PackedLinearBF16.create(weight, bias)
    if kernel is None:
        return _packed(weight, bias, batch_hint)
    plain = None

    def off(x):
        nonlocal plain
        if plain is None:
            plain = _packed(kernel.weight(), bias, batch_hint)
        return plain(x)

    return _with_kernel(lambda x: kernel(x) if cpu_ops.enabled() else off(x), kernel, None)


def _decode_projection(f, kind: type[cpu_ops.PackedLinear] | type[cpu_ops.PackedLinearBF16]) -> ctypes.Structure | None:
    """A projection as the cpu_ops.FrProjection decode_layers calls, or None where it would not run one of the kernels
    that calls: packed float (a `kind` kernel: cpu_ops.PackedLinear / PackedLinearBF16, one part) or quantized (a
    QuantLinear on the kernels, one part of its ggml type; a ConcatLinear of them, a part each)."""
    if not isinstance(f, Quantized):
        kernel = getattr(f, "kernel", None)
        return cpu_ops.projection([kernel.part()], kernel.k) if type(kernel) is kind else None
    parts = f.parts if isinstance(f, ConcatLinear) else [f]
    if len(parts) > cpu_ops.MAX_PARTS or not all(p.runs_kernels for p in parts):
        return None
    return cpu_ops.projection([p.part() for p in parts], f.k)


def _unless_disabled(kernel, plain):
    """The kernel, or the plain path while the CPU kernels are turned off (tests compare the two)."""
    return _with_kernel(lambda x: kernel(x) if cpu_ops.enabled() else plain(x), kernel, None)


def _with_kernel(fn, kernel, rows: int | None):
    """fn, marked as running the packed kernel `kernel` (.wp, .bias) for steps of at most `rows` rows (None: any)
    while the kernels are on: the one-call decode step (cpu_ops.StepGlue.decode_layers) calls that kernel itself."""
    fn.kernel, fn.rows = kernel, rows
    fn.resident = tuple(t for t in (kernel.wp, kernel.bias) if t is not None)
    return fn


def _by_rows(small, large, limit: int):
    fn = lambda x: small(x) if x.shape[0] <= limit else large(x)  # noqa: E731
    fn.resident = getattr(small, "resident", ())  # type: ignore[attr-defined]  # a function attribute
    return fn
