"""Model weights for tests, written by the project's real writers: tiny MuseTalk weights, and a music backbone
whose weights end songs on cue (tests/test_song_end.py, tests/test_decode_loop.py)."""

from __future__ import annotations


def tiny_musetalk_profile(tmp_path_factory):
    """The tiny lip-sync profile over random MuseTalk weights (seed 0) written by the real writer."""
    from app.pipeline.lipsync.musetalk import write_tiny_musetalk
    from app.pipeline.profiles import load_lipsync_profile

    profile = load_lipsync_profile("tiny", tmp_path_factory.mktemp("lipsync") / "tiny")
    write_tiny_musetalk(profile, seed=0)
    return profile


# ---- a backbone whose weights end songs on cue

TRIGGER = 5  # q1 code after which the model ends the song
A, B = 10.0, 5.0


def make_ending(model, end_id: int, trigger_id: int) -> None:
    """Rewrite a random-weight Megatron GPT in place so that it samples `end_id` right after `trigger_id`.

    Random weights would end songs at random. Here one hidden dimension is written only by the input embedding
    (attention and MLP outputs leave it at zero): +A for the trigger token, -A for every other token, and the
    output row of `end_id` reads only that dimension. After the trigger, end-of-text outweighs every code by
    ~e^80; anywhere else it is ~e^-40 against them.
    """
    import torch

    j = model.config.hidden_size - 1
    with torch.no_grad():
        for layer in model.decoder.layers:
            for linear in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
                linear.weight[j] = 0.0
                linear.bias[j] = 0.0
        table = model.embedding.word_embeddings.weight
        table[:, j] = -A
        table[trigger_id, j] = A
        model.decoder.final_layernorm.weight[j] = 1.0
        model.output_layer.weight[end_id] = 0.0
        model.output_layer.weight[end_id, j] = B


def write_ending_backbone(profile, directory, *, end_id: int, trigger_id: int, seed: int = 3):
    """A tiny backbone checkpoint, in the real format, that ends a song right after `trigger_id`."""
    import torch
    from app.pipeline.music import megatron_backend as mb

    model = mb.build_gpt(profile.backbone, causal=True, device="cpu", dtype=torch.float32)
    mb.init_random_weights(model, seed)
    make_ending(model, end_id, trigger_id)
    mb.save_checkpoint(model, directory)
    return model
