"""What the music stages need from a transformer engine, whatever implements it.

Stage code (backbone.py, superres.py) talks only to these protocols, so the Megatron-core engine
(megatron_backend.py) and a plain-PyTorch engine loading the same weights are interchangeable.
Logits come back as float32 on the engine's device; token ids are plain ints or LongTensors.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class CausalLM(Protocol):
    """Decoder-only LM with a KV cache for one sequence (batch size 1)."""

    vocab_size: int
    device: torch.device

    def reset(self, max_len: int) -> None:
        """Start a new sequence whose prompt plus generated tokens fit in `max_len` positions."""

    def prefill(self, ids: Sequence[int]) -> Tensor:
        """Feed the prompt into the empty cache; return the last position's logits [vocab]."""

    def decode(self, token_id: int) -> Tensor:
        """Append one token to the cache; return its logits [vocab]."""

    def logits(self, ids: Sequence[int]) -> Tensor:
        """Logits of every position [len(ids), vocab] in one uncached pass (checks and scoring)."""

    def release(self) -> None:
        """Drop the KV cache and scratch memory; the weights stay with whoever holds the model."""


@runtime_checkable
class BatchedCausalLM(CausalLM, Protocol):
    """A CausalLM that also runs several sequences sharing one prompt in lockstep (the tracks of one song):
    on a memory-bound GPU a batch of B tokens costs about what one token costs."""

    def reset(self, max_len: int, batch: int = 1) -> None:
        """Start `batch` new sequences of at most `max_len` positions each."""

    def prefill_batch(self, ids: Sequence[int]) -> Tensor:
        """Feed the shared prompt to every sequence; logits of its last position [batch, vocab]."""

    def decode_batch(self, token_ids: Sequence[int]) -> Tensor:
        """Append one token to each sequence; their logits [batch, vocab]."""


@runtime_checkable
class BidirectionalLM(Protocol):
    """Non-causal transformer run over a whole sequence of input embeddings at once."""

    vocab_size: int
    device: torch.device

    @property
    def input_embeddings(self) -> Tensor:
        """The input embedding table [vocab, hidden] (model dtype, engine device)."""

    def logits(self, embeddings: Tensor, vocab: slice | None = None) -> Tensor:
        """Logits [T, n] for input embeddings [T, hidden], projected only onto ids in `vocab`.

        Restricting the projection to one codebook's id window is why this takes a slice: the full
        super-resolution vocabulary (193792) times a full song's frames would not fit comfortably.
        """

    def release(self) -> None:
        """Drop scratch memory; the weights stay with whoever holds the model."""


def sample_top_k(
    logits: Tensor, *, top_k: int, temperature: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """Sample one index per row of `logits` [..., n] like Megatron's static sampler (Khala's).

    top_k == 1 is greedy; otherwise divide by temperature, keep the k largest, softmax, multinomial.
    Returns a LongTensor of shape logits.shape[:-1] with indices into the last dimension.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k == 1:
        return logits.argmax(dim=-1)
    rows = logits.reshape(-1, logits.shape[-1]).float() / temperature
    values, indices = torch.topk(rows, min(top_k, rows.shape[-1]), dim=-1)
    choice = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator)
    return indices.gather(-1, choice).reshape(logits.shape[:-1])
