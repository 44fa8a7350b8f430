"""Super-resolution and codec decoding of several tracks at once (issue 23, item 3).

`fill_fine_tracks` runs super-resolution for a list of tracks with every one of its 62 passes as ONE forward
pass over the tracks' sequences stacked on the batch dimension; `decode_tracks` runs the codec over the chunks
of a list of tracks, stacking equal-length chunks. Both return what the one-track functions
(`superres.fill_fine`, `codec.decode_codes`) return for each track, in order:

  superres  tracks whose sequences (prompt + frames) have the same length stack without a mask: on the CPU
            each track's codes are identical (torch.equal) to `fill_fine` alone. Tracks of different lengths
            are padded at the end and their padding masked out of attention: their hidden states then differ
            by float rounding (~1e-7 max abs on the tiny model), so a top-k draw can rarely come out different.
  codec     the codec's convolutions (oneDNN on the CPU) pick kernels by batch size, so a chunk's audio in a
            batch differs from alone by float rounding (~1e-6 max abs); chunks are stacked only with chunks of
            the same length (no padding: it would change the convolutions' edges).

Sampling stays per track (each track's own torch.Generator, the same draws in the same order as alone).
Engines other than the plain-PyTorch one (torch_engine.TorchBidirectionalLM) run each track's pass in turn
with their own `logits`: correct, just not batched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from app.pipeline.control import StageControl
from app.pipeline.music.codec import KhalaCodecDecoder, _check_codes, fade_in, plan_chunks
from app.pipeline.music.engine import BidirectionalLM, sample_top_k
from app.pipeline.music.superres import check_coarse, task_marker
from app.pipeline.music.torch_engine import TorchBidirectionalLM, rope_tables
from app.pipeline.profiles import COARSE_CODEBOOKS, MusicProfile

# ------------------------------------------------------------------------------------------- superres


def _stacked_hidden(lm: BidirectionalLM, sequences: list[Tensor]) -> list[Tensor]:
    """Final-norm hidden states [len_i, hidden] of each input-embedding sequence [len_i, hidden], all in one
    forward pass when the engine is the plain-PyTorch one (end padding masked when lengths differ)."""
    if not isinstance(lm, TorchBidirectionalLM):
        raise TypeError("stacked passes need the plain-PyTorch engine")
    model = lm.model
    dtype = model.output.weight.dtype
    lengths = [int(s.shape[0]) for s in sequences]
    longest = max(lengths)
    x = torch.zeros(len(sequences), longest, model.shape.hidden, dtype=dtype, device=lm.device)
    for i, sequence in enumerate(sequences):
        x[i, : lengths[i]] = sequence.to(lm.device, dtype)
    mask = None
    if min(lengths) != longest:  # keys past a track's end are padding: hide them from its queries
        valid = torch.arange(longest, device=lm.device)[None, :] < torch.tensor(lengths, device=lm.device)[:, None]
        mask = valid[:, None, None, :].expand(len(sequences), 1, longest, longest)
    cos, sin = rope_tables(model.shape, longest, lm.device)
    hidden = model.hidden_states(x, cos, sin, mask)
    return [hidden[i, :n] for i, n in enumerate(lengths)]


def _pass_logits(lm: BidirectionalLM, sequences: list[Tensor], vocab: slice) -> list[Tensor]:
    """Logits [len_i, window] of each sequence, projected like `BidirectionalLM.logits` (float32)."""
    if not isinstance(lm, TorchBidirectionalLM):
        return [lm.logits(sequence, vocab) for sequence in sequences]
    weight = lm.model.output.weight[vocab]
    # one 2-D matmul per track, the same call `logits` makes alone (a stacked matmul may round differently)
    return [(hidden @ weight.t()).float() for hidden in _stacked_hidden(lm, sequences)]


@torch.inference_mode()
def fill_fine_tracks(
    lm: BidirectionalLM,
    coarse: Sequence[Tensor],
    *,
    profile: MusicProfile,
    seeds: Sequence[int],
    prompts: Sequence[Sequence[int]],
    top_k: int | None = None,
    control: StageControl | None = None,
) -> list[Tensor]:
    """`superres.fill_fine` for several tracks at once: codes [num_codebooks, F_i] per track, in order.

    `coarse[i]` [2, F_i], `seeds[i]` and `prompts[i]` (the track's super-resolution prompt) are track i's.
    Reports "done/62 layers" per pass (each pass covers every track).
    """
    control = control or StageControl()
    if not len(coarse) == len(seeds) == len(prompts) or not coarse:
        raise ValueError(f"need one seed and one prompt per track: {len(coarse)}, {len(seeds)}, {len(prompts)}")
    num_codebooks, size = profile.codec.num_codebooks, profile.codebook_size
    top_k = profile.superres_top_k if top_k is None else top_k
    for track in coarse:
        check_coarse(track, size)

    table = lm.input_embeddings
    device = table.device
    codes, audio = [], []
    for track in coarse:  # the same running sums as fill_fine, one per track
        known = torch.empty(num_codebooks, track.shape[1], dtype=torch.long)
        known[:COARSE_CODEBOOKS] = track.cpu()
        total = table[profile.audio_token_offset(0) + known[0].to(device)].float()
        for j in range(1, COARSE_CODEBOOKS):
            total = total + table[profile.audio_token_offset(j) + known[j].to(device)].float()
        codes.append(known)
        audio.append(total)
    prompt_ids = [torch.tensor(list(ids), dtype=torch.long, device=device) for ids in prompts]
    generators = [torch.Generator(device=lm.device).manual_seed(seed) for seed in seeds]
    passes = num_codebooks - COARSE_CODEBOOKS
    try:
        for layer in range(COARSE_CODEBOOKS, num_codebooks):
            sequences = []
            for ids, total in zip(prompt_ids, audio, strict=True):
                sequence = total.to(table.dtype)
                if len(ids):
                    ids[-1] = task_marker(profile, layer)
                    sequence = torch.cat([table[ids], sequence])
                sequences.append(sequence)
            start = profile.audio_token_offset(layer)
            window = slice(start, start + size)
            for i, logits in enumerate(_pass_logits(lm, sequences, window)):
                sampled = sample_top_k(logits[len(prompt_ids[i]) :], top_k=top_k, generator=generators[i])
                codes[i][layer] = sampled.cpu()
                audio[i] += table[start + sampled].float()
            control.step(layer - COARSE_CODEBOOKS + 1, passes, "layers")
    finally:
        lm.release()
    return codes


# ------------------------------------------------------------------------------------------- codec


def decode_tracks(
    decoder: KhalaCodecDecoder,
    codes: Sequence[Tensor],
    control: StageControl | None = None,
    *,
    max_chunks: int = 8,
) -> list[Tensor]:
    """`codec.decode_codes` for several tracks: float32 CPU audio [audio_channels, F_i * hop] per track.

    Plans each track's chunks as decode_codes does, runs chunks of equal length up to `max_chunks` at a time
    (activation memory grows with it: on the real decoder one 1920-frame chunk holds GBs of activations), then
    crossfades each track's chunks exactly as decode_codes does. Reports "done/total chunks" over all tracks.
    """
    control = control or StageControl()
    if max_chunks < 1:
        raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
    spec = decoder.spec
    checked = [_check_codes(track, spec) for track in codes]
    hop = spec.hop_length
    plans = [plan_chunks(track.shape[1], spec.chunk_frames, spec.overlap_frames) for track in checked]
    by_length: dict[int, list[tuple[int, int]]] = defaultdict(list)  # chunk length -> [(track, chunk index)]
    for t, plan in enumerate(plans):
        for k, (start, end) in enumerate(plan):
            by_length[end - start].append((t, k))
    device = next(decoder.parameters()).device
    pieces: dict[tuple[int, int], Tensor] = {}
    total, done = sum(len(plan) for plan in plans), 0
    control.check()
    for members in by_length.values():
        for first in range(0, len(members), max_chunks):
            group = members[first : first + max_chunks]
            with torch.inference_mode():
                latent = torch.cat([decoder.quantizer(checked[t][:, slice(*plans[t][k])].to(device)) for t, k in group])
                audio = decoder.decoder(latent).float().cpu()
            for row, key in enumerate(group):
                pieces[key] = audio[row]
            del audio, latent
            done += len(group)
            control.step(done, total, "chunks")
    ramp = fade_in(spec.overlap_frames * hop)
    outs = []
    for t, plan in enumerate(plans):
        out = torch.empty(spec.audio_channels, checked[t].shape[1] * hop)
        for k, (start, end) in enumerate(plan):  # decode_codes' stitching, chunk by chunk
            piece = pieces.pop((t, k))
            blend = 0 if k == 0 else ramp.numel()
            lo = start * hop
            if blend:
                out[:, lo : lo + blend].lerp_(piece[:, :blend], ramp)
            out[:, lo + blend : end * hop] = piece[:, blend:]
        outs.append(out)
    return outs
