"""A decode step's forward pass built straight from the extension's ops: the same primitives as
the stock model file, in the same order, so the same logits, with less host work.

Through the model file a decode step is a graph the main thread builds in Python (module calls,
the op dispatch of :mod:`.kernels.model_ops`, the paged cache's protocol) on cores the MLX
stream and the extension's pool need.  At one token per row a (B, 1, H * D) projection already
lies as (B, H, 1, D), so a reshape does what the model file's transposes do.
:meth:`DecodeForward.build` says when it applies: a stock llama or qwen2 model without
sliding-window layers, the extension's attention with all four model ops installed, every row
feeding one token; anything else keeps the model file.

A layer is two fused primitives, ``attn_in`` (rms_norm, q/k/v, RoPE of q and k) and
``mlp_block`` (o_proj and the residual, rms_norm, gate/up, swiglu, down and the residual): the
separate ops' C++ tasks on the same inputs in the same order, so the bits do not change;
:func:`fused_exact` checks each once a process and keeps the separate ops where one differs.
A layer of packed 4/8-bit projections (``cpu_weights=quantized`` or ``int8-dot``) runs the same two
fused primitives on its packed weights where its projections share bits and group size and have no
bias (each projection then the task of its own ``quantized_linear`` call, so the same bits as the
model file's); else the separate ops with what its projections' own calls give (q/k/v and gate/up
each one ``quantized_linear_group`` call).
What it saves, measured: docs/design/attention.md.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Optional

import mlx.core as mx

from .kernels import model_ops
from .kv_cache import BatchRow, BatchView, KVPool

# Model files whose decoder layers are exactly: x + attn(norm(x)), then h + mlp(norm(h)), with
# q/k/v -> rope -> cache -> attention -> o_proj and down(swiglu(gate, up)).
log = logging.getLogger(__name__)

_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")


class _Layer:
    __slots__ = ("ln_in", "ln_post", "qkv", "o", "gate_up", "down", "heads", "kv_heads", "scale", "rope",
                 "mlp_biases", "quantized", "attn_packing", "mlp_packing")

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln_in, self.ln_post = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = attn.o_proj
        self.gate_up = (mlp.gate_proj, mlp.up_proj)
        self.down = mlp.down_proj
        self.heads, self.kv_heads, self.scale = attn.n_heads, attn.n_kv_heads, attn.scale
        r = attn.rope
        self.rope = (r.dims, r.traditional, r.base, r.scale)
        self.mlp_biases = [_bias(m) for m in (self.o, *self.gate_up, self.down)]
        # packed 4/8-bit projections (cpu_weights=quantized): each called as the model file calls it
        self.quantized = type(self.o) is model_ops.FastQuantizedLinear
        # ... and what the fused primitives take of them, where they can
        self.attn_packing = _packing(self.qkv) if self.quantized else None
        self.mlp_packing = _packing((self.o, *self.gate_up, self.down)) if self.quantized else None


def _packing(mods) -> Optional[dict]:
    """A fused primitive's arguments for packed projections ``mods`` (their scales and biases, bits, group
    size and int8_dot), or None where they differ in those or one has a bias."""
    m0 = mods[0]
    kind = (m0.bits, m0.group_size, model_ops.int8_dot(m0))
    if any("bias" in m or (m.bits, m.group_size, model_ops.int8_dot(m)) != kind for m in mods):
        return None
    return dict(qscales=[m["scales"] for m in mods], qbiases=[m["biases"] for m in mods], group_size=kind[1],
                bits=kind[0], int8_dot=kind[2])


def _bias(m) -> Optional[mx.array]:
    return m["bias"] if "bias" in m else None


def _biases(ms) -> list:
    """A group's biases as ``linear_group`` takes them: one per member, or none."""
    return [m["bias"] for m in ms if "bias" in m]


def _projections_unsupported(lins: list) -> Optional[str]:
    """Why a layer's seven projections cannot run here, or None: all the extension's linear (the
    siblings grouped), or all its quantized_linear on weights it takes."""
    if all(type(x) is model_ops.FastQuantizedLinear and getattr(x, "_mlxq_qlinear", None) is not None
           and model_ops.quantized_layer_fits(x) for x in lins):
        return None
    if any(type(x) is not model_ops.FastLinear or getattr(x, "_mlxq_linear", None) is None for x in lins):
        return "a projection is not the extension's linear"
    if any(getattr(x, "_mlxq_group", None) is None for x in lins[:3] + lins[4:6]):
        return "the sibling projections are not grouped"
    for sib in (lins[:3], lins[4:6]):
        if len({"bias" in x for x in sib}) != 1:
            return "sibling projections with and without a bias"
    return None


class DecodeForward:
    """One decode step over the pool, up to the vocabulary head (see the module doc)."""

    def __init__(self, model, pool: KVPool, backend, ext):
        self.model, self.pool, self.backend, self.ext = model, pool, backend, ext
        self.installs = model_ops.installs()  # the model's ops as checked by build()
        inner = model.model
        self.embed, self.norm = inner.embed_tokens, inner.norm
        self.layers = [_Layer(x) for x in inner.layers]
        self.quantized_embed = type(self.embed) is model_ops.FastQuantizedEmbedding
        self.attn_in = ext.attn_in if fused_exact(ext, "attn_in") else None
        self.mlp_block = ext.mlp_block if fused_exact(ext, "mlp_block") else None
        # layers of packed weights run attn_in and mlp_block on them where those pass their check
        self.packed_fused = any(L.quantized for L in self.layers) and fused_exact(ext, "packed")

    @classmethod
    def build(cls, model, pool: KVPool, backend) -> tuple[Optional["DecodeForward"], str]:
        """(the forward, why) where it applies to this model and engine, else (None, why not)."""
        why = cls._unsupported(model, pool, backend)
        if why is not None:
            return None, why
        from .attention import cpu_extension

        ext = cpu_extension()
        fwd = cls(model, pool, backend, ext)
        how = "the extension's ops straight, one reshape per view"
        fused = [name for name in ("attn_in", "mlp_block") if getattr(fwd, name) is not None]
        if fwd.packed_fused:
            fused += ["attn_in on packed weights", "mlp_block on packed weights"]
        if fused:
            how += f"; fused: {', '.join(fused)}"
        return fwd, how

    @staticmethod
    def _unsupported(model, pool: KVPool, backend) -> Optional[str]:
        if backend.name != "fused-cpu":
            return f"attention is {backend.name}"
        if backend.matmul != "pool" or not {"swiglu", "rope", "rms_norm", "linear"} <= set(backend.model_ops):
            return "not every model op of the extension is installed"
        if type(model).__module__ not in _MODULES:
            return f"model file {type(model).__module__}"
        inner = getattr(model, "model", None)
        if inner is None or getattr(inner, "pipeline_size", 1) != 1:
            return "a pipelined model"
        embed = inner.embed_tokens
        packed = type(embed) is model_ops.FastQuantizedEmbedding
        if packed and not model_ops.quantized_layer_fits(embed):
            return "a quantized embedding the extension does not take"
        norms, weights = [inner.norm], [] if packed else [embed["weight"]]
        for layer in inner.layers:
            if getattr(layer, "use_sliding", False):
                return "sliding-window layers"
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn.rope) is not model_ops.FastRoPE:
                return f"rope {type(attn.rope).__name__}"
            lins = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            why = _projections_unsupported(lins)
            if why is not None:
                return why
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            weights += [x["weight"] for x in lins if type(x) is model_ops.FastLinear]
        if any(type(x) is not model_ops.FastRMSNorm for x in norms):
            return "a norm is not the extension's"
        # the ops the model file would take are the extension's only for float32 (else MLX's own)
        weights += [x["weight"] for x in norms]
        if any(w.dtype != mx.float32 for w in weights):
            return "weights that are not float32"
        return None

    def current(self) -> bool:
        """Whether the model's ops are still those build() checked (an engine made later on the
        same model may have installed others, e.g. MLX's matmul): if not, the caller runs the
        model file, which follows them."""
        if self.installs != model_ops.installs():
            if self._unsupported(self.model, self.pool, self.backend) is not None:
                return False
            self.installs = model_ops.installs()
        return True

    def __call__(self, rows: list[BatchRow], inputs: mx.array) -> mx.array:
        """The last hidden state (B, D), normed, of ``inputs`` (B, 1): each row's next token (``rows``:
        each feeds one token). The caller applies the model's vocabulary head (ModelRunner.head)."""
        ext, pool = self.ext, self.pool
        attn_in = self.attn_in or partial(attn_in_ops, ext)
        mlp = self.mlp_block or partial(mlp_block_ops, ext)
        view = BatchView(rows, pool.block_size, pool.scratch_block)
        B = inputs.shape[0]
        # (B, 1, D): what nn.Embedding computes, or the quantized embedding's own call
        h = self.embed(inputs) if self.quantized_embed else self.embed["weight"][inputs]
        offsets, slots = view.q_offsets, view.write_slots
        for i, L in enumerate(self.layers):
            # each half: one fused primitive, or the same ops one by one (the same bits); a layer of
            # packed weights, the same primitive on them, or its modules' own calls between the same ops
            if L.attn_packing is not None and self.packed_fused:
                q, k, v = ext.attn_in(h, L.ln_in["weight"], L.ln_in.eps, [m["weight"] for m in L.qkv], [],
                                      L.heads, L.kv_heads, *L.rope, offsets, **L.attn_packing)
            elif L.quantized:
                q, k, v = attn_in_modules(ext, h, L.ln_in, L.qkv, L.heads, L.kv_heads, *L.rope, offsets)
            else:
                q, k, v = attn_in(h, L.ln_in["weight"], L.ln_in.eps, [m["weight"] for m in L.qkv], _biases(L.qkv),
                                  L.heads, L.kv_heads, *L.rope, offsets)
            pool.write_rows(i, k, v, slots)
            o = pool.attention(q, pool.keys[i], pool.values[i], view.tables, view.q_offsets, view.kv_lens,
                               L.scale, None, **pool.quant_kwargs(i))
            if L.mlp_packing is not None and self.packed_fused:
                h = ext.mlp_block(h, o.reshape(B, 1, -1), L.o["weight"], L.ln_post["weight"], L.ln_post.eps,
                                  L.gate_up[0]["weight"], L.gate_up[1]["weight"], L.down["weight"], [None] * 4,
                                  **L.mlp_packing)
            elif L.quantized:
                h = mlp_block_modules(ext, h, o.reshape(B, 1, -1), L.o, L.ln_post, *L.gate_up, L.down)
            else:
                h = mlp(h, o.reshape(B, 1, -1), L.o["weight"], L.ln_post["weight"], L.ln_post.eps,
                        L.gate_up[0]["weight"], L.gate_up[1]["weight"], L.down["weight"], L.mlp_biases)
        return ext.rms_norm(h, self.norm["weight"], self.norm.eps)[:, 0, :]


def attn_in_ops(ext, h, norm_weight, eps, ws, biases, heads, kv_heads, dims, traditional, base, scale, offsets):
    """What ``ext.attn_in`` computes, as the extension's separate ops (the model file's): q, k, v."""
    B = h.shape[0]
    q, k, v = ext.linear_group(ext.rms_norm(h, norm_weight, eps), ws, biases)
    rope = (dims, traditional, base, scale, offsets)
    return (ext.rope(q.reshape(B, heads, 1, -1), *rope), ext.rope(k.reshape(B, kv_heads, 1, -1), *rope),
            v.reshape(B, kv_heads, 1, -1))


def _packed(ext, x, mods: tuple) -> list:
    """Packed projections of one x: one quantized_linear_group call where they share a kind and have no
    bias (each output bit for bit its module's own call, the extension's quantized_linear), else the
    modules' own calls."""
    kw = _packing(mods)
    if kw is not None:
        return ext.quantized_linear_group(x, [m["weight"] for m in mods], kw["qscales"], kw["qbiases"],
                                          kw["group_size"], kw["bits"], kw["int8_dot"])
    return [m(x) for m in mods]


def attn_in_modules(ext, h, norm, qkv, heads, kv_heads, dims, traditional, base, scale, offsets):
    """attn_in_ops for a layer of packed weights: what the q, k, v modules' own calls give (the
    extension's quantized_linear, and a bias where they have one), as the model file makes them."""
    B = h.shape[0]
    x = ext.rms_norm(h, norm["weight"], norm.eps)
    q, k, v = _packed(ext, x, qkv)
    rope = (dims, traditional, base, scale, offsets)
    return (ext.rope(q.reshape(B, heads, 1, -1), *rope), ext.rope(k.reshape(B, kv_heads, 1, -1), *rope),
            v.reshape(B, kv_heads, 1, -1))


def mlp_block_modules(ext, h, o, o_proj, norm, gate_proj, up_proj, down_proj):
    """mlp_block_ops for a layer of packed weights: the projections' own calls."""
    h = h + o_proj(o)
    x = ext.rms_norm(h, norm["weight"], norm.eps)
    return h + down_proj(ext.swiglu(*_packed(ext, x, (gate_proj, up_proj))))


def mlp_block_ops(ext, h, o, w_o, norm_weight, eps, w_gate, w_up, w_down, biases):
    """What ``ext.mlp_block`` computes, as the extension's separate ops and MLP's adds (the model
    file's); biases: o, gate, up, down, each an array or None."""
    h = h + ext.linear(o, w_o, biases[0])
    gate, up = ext.linear_group(ext.rms_norm(h, norm_weight, eps), [w_gate, w_up],
                                [b for b in biases[1:3] if b is not None])
    return h + ext.linear(ext.swiglu(gate, up), w_down, biases[3])


_EXACT: dict[tuple[int, str], bool] = {}


def fused_exact(ext, name: str) -> bool:
    """Whether the extension's fused op ``name`` (``attn_in`` or ``mlp_block``; ``packed``: both on packed
    weights) gives, bit for bit, what its separate ops give one after another (the adds are MLX's),
    with and without biases, at one row and at several; checked once a process. False (logged): the
    layers keep the separate ops."""
    key = (id(ext), name)
    if key not in _EXACT:
        ok = False
        if all(hasattr(ext, op) for op in _NEEDS.get(name, (name,))):
            try:
                ok = _CHECKS[name](ext)
            except Exception:  # noqa: BLE001 - a fused op that cannot run here is not used
                log.exception("the extension's %s failed its check; decode steps keep the separate ops", name)
            else:
                if not ok:
                    log.warning("the extension's %s differs from its separate ops; decode steps keep those", name)
        _EXACT[key] = ok
    return _EXACT[key]


def _random(seed: int):
    keys = iter(mx.random.split(mx.random.key(seed), 32))
    return lambda *shape: mx.random.normal(shape, key=next(keys))


def _check_mlp_block(ext) -> bool:
    D, K, I = 48, 40, 72
    r = _random(7)
    w_o, ln, w_g, w_u, w_d = r(D, K), r(D), r(I, D), r(I, D), r(D, I)
    b = [r(D), r(I), r(I), r(D)]
    ok = True
    for rows in (1, 9):
        h, o = r(rows, 1, D), r(rows, 1, K)
        for biases in ([None] * 4, b):
            args = (h, o, w_o, ln, 1e-5, w_g, w_u, w_d, biases)
            ok = ok and mx.array_equal(ext.mlp_block(*args), mlp_block_ops(ext, *args)).item()
    return ok


def _check_attn_in(ext) -> bool:
    D, H, KH, hd = 48, 4, 2, 16
    r = _random(8)
    ln, ws, b = r(D), [r(H * hd, D), r(KH * hd, D), r(KH * hd, D)], [r(H * hd), r(KH * hd), r(KH * hd)]
    ok = True
    for rows, dims, traditional in ((1, hd, False), (9, hd // 2, True)):
        h = r(rows, 1, D)
        offsets = mx.array([65530 + 977 * i for i in range(rows)], dtype=mx.int32)  # past RoPE's 2^16 table too
        rope = (dims, traditional, 10000.0, 1.0)
        for biases in ([], b):
            args = (h, ln, 1e-5, ws, biases, H, KH, *rope, offsets)
            got, want = ext.attn_in(*args), attn_in_ops(ext, *args)
            ok = ok and all(g.shape == w.shape and mx.array_equal(g, w).item() for g, w in zip(got, want))
    return ok


def _check_packed(ext) -> bool:
    """attn_in and mlp_block on packed weights (4 bits; 8 bits for gate/up/down would do the same)
    against the packed layer's separate ops (attn_in_modules, mlp_block_modules), both kernels."""
    from mlx import nn

    from ..model import INT8_DOT_ATTR

    D, H, KH, hd, I = 64, 4, 2, 16, 96
    r = _random(9)

    def packed(n_out: int, n_in: int, int8: bool):  # a packed layer as the engine installs it
        m = model_ops.FastQuantizedLinear(n_in, n_out, bias=False, group_size=32, bits=4)
        w, s, b = mx.quantize(r(n_out, n_in), group_size=32, bits=4)
        m.update({"weight": w, "scales": s, "biases": b})
        object.__setattr__(m, INT8_DOT_ATTR, int8)
        object.__setattr__(m, "_mlxq_qlinear", ext.quantized_linear)
        return m

    ok = True
    for int8 in (False, True):
        qkv = (packed(H * hd, D, int8), packed(KH * hd, D, int8), packed(KH * hd, D, int8))
        o_proj, gate, up, down = packed(D, H * hd, int8), packed(I, D, int8), packed(I, D, int8), packed(D, I, int8)
        norm = nn.RMSNorm(D)
        norm.update({"weight": r(D)})
        for rows in (1, 9):
            h = r(rows, 1, D)
            offsets = mx.array([7 + 977 * i for i in range(rows)], dtype=mx.int32)
            rope = (hd, False, 10000.0, 1.0)
            got = ext.attn_in(h, norm["weight"], norm.eps, [m["weight"] for m in qkv], [], H, KH, *rope, offsets,
                              **_packing(qkv))
            want = attn_in_modules(ext, h, norm, qkv, H, KH, *rope, offsets)
            ok = ok and all(g.shape == w.shape and mx.array_equal(g, w).item() for g, w in zip(got, want))
            o = r(rows, 1, H * hd)
            got = ext.mlp_block(h, o, o_proj["weight"], norm["weight"], norm.eps, gate["weight"], up["weight"],
                                down["weight"], [None] * 4, **_packing((o_proj, gate, up, down)))
            ok = ok and mx.array_equal(got, mlp_block_modules(ext, h, o, o_proj, norm, gate, up, down)).item()
    return ok


_CHECKS = {"mlp_block": _check_mlp_block, "attn_in": _check_attn_in, "packed": _check_packed}
_NEEDS = {"packed": ("attn_in", "mlp_block", "quantized_linear_group")}  # the ops a check calls, if not its name
