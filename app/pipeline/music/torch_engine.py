"""The Khala transformer in plain PyTorch, with a static KV cache: the fast engine behind engine.py.

Megatron-core stays the loader and the reference (megatron_backend.py); this module takes the weights of a
loaded Megatron GPTModel and runs them without Megatron's per-call machinery (inference contexts, parallel
layers, rotary caches). The decode step has fixed shapes (a whole-length cache and a position mask, as in
gpt-fast), so it can later be captured in a CUDA graph.

Megatron's layouts, converted once at load:
  linear_qkv   rows grouped per query group g: [heads_per_group x q | k | v] x head_dim  -> qkv: [all q | all k | all v]
  linear_fc1   [gate | up] halves: silu(gate) * up      (gated_linear_unit with F.silu)  -> gate_up, as it is
  RoPE         non-interleaved halves, inv_freq = base^(-2i/d), the same table for every head
and the switches a checkpoint's saved args can set (megatron_backend.Variant), read from the model's config:
  add_bias_linear=False   no bias on any linear (--disable-bias-linear)
  add_qkv_bias=True       a bias on linear_qkv alone
  tied embeddings         the output projection is the input embedding (no output_layer.weight)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.pipeline.profiles import TransformerSpec

PACKED_ROWS = 16  # the row count oneDNN packs a weight for (Linear): the slot decoder's tile; 1 and 2 rows run as fast


def _onednn_linear_works() -> bool:
    """Whether this torch build runs oneDNN's packed linear on this CPU (x86 builds do; an ARM or a build without
    oneDNN may not): one tiny product, tried once, so that Linear falls back to F.linear everywhere or nowhere."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), PACKED_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


ONEDNN = _onednn_linear_works()  # read once: a traced step (torch.compile) may not call it


class Linear(nn.Linear):
    """nn.Linear that, on a CPU in fp32, runs oneDNN's product over its weight packed once (the kernel torch's CPU
    inductor uses for frozen weights) instead of the BLAS call F.linear makes (MKL on x86 builds). Measured on an AMD
    EPYC core (bench/cpu_products.py, the shaped backbone's shapes): a frame's products 3.1 against 6.9 ms at 1 row,
    8.1 against 24.6 at 16 rows; MKL's few-row products run far below the core's arithmetic (~48 GFLOP/s at 16 rows
    against oneDNN's ~146), which made a 16-row step cost 3.6x a 1-row one where a memory-bound GPU pays ~1x.
    Every caller on the CPU gets it (the reference loop, the slot decoder's per-row and tile products,
    super-resolution), so a track's bits are the same on every path that makes the same call; they are not
    F.linear's (~1e-6 apart). Inference only (the op has no backward): this engine never trains. The packed weight
    is made on the first call and redone when the weight changes (a new tensor, or an in-place load); a traced step
    (torch.compile) uses the one made before; it is a second copy, so on a CPU the linears take twice their memory.
    Elsewhere (CUDA, other dtypes): F.linear."""

    _packed: Tensor | None = None
    _packed_for: tuple[int, int] | None = None

    def packs(self, x: Tensor) -> bool:
        """Whether `x` goes through the packed product."""
        weight = self.weight
        return ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32 and x.dtype == torch.float32

    def forward(self, x: Tensor) -> Tensor:
        if not self.packs(x):
            return F.linear(x, self.weight, self.bias)
        packed = self._packed if torch.compiler.is_compiling() else self.packed_weight()
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def packed_weight(self) -> Tensor:
        """The weight packed for oneDNN, made again if the weight changed since."""
        weight = self.weight
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor keeps no version counter: made in inference mode, loaded once
            version = -1
        stamp = (weight.data_ptr(), version)
        if self._packed is None or self._packed_for != stamp:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)
            self._packed_for = stamp
        return self._packed


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    max_len: int
    rotary_base: float
    eps: float
    linear_bias: bool = True  # Megatron's add_bias_linear
    qkv_bias: bool = False  # add_qkv_bias: the QKV projection biased even without linear_bias
    tied: bool = False  # output projection = input embedding

    @property
    def qkv_biased(self) -> bool:
        return self.linear_bias or self.qkv_bias

    @classmethod
    def of(
        cls, spec: TransformerSpec, *, linear_bias: bool = True, qkv_bias: bool = False, tied: bool = False
    ) -> "Shape":
        return cls(
            spec.num_layers,
            spec.hidden_size,
            spec.num_attention_heads,
            spec.num_query_groups,
            spec.head_dim,
            spec.ffn_hidden_size,
            spec.vocab_size,
            spec.max_sequence_length,
            float(spec.rotary_base),
            spec.norm_epsilon,
            linear_bias,
            qkv_bias,
            tied,
        )


def rope_tables(shape: Shape, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin [length, head_dim] in float32 for positions 0..length-1."""
    inv_freq = 1.0 / shape.rotary_base ** (
        torch.arange(0, shape.head_dim, 2, dtype=torch.float32, device=device) / shape.head_dim
    )
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, d] rotated by the tables for its T positions [T, d]."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.shape = shape
        # q, k and v in one matmul: rows [all query heads | all key groups | all value groups]
        self.qkv = Linear(shape.hidden, (shape.heads + 2 * shape.groups) * shape.head_dim, bias=shape.qkv_biased)
        self.out = Linear(shape.heads * shape.head_dim, shape.hidden, bias=shape.linear_bias)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: "KVCache | None" = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        batch, length, _ = x.shape
        s = self.shape
        q, k, v = self.qkv(x).split([s.heads * s.head_dim, s.groups * s.head_dim, s.groups * s.head_dim], dim=-1)
        q = q.view(batch, length, s.heads, s.head_dim).transpose(1, 2)
        k = k.view(batch, length, s.groups, s.head_dim).transpose(1, 2)
        v = v.view(batch, length, s.groups, s.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            if positions is None:
                raise ValueError("a KV cache write needs the positions")
            k, v = cache.write(k, v, positions)
        # GQA without copying keys and values: the query heads of a group become extra query rows of that
        # group (heads are numbered group by group), so each group's K/V is read once, unrepeated.
        per_group = s.heads // s.groups
        q = q.reshape(batch, s.groups, per_group * length, s.head_dim)
        if mask is not None:
            mask = mask.repeat(1, 1, per_group, 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).view(batch, s.heads, length, s.head_dim)
        return self.out(y.transpose(1, 2).reshape(batch, length, s.heads * s.head_dim))


class FeedForward(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.ffn = shape.ffn
        # [gate | up] in one matmul, as Megatron's fc1
        self.gate_up = Linear(shape.hidden, 2 * shape.ffn, bias=shape.linear_bias)
        self.down = Linear(shape.ffn, shape.hidden, bias=shape.linear_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.ffn, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.hidden, eps=shape.eps)
        self.attention = Attention(shape)
        self.ffn_norm = nn.RMSNorm(shape.hidden, eps=shape.eps)
        self.ffn = FeedForward(shape)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: "KVCache | None" = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, positions)
        return x + self.ffn(self.ffn_norm(x))


class KVCache(nn.Module):
    """Keys and values of one layer for `max_len` positions, written in place at given positions."""

    keys: Tensor  # buffers, registered in __init__
    values: Tensor

    def __init__(self, shape: Shape, max_len: int, device: torch.device, dtype: torch.dtype, batch: int = 1):
        super().__init__()
        size = (batch, shape.groups, max_len, shape.head_dim)
        self.register_buffer("keys", torch.zeros(size, device=device, dtype=dtype), persistent=False)
        self.register_buffer("values", torch.zeros(size, device=device, dtype=dtype), persistent=False)

    def write(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        self.keys.index_copy_(2, positions, k)
        self.values.index_copy_(2, positions, v)
        return self.keys, self.values


class KhalaTransformer(nn.Module):
    """Embedding -> blocks -> final RMSNorm -> output projection (untied, as Khala's, unless shape.tied)."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.shape = shape
        self.embedding = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.num_layers))
        self.norm = nn.RMSNorm(shape.hidden, eps=shape.eps)
        self.output = nn.Linear(shape.hidden, shape.vocab, bias=False)
        if shape.tied:
            self.output.weight = self.embedding.weight

    def hidden_states(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        caches: Sequence[KVCache] | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Input embeddings [B, T, hidden] -> final-norm hidden states [B, T, hidden]."""
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask, caches[index] if caches else None, positions)
        return self.norm(x)


# --- weights from Megatron --------------------------------------------------------------------------


def megatron_to_plain(state: dict[str, Tensor], shape: Shape) -> dict[str, Tensor]:
    """A Megatron GPTModel state dict (local spec) as KhalaTransformer's state dict. Biases are carried where
    `shape` has them (a missing one is a KeyError; a tied model has no output weight of its own)."""
    plain = {
        "embedding.weight": state["embedding.word_embeddings.weight"],
        "norm.weight": state["decoder.final_layernorm.weight"],
        "output.weight": state["embedding.word_embeddings.weight" if shape.tied else "output_layer.weight"],
    }
    for i in range(shape.num_layers):
        src, dst = f"decoder.layers.{i}.", f"blocks.{i}."
        kinds = ("weight", "bias") if shape.linear_bias else ("weight",)
        for kind in ("weight", "bias") if shape.qkv_biased else ("weight",):
            plain[f"{dst}attention.qkv.{kind}"] = _ungroup_qkv(state[f"{src}self_attention.linear_qkv.{kind}"], shape)
        for kind in kinds:
            plain[f"{dst}attention.out.{kind}"] = state[f"{src}self_attention.linear_proj.{kind}"]
            plain[f"{dst}ffn.gate_up.{kind}"] = state[f"{src}mlp.linear_fc1.{kind}"]
            plain[f"{dst}ffn.down.{kind}"] = state[f"{src}mlp.linear_fc2.{kind}"]
        plain[f"{dst}attention_norm.weight"] = state[f"{src}input_layernorm.weight"]
        plain[f"{dst}ffn_norm.weight"] = state[f"{src}pre_mlp_layernorm.weight"]
    return {name: tensor.contiguous() for name, tensor in plain.items()}


def _ungroup_qkv(grouped: Tensor, shape: Shape) -> Tensor:
    """linear_qkv's weight or bias, rows [q of group g | k_g | v_g] per group, as rows [all q | all k | all v]."""
    per_group = shape.heads // shape.groups
    grouped = grouped.reshape(shape.groups, per_group + 2, shape.head_dim, *grouped.shape[1:])
    q = grouped[:, :per_group].reshape(-1, *grouped.shape[3:])
    k = grouped[:, per_group].reshape(-1, *grouped.shape[3:])
    v = grouped[:, per_group + 1].reshape(-1, *grouped.shape[3:])
    return torch.cat([q, k, v])


def from_megatron(megatron_model: nn.Module, spec: TransformerSpec) -> KhalaTransformer:
    """A KhalaTransformer holding `megatron_model`'s weights, on its device and in its dtype. The shape comes
    from `spec`; biases and tying from the model itself (its config), so that no caller can get them wrong."""
    reference = next(megatron_model.parameters())
    config: Any = megatron_model.config  # a megatron-core TransformerConfig
    shape = Shape.of(
        spec,
        linear_bias=bool(config.add_bias_linear),
        qkv_bias=bool(config.add_qkv_bias),
        tied=bool(getattr(megatron_model, "share_embeddings_and_output_weights", False)),
    )
    state = {k: v for k, v in megatron_model.state_dict().items() if not k.endswith("_extra_state")}
    with torch.device("meta"):
        model = KhalaTransformer(shape)
    model.load_state_dict(megatron_to_plain(state, shape), strict=True, assign=True)
    model = model.to(device=reference.device, dtype=reference.dtype)
    if shape.tied:  # assign=True gave each name its own Parameter: one tensor again, not two copies
        model.output.weight = model.embedding.weight
    model = model.eval().requires_grad_(False)
    pack_weights(model)
    return model


def pack_weights(model: nn.Module) -> None:
    """Pack every Linear's weight for oneDNN now (on a CPU in fp32), so that a traced step finds it made."""
    for module in model.modules():
        if isinstance(module, Linear) and module.packs(module.weight):
            module.packed_weight()


# --- engines ------------------------------------------------------------------------------------------


class TorchCausalLM:
    """BatchedCausalLM (engine.py) over KhalaTransformer with a static KV cache: one sequence, or a batch of
    sequences that share a prompt (the tracks of one song) and decode in lockstep."""

    def __init__(self, model: KhalaTransformer):
        self.model = model
        self.vocab_size = model.shape.vocab
        self.device = model.output.weight.device
        self.dtype = model.output.weight.dtype
        self._caches: list[KVCache] = []
        self._rope: tuple[Tensor, Tensor] | None = None
        self._slots: Tensor | None = None
        self._length = 0
        self._max_len = 0
        self._batch = 0

    def reset(self, max_len: int, batch: int = 1) -> None:
        if max_len > self.model.shape.max_len:
            raise ValueError(f"{max_len} positions exceed the model's {self.model.shape.max_len}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self._caches = []  # drop the old cache before allocating the new one
        self._caches = [
            KVCache(self.model.shape, max_len, self.device, self.dtype, batch)
            for _ in range(self.model.shape.num_layers)
        ]
        self._rope = rope_tables(self.model.shape, max_len, self.device)
        self._slots = torch.arange(max_len, device=self.device)
        self._length, self._max_len, self._batch = 0, max_len, batch

    def cached_hidden(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Run tokens [B, T] at `positions` [T] (a device tensor: no host sync) through the cache; final-norm
        hidden states [B, T, hidden]."""
        if self._rope is None or self._slots is None:
            raise RuntimeError("call reset(max_len) first")
        cos, sin = (table[positions] for table in self._rope)
        visible = self._slots[None, :] <= positions[:, None]  # [T, max_len]
        return self.model.hidden_states(
            self.model.embedding(ids), cos, sin, visible[None, None], self._caches, positions
        )

    def _step(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Run tokens [B, T] at `positions` [T] through the cache; logits [B, T, vocab] (float32)."""
        return self.model.output(self.cached_hidden(ids, positions)).float()

    @torch.inference_mode()
    def prefill_batch(self, ids: Sequence[int]) -> Tensor:
        """Feed the shared prompt to every sequence of the batch; logits of its last position [B, vocab]."""
        if not self._caches:
            raise RuntimeError("call reset(max_len) before prefill()")
        if self._length:
            raise RuntimeError("prefill() needs a fresh cache: call reset(max_len) first")
        tokens = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        if tokens.numel() > self._max_len:
            raise ValueError(f"a {tokens.numel()}-token prompt does not fit in {self._max_len} positions")
        logits = self._step(tokens.expand(self._batch, -1), torch.arange(tokens.numel(), device=self.device))
        self._length = tokens.numel()
        return logits[:, -1]

    @torch.inference_mode()
    def decode_batch(self, token_ids: Sequence[int]) -> Tensor:
        """Append one token to each sequence (in batch order); their logits [B, vocab]."""
        if not self._length:
            raise RuntimeError("decode() needs prefill() first")
        if self._length >= self._max_len:
            raise ValueError(f"the cache holds {self._max_len} positions; reset() with a larger max_len")
        if len(token_ids) != self._batch:
            raise ValueError(f"{len(token_ids)} tokens for a batch of {self._batch}")
        tokens = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)[:, None]
        logits = self._step(tokens, torch.tensor([self._length], device=self.device))
        self._length += 1
        return logits[:, 0]

    def prefill(self, ids: Sequence[int]) -> Tensor:
        self._require_single()
        return self.prefill_batch(ids)[0]

    def decode(self, token_id: int) -> Tensor:
        self._require_single()
        return self.decode_batch([token_id])[0]

    def _require_single(self) -> None:
        if self._batch > 1:
            raise RuntimeError(f"the cache holds a batch of {self._batch}: use prefill_batch/decode_batch")

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> Tensor:
        tokens = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        cos, sin = rope_tables(self.model.shape, tokens.numel(), self.device)
        causal = torch.ones(tokens.numel(), tokens.numel(), dtype=torch.bool, device=self.device).tril()
        hidden = self.model.hidden_states(self.model.embedding(tokens)[None], cos, sin, causal[None, None])
        return self.model.output(hidden[0]).float()

    def release(self) -> None:
        self._caches, self._rope, self._slots, self._length, self._max_len, self._batch = [], None, None, 0, 0, 0


class TorchBidirectionalLM:
    """BidirectionalLM (engine.py) over KhalaTransformer: full attention, logits for one id window."""

    def __init__(self, model: KhalaTransformer):
        self.model = model
        self.vocab_size = model.shape.vocab
        self.device = model.output.weight.device

    @property
    def input_embeddings(self) -> Tensor:
        return self.model.embedding.weight

    @torch.inference_mode()
    def logits(self, embeddings: Tensor, vocab: slice | None = None) -> Tensor:
        x = embeddings.to(self.device, self.model.output.weight.dtype)[None]
        cos, sin = rope_tables(self.model.shape, x.shape[1], self.device)
        hidden = self.model.hidden_states(x, cos, sin, None)[0]
        weight = self.model.output.weight if vocab is None else self.model.output.weight[vocab]
        return (hidden @ weight.t()).float()

    def release(self) -> None:
        pass
