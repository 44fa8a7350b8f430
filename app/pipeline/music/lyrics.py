"""Lyrics cleaning exactly as Khala's API cleans them before they reach its backbone.

Khala's backbone saw lyrics normalised to plain ASCII punctuation, so user text is mapped the same way: full-width
forms and CJK punctuation become ASCII, Cyrillic/Greek letters that look like Latin ones become Latin, a few
invisible characters are dropped and odd spaces become plain ones, `|` becomes `-`, `^` becomes `'` and `★` goes
away; then outer whitespace is stripped. The reference applies its table in one pass (a character's replacement
is never replaced again: `＾` gives `^`, not `'`), leaves everything else alone (line breaks, `\r`, inner blank
lines, trailing spaces: each newline later becomes a header token in the prompt, and `\r` a text token), and
Encore does the same, character for character (tests/test_lyrics.py checks every BMP character).
"""

from __future__ import annotations

import re

_FULLWIDTH_FIRST, _FULLWIDTH_LAST = 0xFF01, 0xFF5E
_FULLWIDTH_SHIFT = 0xFEE0  # U+FF01 (full-width '!') minus ord('!')

# Full-width forms the reference does not map to their ASCII twin.
_FULLWIDTH_EXCEPTIONS: dict[str, str | None] = {
    "\uff40": "'",  # full-width grave accent -> apostrophe
    "\uff5b": None,
    "\uff5c": None,
    "\uff5d": None,  # full-width { | } stay as they are
}

_PUNCTUATION: dict[str, str] = {
    # CJK and typographic punctuation
    "\u3002": ".",
    "\u3001": ",",
    "\u300c": '"',
    "\u300d": '"',
    "\u300e": "'",
    "\u300f": "'",
    "\u300a": "<",
    "\u300b": ">",
    "\u3008": "<",
    "\u3009": ">",
    "\u3010": "[",
    "\u3011": "]",
    "\u3016": "[",
    "\u3017": "]",
    "\u30fb": " ",
    "\ufe4f": "_",
    "\ufe63": "-",
    "\u060c": ",",
    "\u201c": '"',
    "\u201d": '"',
    "\u2018": "'",
    "\u2019": "'",
    "\u2032": "'",
    "\u02bc": "'",
    "\u00b4": "'",
    "\u00a8": '"',
    "\u2026": "...",
    "\u2013": "-",
    "\u2014": "-",
    "\u2015": "-",
    "\u2236": ":",
    "\u00b7": ".",
    "\u00d7": "x",
    "\u00f7": "/",
    "\u2605": "",  # black star
    # ASCII characters the model should never see
    "|": "-",
    "^": "'",
}

_LOOKALIKES: dict[str, str] = {
    # Cyrillic lower case
    "\u0430": "a",
    "\u0435": "e",
    "\u043e": "o",
    "\u0440": "p",
    "\u0441": "c",
    "\u0443": "y",
    "\u0445": "x",
    # Greek capitals
    "\u0391": "A",
    "\u0392": "B",
    "\u0395": "E",
    "\u0396": "Z",
    "\u0397": "H",
    "\u0399": "I",
    "\u039a": "K",
    "\u039c": "M",
    "\u039d": "N",
    "\u039f": "O",
    "\u03a1": "P",
    "\u03a4": "T",
    "\u03a5": "Y",
    "\u03a7": "X",
}

_INVISIBLE: dict[str, str] = {
    # removed: zero-width space, BOM, bidi embedding marks, Mongolian vowel separator, a private-use glyph
    "\u200b": "",
    "\ufeff": "",
    "\u202a": "",
    "\u202c": "",
    "\u180e": "",
    "\ue3ac": "",
    # odd spaces become a plain space
    "\u00a0": " ",
    "\u3000": " ",
    "\u2005": " ",
    "\u2006": " ",
    "\u2028": " ",
}

# Multi-character sequences, matched before single characters (their outputs are not in any table, so
# replacing them first gives what one pass over the text gives).
_SEQUENCES: dict[str, str] = {
    "\u2014\u2014": "-",  # Chinese double em dash -> one hyphen
    "\u00e2\u0080\u0099": "'",  # UTF-8 right quote mis-decoded as Latin-1
}


def _fullwidth_table() -> dict[str, str]:
    table = {chr(code): chr(code - _FULLWIDTH_SHIFT) for code in range(_FULLWIDTH_FIRST, _FULLWIDTH_LAST + 1)}
    for char, replacement in _FULLWIDTH_EXCEPTIONS.items():
        if replacement is None:
            del table[char]
        else:
            table[char] = replacement
    return table


def _character_table() -> dict[str, str]:
    """Every single character the cleaning replaces, and what it becomes ('' = removed)."""
    combined: dict[str, str] = {}
    for table in (_fullwidth_table(), _PUNCTUATION, _LOOKALIKES, _INVISIBLE):
        combined.update(table)
    return combined


_TRANSLATION = str.maketrans(_character_table())
_SEQUENCE_PATTERN = re.compile("|".join(re.escape(seq) for seq in _SEQUENCES))


def normalise_characters(text: str) -> str:
    """Apply the character mapping only (no whitespace changes)."""
    text = _SEQUENCE_PATTERN.sub(lambda match: _SEQUENCES[match.group(0)], text)
    return text.translate(_TRANSLATION)


def clean_lyrics(text: str) -> str:
    """Lyrics as the Khala backbone expects them: the reference's mapping, then outer whitespace stripped."""
    return normalise_characters(text).strip()
