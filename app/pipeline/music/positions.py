"""How many backbone positions a song needs, known before any model or tokenizer loads.

The backbone holds its prompt and then two coarse tokens (q0, q1) per audio frame in one sequence of at most
`max_sequence_length` positions. The web checks a request against that at submission, so that a job it accepts
can run: with no tokenizer at hand it bounds the prompt from above. Both tokenizers (Llama-3's and the tiny
one) are byte-level BPE, so a text never takes more tokens than its UTF-8 bytes; a newline of the lyrics
becomes one line-break token; and the prompt is cut at BACKBONE_MAX_PROMPT_TOKENS whatever its text.
"""

from __future__ import annotations

import math

from app.pipeline.music.lyrics import clean_lyrics
from app.pipeline.profiles import COARSE_CODEBOOKS, MusicProfile

BACKBONE_MAX_PROMPT_TOKENS = 4096  # Khala clamps backbone prompts to this length
INSTRUMENTAL_LANGUAGE = "Instrumental"
# <|begin_of_text|>, two field ends, the duration token, prompt end, audio start; vocal songs add lyrics start,
# the opening line break and the lyrics' field end (prompt.build_prompt).
STRUCTURE_TOKENS = 6
VOCAL_STRUCTURE_TOKENS = 3


def prompt_tokens_at_most(mode: str, meta_text: str, lyrics: str) -> int:
    """An upper bound on the backbone prompt's length for this request (`lyrics` already cleaned)."""
    tokens = STRUCTURE_TOKENS + len(meta_text.strip().encode("utf-8"))
    if mode == "vocal":
        tokens += VOCAL_STRUCTURE_TOKENS + len(lyrics.encode("utf-8"))
    else:
        tokens += len(INSTRUMENTAL_LANGUAGE.encode("utf-8"))
    return min(tokens, BACKBONE_MAX_PROMPT_TOKENS)


def frames_room(profile: MusicProfile, prompt_tokens: int) -> int:
    """Audio frames the backbone can write after a prompt of `prompt_tokens`: what its positions hold, and
    at most the reference's generated-token cap."""
    positions = (profile.backbone.max_sequence_length - prompt_tokens) // COARSE_CODEBOOKS
    return max(0, min(positions, profile.max_generated_tokens // COARSE_CODEBOOKS))


def longest_song_s(profile: MusicProfile, prompt_tokens: int) -> float:
    """The longest duration (whole seconds, within the profile's range) whose frames fit after the prompt."""
    room = frames_room(profile, prompt_tokens)
    seconds = math.floor((room + 0.5) / profile.frames_per_second)  # frames_for rounds half up
    while seconds > 0 and profile.frames_for(seconds) > room:
        seconds -= 1
    return float(min(seconds, profile.max_duration_s))


def longest_song_for(
    profile: MusicProfile, *, mode: str, tags: str | None, description: str | None, lyrics: str | None
) -> float:
    """The longest song this request's prompt leaves room for (Khala conditions on the description, else
    the tags; only a vocal song carries lyrics)."""
    meta = (description or "").strip() or (tags or "").strip()
    words = clean_lyrics(lyrics) if mode == "vocal" and lyrics else ""
    return longest_song_s(profile, prompt_tokens_at_most(mode, meta, words))
