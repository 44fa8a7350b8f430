"""Backbone prompt for Khala-style music generation.

Khala reuses the Llama-3 tokenizer and repurposes its special tokens as prompt structure. The backbone prompt is

    vocal:        <|begin_of_text|> META <|eom_id|> <|eom_id|>
                  <|start_header_id|> <|end_header_id|> LINE_1 <|end_header_id|> LINE_2 ... <|eom_id|>
                  <|reserved_special_token_M|> <|eot_id|> <|python_tag|>
    instrumental: <|begin_of_text|> META <|eom_id|> Instrumental <|eom_id|>
                  <|reserved_special_token_M|> <|eot_id|> <|python_tag|>

META is the description, else the tags; the (empty for vocal songs) language sits between the two `<|eom_id|>`;
every newline of the lyrics becomes `<|end_header_id|>`; M is the song length in whole minutes (1..10); the
backbone's audio tokens follow `<|python_tag|>`. Ids come from the tokenizer, so the real Llama-3 tokenizer and
the tiny one written here both work unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from app.pipeline.music.lyrics import clean_lyrics
from app.pipeline.music.positions import (
    BACKBONE_MAX_PROMPT_TOKENS,
    INSTRUMENTAL_LANGUAGE,
    STRUCTURE_TOKENS,
    VOCAL_STRUCTURE_TOKENS,
)
from app.pipeline.profiles import MusicProfile

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"  # also the backbone's end-of-audio token
FIELD_END = "<|eom_id|>"  # closes meta, language and lyrics
LYRICS_START = "<|start_header_id|>"
LINE_BREAK = "<|end_header_id|>"  # opens the lyrics and stands for every newline in them
PROMPT_END = "<|eot_id|>"
AUDIO_START = "<|python_tag|>"  # last prompt token; audio tokens follow

MODES = ("vocal", "instrumental")
MIN_DURATION_MINUTES, MAX_DURATION_MINUTES = 1, 10

LLAMA3_SPECIAL_TOKEN_COUNT = 256
BYTE_ALPHABET_SIZE = 256


def llama3_special_tokens() -> list[str]:
    """The 256 Llama-3.1 special tokens in id order (the real ids are 128000 + index)."""
    named = [
        BOS,
        EOS,
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        LYRICS_START,
        LINE_BREAK,
        FIELD_END,
        PROMPT_END,
        AUDIO_START,
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(3, LLAMA3_SPECIAL_TOKEN_COUNT - len(named) + 3)]
    return named + reserved


def duration_token(minutes: int) -> str:
    return f"<|reserved_special_token_{minutes}|>"


def duration_minutes(duration_s: float) -> int:
    """Whole minutes (half up) clamped to the 1..10 range Khala has duration tokens for."""
    minutes = int(duration_s / 60.0 + 0.5)
    return max(MIN_DURATION_MINUTES, min(MAX_DURATION_MINUTES, minutes))


@dataclass(frozen=True)
class PromptTokenIds:
    """Ids of the structural tokens in a given tokenizer."""

    bos: int
    eos: int
    field_end: int
    lyrics_start: int
    line_break: int
    prompt_end: int
    audio_start: int
    durations: dict[int, int]  # minutes -> token id


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if (
        not isinstance(token_id, int)
        or token_id == tokenizer.unk_token_id
        or tokenizer.convert_ids_to_tokens(token_id) != token
    ):
        raise ValueError(f"tokenizer has no {token!r} token; is it a Llama-3 style tokenizer?")
    return token_id


def prompt_token_ids(tokenizer: PreTrainedTokenizerFast) -> PromptTokenIds:
    minutes = range(MIN_DURATION_MINUTES, MAX_DURATION_MINUTES + 1)
    return PromptTokenIds(
        bos=_token_id(tokenizer, BOS),
        eos=_token_id(tokenizer, EOS),
        field_end=_token_id(tokenizer, FIELD_END),
        lyrics_start=_token_id(tokenizer, LYRICS_START),
        line_break=_token_id(tokenizer, LINE_BREAK),
        prompt_end=_token_id(tokenizer, PROMPT_END),
        audio_start=_token_id(tokenizer, AUDIO_START),
        durations={m: _token_id(tokenizer, duration_token(m)) for m in minutes},
    )


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Tokenizer from a local directory (tokenizer.json + tokenizer_config.json); never touches the network."""
    directory = Path(path)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)


def _text_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Plain text to ids; special-token strings typed by a user stay plain text and cannot inject structure."""
    if not text:
        return []
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def _lyrics_ids(tokenizer: PreTrainedTokenizerFast, lyrics: str, line_break: int) -> list[int]:
    ids: list[int] = []
    for index, line in enumerate(clean_lyrics(lyrics).split("\n")):
        if index:
            ids.append(line_break)
        ids.extend(_text_ids(tokenizer, line))
    return ids


def _meta_text(tags: str | None, description: str | None) -> str:
    """Khala conditions on the description when there is one, else on the tags."""
    return (description or "").strip() or (tags or "").strip()


def build_prompt(
    tokenizer: PreTrainedTokenizerFast,
    profile: MusicProfile,
    *,
    mode: str,
    tags: str | None,
    description: str | None,
    lyrics: str | None,
    duration_s: float,
    max_tokens: int = BACKBONE_MAX_PROMPT_TOKENS,
) -> list[int]:
    """Backbone prompt ids, ending with the audio-start token. Lyrics are cleaned here (cleaning is idempotent).

    When the prompt would exceed `max_tokens`, the lyrics (then the meta text) are cut so that the closing
    structure (field end, duration, prompt end, audio start) always survives.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if len(tokenizer) != profile.text_vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but profile {profile.name!r} expects {profile.text_vocab_size}"
        )
    special = prompt_token_ids(tokenizer)
    meta = _text_ids(tokenizer, _meta_text(tags, description))
    vocal = mode == "vocal"
    language = _text_ids(tokenizer, "" if vocal else INSTRUMENTAL_LANGUAGE)
    body = _lyrics_ids(tokenizer, lyrics or "", special.line_break) if vocal else []

    fixed = STRUCTURE_TOKENS + len(language) + (VOCAL_STRUCTURE_TOKENS if vocal else 0)
    room = max_tokens - fixed
    if room < 0:
        raise ValueError(f"max_tokens={max_tokens} is shorter than the prompt structure ({fixed} tokens)")
    meta = meta[:room]
    body = body[: room - len(meta)]

    ids = [special.bos, *meta, special.field_end, *language, special.field_end]
    if vocal:
        ids += [special.lyrics_start, special.line_break, *body, special.field_end]
    ids += [special.durations[duration_minutes(duration_s)], special.prompt_end, special.audio_start]
    return ids


def build_superres_prompt(
    tokenizer: PreTrainedTokenizerFast,
    profile: MusicProfile,
    *,
    mode: str,
    tags: str | None,
    description: str | None,
    lyrics: str | None,
    duration_s: float,
) -> list[int]:
    """The super-resolution prompt, as Khala's API builds it (`same_as_backbone_no_description`): the backbone's
    prompt for a song given by tags; empty metadata for a song described in words (its tags are dropped too).
    At most `profile.superres_max_prompt_tokens` tokens, cut like the backbone's."""
    described = bool((description or "").strip())
    return build_prompt(
        tokenizer,
        profile,
        mode=mode,
        tags=None if described else tags,
        description=None,
        lyrics=lyrics,
        duration_s=duration_s,
        max_tokens=profile.superres_max_prompt_tokens,
    )


def _byte_alphabet() -> list[str]:
    """The byte-level BPE alphabet in byte order: printable Latin-1 bytes stand for themselves, the rest are
    shifted above U+00FF so every byte has a visible, unique symbol."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, shifted = [], 0
    for byte in range(BYTE_ALPHABET_SIZE):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(0x100 + shifted))
            shifted += 1
    return symbols


def _merges(alphabet: list[str], count: int) -> list[tuple[str, str]]:
    """`count` deterministic merges of two printable ASCII symbols (space included), in a fixed order."""
    space = alphabet[ord(" ")]
    symbols = [space] + [alphabet[b] for b in range(ord("!"), ord("~") + 1)]
    pairs = [(first, second) for first in symbols for second in symbols]
    if count > len(pairs):
        raise ValueError(f"cannot make {count} merges for a tiny tokenizer (at most {len(pairs)})")
    return pairs[:count]


def build_tiny_tokenizer(text_vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the Llama-3 special tokens after the regular ones, `text_vocab_size` tokens in all."""
    regular = text_vocab_size - LLAMA3_SPECIAL_TOKEN_COUNT
    if regular < BYTE_ALPHABET_SIZE:
        raise ValueError(f"text_vocab_size must be at least {BYTE_ALPHABET_SIZE + LLAMA3_SPECIAL_TOKEN_COUNT}")
    alphabet = _byte_alphabet()
    merges = _merges(alphabet, regular - BYTE_ALPHABET_SIZE)
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    for first, second in merges:
        vocab[first + second] = len(vocab)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in llama3_special_tokens()])
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != text_vocab_size:
        raise AssertionError(f"tiny tokenizer has {size} tokens, expected {text_vocab_size}")
    return tokenizer


def write_tiny_tokenizer(profile: MusicProfile, directory: str | os.PathLike) -> Path:
    """Write a small Llama-3-shaped tokenizer for `profile` to `directory`, loadable by `load_tokenizer`.

    Same special-token names and order as the real one, byte-level so any unicode encodes, and exactly
    `profile.text_vocab_size` tokens so audio ids start right after it as they do for the real model.
    """
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=build_tiny_tokenizer(profile.text_vocab_size), bos_token=BOS, eos_token=EOS
    )
    wrapped.save_pretrained(str(target))
    return target
