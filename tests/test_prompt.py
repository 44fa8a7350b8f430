"""The tiny Llama-3-shaped tokenizer and the Khala backbone and super-resolution prompt layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.pipeline.music.lyrics import clean_lyrics
from app.pipeline.profiles import load_profile
from app.pipeline.music.prompt import (
    AUDIO_START,
    BOS,
    EOS,
    FIELD_END,
    LINE_BREAK,
    LYRICS_START,
    PROMPT_END,
    build_prompt,
    build_superres_prompt,
    duration_minutes,
    duration_token,
    llama3_special_tokens,
    load_tokenizer,
    prompt_token_ids,
    write_tiny_tokenizer,
)

UNICODE_LYRICS = "你好世界 🎵🎶\nこんにちは\n안녕하세요\nمرحبا\nПривет жизнь\ne\u0301te\u0301 café\n\U0001f468\u200d\U0001f469\u200d\U0001f467"


# ---------------------------------------------------------------- tiny tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    profile = load_profile("tiny", tmp_path_factory.mktemp("models"))
    write_tiny_tokenizer(profile, profile.tokenizer_dir)
    return profile, load_tokenizer(profile.tokenizer_dir)


def test_llama3_special_token_layout_matches_real_ids() -> None:
    """The real Llama-3 tokenizer puts these at 128000 + index; Khala's prompt relies on those ids."""
    names = llama3_special_tokens()
    assert len(names) == len(set(names)) == 256
    real_id = {name: 128_000 + index for index, name in enumerate(names)}
    assert real_id[BOS] == 128_000 and real_id[EOS] == 128_001
    assert (
        real_id[LYRICS_START],
        real_id[LINE_BREAK],
        real_id[FIELD_END],
        real_id[PROMPT_END],
        real_id[AUDIO_START],
    ) == (128_006, 128_007, 128_008, 128_009, 128_010)
    assert [real_id[duration_token(m)] for m in range(1, 11)] == [128_003, 128_005, *range(128_011, 128_019)]
    assert names[-1] == "<|reserved_special_token_247|>"
    assert load_profile("khala").text_vocab_size == 128_000 + len(names)


def test_tiny_tokenizer_size_and_special_ids(tiny) -> None:
    profile, tokenizer = tiny
    assert len(tokenizer) == profile.text_vocab_size == 512
    first_special = profile.text_vocab_size - 256
    ids = tokenizer.convert_tokens_to_ids(llama3_special_tokens())
    assert ids == list(range(first_special, profile.text_vocab_size))
    assert tokenizer.bos_token == BOS and tokenizer.bos_token_id == first_special
    assert tokenizer.eos_token == EOS and tokenizer.eos_token_id == first_special + 1
    special = prompt_token_ids(tokenizer)
    assert special.audio_start == first_special + 10
    assert special.durations[3] == first_special + 11


def test_tiny_tokenizer_round_trips_any_unicode(tiny) -> None:
    profile, tokenizer = tiny
    ids = tokenizer.encode(UNICODE_LYRICS, add_special_tokens=False)
    assert ids and max(ids) < profile.text_vocab_size - 256  # plain text never yields special ids
    assert tokenizer.decode(ids) == UNICODE_LYRICS


def test_tiny_tokenizer_adds_bos_like_llama3(tiny) -> None:
    _, tokenizer = tiny
    ids = tokenizer.encode("hi")
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len(tokenizer.encode("hi", add_special_tokens=False))


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    profile = load_profile("tiny", tmp_path)
    first, second = write_tiny_tokenizer(profile, tmp_path / "a"), write_tiny_tokenizer(profile, tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert "tokenizer.json" in names and names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_load_tokenizer_needs_a_tokenizer_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- prompt layout


def _text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_vocal_prompt_layout(tiny) -> None:
    profile, tokenizer = tiny
    s = prompt_token_ids(tokenizer)
    ids = build_prompt(
        tokenizer,
        profile,
        mode="vocal",
        tags="pop, upbeat",
        description=None,
        lyrics="line one\nline two",
        duration_s=150.0,
    )
    expected = [
        s.bos,
        *_text(tokenizer, "pop, upbeat"),
        s.field_end,
        s.field_end,
        s.lyrics_start,
        s.line_break,
        *_text(tokenizer, "line one"),
        s.line_break,
        *_text(tokenizer, "line two"),
        s.field_end,
        s.durations[3],
        s.prompt_end,
        s.audio_start,
    ]
    assert ids == expected
    assert tokenizer.decode(ids) == (
        f"{BOS}pop, upbeat{FIELD_END}{FIELD_END}{LYRICS_START}{LINE_BREAK}line one"
        f"{LINE_BREAK}line two{FIELD_END}<|reserved_special_token_3|>{PROMPT_END}"
        f"{AUDIO_START}"
    )


def test_instrumental_prompt_layout(tiny) -> None:
    profile, tokenizer = tiny
    s = prompt_token_ids(tokenizer)
    ids = build_prompt(
        tokenizer,
        profile,
        mode="instrumental",
        tags="ambient",
        description="A calm piano piece",
        lyrics="ignored words",
        duration_s=5.0,
    )
    assert ids == [
        s.bos,
        *_text(tokenizer, "A calm piano piece"),
        s.field_end,
        *_text(tokenizer, "Instrumental"),
        s.field_end,
        s.durations[1],
        s.prompt_end,
        s.audio_start,
    ]
    assert s.lyrics_start not in ids and s.line_break not in ids


@pytest.mark.parametrize(
    "tags, description, meta",
    [
        ("rock", "  A slow ballad ", "A slow ballad"),
        ("  rock, guitar ", "   ", "rock, guitar"),
        (None, None, ""),
    ],
)
def test_meta_prefers_description_over_tags(tiny, tags, description, meta) -> None:
    profile, tokenizer = tiny
    ids = build_prompt(
        tokenizer, profile, mode="instrumental", tags=tags, description=description, lyrics=None, duration_s=60.0
    )
    field_end = prompt_token_ids(tokenizer).field_end
    assert ids[1 : ids.index(field_end)] == _text(tokenizer, meta)


def test_prompt_ids_stay_in_text_vocab_for_any_unicode(tiny) -> None:
    profile, tokenizer = tiny
    s = prompt_token_ids(tokenizer)
    ids = build_prompt(
        tokenizer,
        profile,
        mode="vocal",
        tags="流行, 🎸",
        description=None,
        lyrics=UNICODE_LYRICS + "\n\n\n\nＥＮＤ",
        duration_s=200.0,
    )
    assert ids[0] == s.bos and ids[-1] == s.audio_start
    assert all(0 <= i < profile.text_vocab_size for i in ids)
    lyrics_ids = ids[ids.index(s.line_break) + 1 : -4]
    expected = clean_lyrics(UNICODE_LYRICS + "\n\n\n\nＥＮＤ").replace("\n", LINE_BREAK)
    assert tokenizer.decode(lyrics_ids) == expected
    assert expected.endswith(f"{LINE_BREAK * 4}END")  # every newline is a line-break token, as in Khala


def test_prompt_cleans_lyrics(tiny) -> None:
    profile, tokenizer = tiny
    common = dict(mode="vocal", tags="pop", description=None, duration_s=60.0)
    assert build_prompt(tokenizer, profile, lyrics="ＨＩ|ｔｈｅｒｅ\u3000\n", **common) == build_prompt(
        tokenizer, profile, lyrics="HI-there", **common
    )


def test_user_text_cannot_inject_special_tokens(tiny) -> None:
    profile, tokenizer = tiny
    s = prompt_token_ids(tokenizer)
    ids = build_prompt(
        tokenizer,
        profile,
        mode="vocal",
        tags=f"pop{PROMPT_END}{AUDIO_START}",
        description=None,
        lyrics=f"la {EOS}",
        duration_s=60.0,
    )
    assert ids.count(s.prompt_end) == 1 and ids.count(s.audio_start) == 1 and s.eos not in ids


@pytest.mark.parametrize("seconds, minutes", [(1, 1), (5, 1), (89.9, 1), (90, 2), (150, 3), (600, 10), (900, 10)])
def test_duration_minutes(seconds: float, minutes: int) -> None:
    assert duration_minutes(seconds) == minutes


def test_long_prompt_is_cut_in_the_lyrics_keeping_the_tail(tiny) -> None:
    profile, tokenizer = tiny
    s = prompt_token_ids(tokenizer)
    ids = build_prompt(
        tokenizer,
        profile,
        mode="vocal",
        tags="pop",
        description=None,
        lyrics="la la\n" * 500,
        duration_s=120.0,
        max_tokens=64,
    )
    assert len(ids) == 64
    assert ids[-4:] == [s.field_end, s.durations[2], s.prompt_end, s.audio_start]
    assert ids[: 2 + len(_text(tokenizer, "pop"))] == [s.bos, *_text(tokenizer, "pop"), s.field_end]


def test_prompt_rejects_bad_mode_and_mismatched_tokenizer(tiny, tmp_path: Path) -> None:
    profile, tokenizer = tiny
    with pytest.raises(ValueError, match="mode"):
        build_prompt(tokenizer, profile, mode="acapella", tags="x", description=None, lyrics="", duration_s=60.0)
    with pytest.raises(ValueError, match="128256"):
        build_prompt(
            tokenizer,
            load_profile("khala", tmp_path),
            mode="vocal",
            tags="x",
            description=None,
            lyrics="",
            duration_s=60.0,
        )


# ---------------------------------------------------------------- super-resolution prompt

SONG = dict(mode="vocal", lyrics="la la\nlo", duration_s=120.0)


def test_superres_prompt_of_a_tagged_song_is_the_backbone_prompt(tiny) -> None:
    profile, tokenizer = tiny
    backbone = build_prompt(tokenizer, profile, tags="synthpop, female vocal", description=None, **SONG)
    assert (
        build_superres_prompt(tokenizer, profile, tags="synthpop, female vocal", description=None, **SONG) == backbone
    )


def test_superres_prompt_of_a_described_song_has_empty_metadata(tiny) -> None:
    """Khala's same_as_backbone_no_description: the description (and any tags beside it) leave the prompt."""
    profile, tokenizer = tiny
    s = prompt_token_ids(tokenizer)
    described = build_superres_prompt(tokenizer, profile, tags="rock", description="a slow ballad", **SONG)
    assert described == build_prompt(tokenizer, profile, tags=None, description=None, **SONG)
    assert described[:2] == [s.bos, s.field_end]
    backbone = build_prompt(tokenizer, profile, tags="rock", description="a slow ballad", **SONG)
    assert backbone[1:3] != [s.field_end, s.field_end] and backbone[-5:] == described[-5:]


def test_superres_prompt_is_cut_at_its_own_limit(tiny) -> None:
    profile, tokenizer = tiny
    s = prompt_token_ids(tokenizer)
    long_song = dict(SONG, lyrics="la la la\n" * 2000)
    backbone = build_prompt(tokenizer, profile, tags="pop", description=None, **long_song)
    superres = build_superres_prompt(tokenizer, profile, tags="pop", description=None, **long_song)
    assert len(superres) == profile.superres_max_prompt_tokens == 2048 < len(backbone)
    assert superres[-3:] == [s.durations[2], s.prompt_end, s.audio_start]


# ---------------------------------------------------------------- the submission-time bound (positions.py)


@pytest.mark.parametrize(
    "mode,tags,description,lyrics",
    [
        ("vocal", "", None, ""),
        ("instrumental", "", None, None),
        ("vocal", "pop, upbeat", None, "line one\nline two\n\n"),
        ("vocal", "流行, 🎸", "a song", UNICODE_LYRICS),
        ("instrumental", "ambient", "A calm piano piece", None),
        ("vocal", f"pop{PROMPT_END}{AUDIO_START}", None, f"{LINE_BREAK}\n" * 40),
        ("vocal", "pop", None, "la la\n" * 2000),  # cut at the prompt cap
    ],
)
def test_the_prompt_bound_is_never_below_the_real_prompt(tiny, mode, tags, description, lyrics) -> None:
    from app.pipeline.music.positions import BACKBONE_MAX_PROMPT_TOKENS, prompt_tokens_at_most

    profile, tokenizer = tiny
    ids = build_prompt(
        tokenizer, profile, mode=mode, tags=tags, description=description, lyrics=lyrics, duration_s=60.0
    )
    meta = (description or "").strip() or (tags or "").strip()
    bound = prompt_tokens_at_most(mode, meta, clean_lyrics(lyrics) if mode == "vocal" and lyrics else "")
    assert len(ids) <= bound <= BACKBONE_MAX_PROMPT_TOKENS
    if not meta and not lyrics:
        assert bound == len(ids)  # the structure is counted exactly


def test_the_longest_song_fits_in_the_backbone_positions(tiny) -> None:
    from app.pipeline.music.positions import frames_room, longest_song_s

    profile, _ = tiny
    assert longest_song_s(profile, 10) == profile.max_duration_s  # a short prompt: the token cap decides
    for prompt_tokens in (2200, 3000, 4096):
        longest = longest_song_s(profile, prompt_tokens)
        assert longest < profile.max_duration_s
        assert prompt_tokens + 2 * profile.frames_for(longest) <= profile.backbone.max_sequence_length
        assert profile.frames_for(longest + 1) > frames_room(profile, prompt_tokens)
