"""Lyrics cleaning equals the Khala reference API's on every BMP character.

The reference (`Khala-Music-AI/Khala`, backend/backend_api.py) cleans lyrics with one table of replacements
applied in a single regex pass, then `str.strip()`. Its rules are written out below as data, independently of
app/pipeline/music/lyrics.py, and the cleaning is checked against them for each of the 63,488 BMP code points that
are not surrogates, alone and between other characters.
"""

from __future__ import annotations

import pytest

from app.pipeline.music.lyrics import clean_lyrics

# The reference's single-character rules. Full-width ASCII forms U+FF01..U+FF5E are listed by rule below.
REFERENCE_RULES: dict[int, str] = {
    0x3002: ".",
    0x3010: "[",
    0x3011: "]",
    0x300C: '"',
    0x300D: '"',
    0x300E: "'",
    0x300F: "'",
    0x300A: "<",
    0x300B: ">",
    0x3001: ",",
    0x201C: '"',
    0x201D: '"',
    0x2018: "'",
    0x2019: "'",
    0x2026: "...",
    0xFE4F: "_",
    0x30FB: " ",
    0x060C: ",",
    0x3016: "[",
    0x3017: "]",
    0x3008: "<",
    0x3009: ">",
    0x2013: "-",
    0x2014: "-",
    0x2015: "-",
    0xFE63: "-",
    0x2236: ":",
    0x0435: "e",
    0x0430: "a",
    0x043E: "o",
    0x0440: "p",
    0x0441: "c",
    0x0443: "y",
    0x0445: "x",
    0x0391: "A",
    0x0392: "B",
    0x0395: "E",
    0x0397: "H",
    0x0399: "I",
    0x039A: "K",
    0x039C: "M",
    0x039D: "N",
    0x039F: "O",
    0x03A1: "P",
    0x03A4: "T",
    0x03A5: "Y",
    0x03A7: "X",
    0x0396: "Z",
    0x200B: "",
    0x00A0: " ",
    0xFEFF: "",
    0x3000: " ",
    0x2005: " ",
    0x2006: " ",
    0x202A: "",
    0x202C: "",
    0x2028: " ",
    0x180E: "",
    0xE3AC: "",
    0x2032: "'",
    0x02BC: "'",
    0x00B4: "'",
    0x005E: "'",
    0x00A8: '"',
    0x00B7: ".",
    0x00D7: "x",
    0x00F7: "/",
    0x007C: "-",
    0x2605: "",
}
for _code in range(0xFF01, 0xFF5F):  # full-width ASCII: to the ASCII twin...
    REFERENCE_RULES[_code] = chr(_code - 0xFEE0)
REFERENCE_RULES[0xFF40] = "'"  # ...except the full-width grave accent,
for _code in (0xFF5B, 0xFF5C, 0xFF5D):  # ...and full-width { | }, which the reference leaves alone
    del REFERENCE_RULES[_code]

BMP = [code for code in range(0x10000) if not 0xD800 <= code <= 0xDFFF]


def expected(code: int) -> str:
    return REFERENCE_RULES.get(code, chr(code))


def test_every_bmp_character_between_others() -> None:
    wrong = [hex(code) for code in BMP if clean_lyrics(f"a{chr(code)}b") != f"a{expected(code)}b"]
    assert wrong == []


def test_every_bmp_character_alone_is_also_stripped() -> None:
    wrong = [hex(code) for code in BMP if clean_lyrics(chr(code)) != expected(code).strip()]
    assert wrong == []


def test_table_covers_what_the_reference_changes() -> None:
    changed = {code for code in BMP if clean_lyrics(f"a{chr(code)}b") != f"a{chr(code)}b"}
    assert changed == set(REFERENCE_RULES)


@pytest.mark.parametrize(
    "raw, cleaned",
    [
        ("a\u2014\u2014b", "a-b"),  # the double em dash is one rule: one hyphen
        ("a\u2014\u2014\u2014b", "a--b"),  # a pair, then a single
        ("it\u00e2\u0080\u0099s", "it's"),  # mojibake right quote
        ("don\uff3et", "don^t"),  # one pass: full-width ^ becomes ^, which is not replaced again
        ("don^t", "don't"),
        ("\uff37\uff41\uff49\uff54\uff5cfor", "Wait\uff5cfor"),  # full-width | stays
        ("\uff5bx\uff5d", "\uff5bx\uff5d"),
    ],
)
def test_sequences_and_single_pass(raw: str, cleaned: str) -> None:
    assert clean_lyrics(raw) == cleaned


def test_whitespace_inside_is_kept_outer_is_stripped() -> None:
    """The reference touches no line structure: CRLF and CR stay (\\r becomes a text token), blank lines and
    trailing spaces stay; only the text's outer whitespace goes."""
    raw = "\n  [Verse]  \r\nline one\t\r\n\r\n\r\n\r\nline two \rline three\n\n\n"
    assert clean_lyrics(raw) == "[Verse]  \r\nline one\t\r\n\r\n\r\n\r\nline two \rline three"


def test_other_scripts_and_emoji_are_kept() -> None:
    text = "你好 こんにちは 안녕 жизнь مرحبا 🎵 \U0001f468\u200d\U0001f469"
    assert clean_lyrics(text) == text
