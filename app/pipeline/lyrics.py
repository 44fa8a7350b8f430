"""Lyrics cleaning in the style Khala's training data was cleaned with.

Khala's backbone saw lyrics that were normalised to plain ASCII punctuation, so user text is mapped the same way
before it is tokenized: full-width forms and CJK punctuation become ASCII, Cyrillic/Greek letters that look like
Latin ones become Latin, invisible characters are dropped, `|` becomes `-`, `^` becomes `'` and `★` goes away.
Every newline later becomes a header token in the prompt, so line breaks are normalised too.

Deliberate differences from the reference table (which is applied in a single pass): every full-width ASCII form
(U+FF01..U+FF5E) is mapped, and the mapping is composed so that the output never contains `|` or `^`, even when
they came from their full-width forms. A few more zero-width characters (ZWNJ, ZWJ, word joiner) are removed.
"""
from __future__ import annotations

import re

_FULLWIDTH_FIRST, _FULLWIDTH_LAST = 0xFF01, 0xFF5E
_FULLWIDTH_SHIFT = 0xFEE0  # U+FF01 (full-width '!') minus ord('!')

# ASCII characters the model should never see, and what they become.
_ASCII_RULES: dict[str, str] = {"|": "-", "^": "'"}

# Full-width forms whose ASCII twin is not what Khala writes.
_FULLWIDTH_EXCEPTIONS: dict[str, str] = {"\uff40": "'"}  # full-width grave accent

_PUNCTUATION: dict[str, str] = {
    # CJK and typographic punctuation
    "\u3002": ".", "\u3001": ",", "\u300c": '"', "\u300d": '"', "\u300e": "'", "\u300f": "'",
    "\u300a": "<", "\u300b": ">", "\u3008": "<", "\u3009": ">", "\u3010": "[", "\u3011": "]",
    "\u3016": "[", "\u3017": "]", "\u30fb": " ", "\ufe4f": "_", "\ufe63": "-", "\u060c": ",",
    "\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'", "\u2032": "'", "\u02bc": "'",
    "\u00b4": "'", "\u00a8": '"', "\u2026": "...", "\u2013": "-", "\u2014": "-", "\u2015": "-",
    "\u2236": ":", "\u00b7": ".", "\u00d7": "x", "\u00f7": "/",
    "\u2605": "",  # black star
}

_LOOKALIKES: dict[str, str] = {
    # Cyrillic lower case
    "\u0430": "a", "\u0435": "e", "\u043e": "o", "\u0440": "p", "\u0441": "c", "\u0443": "y", "\u0445": "x",
    # Greek capitals
    "\u0391": "A", "\u0392": "B", "\u0395": "E", "\u0396": "Z", "\u0397": "H", "\u0399": "I", "\u039a": "K",
    "\u039c": "M", "\u039d": "N", "\u039f": "O", "\u03a1": "P", "\u03a4": "T", "\u03a5": "Y", "\u03a7": "X",
}

_INVISIBLE: dict[str, str] = {
    # removed: zero-width characters, BOM, bidi embedding marks, Mongolian vowel separator, a private-use glyph
    "\u200b": "", "\u200c": "", "\u200d": "", "\u2060": "", "\ufeff": "", "\u202a": "", "\u202c": "",
    "\u180e": "", "\ue3ac": "",
    # odd spaces become a plain space
    "\u00a0": " ", "\u3000": " ", "\u2005": " ", "\u2006": " ", "\u2028": " ",
}

# Multi-character sequences, replaced before the per-character table.
_SEQUENCES: dict[str, str] = {
    "\u2014\u2014": "-",  # Chinese double em dash
    "\u00e2\u0080\u0099": "'",  # UTF-8 right quote mis-decoded as Latin-1
}


def _fullwidth_table() -> dict[str, str]:
    table = {chr(code): chr(code - _FULLWIDTH_SHIFT) for code in range(_FULLWIDTH_FIRST, _FULLWIDTH_LAST + 1)}
    table.update(_FULLWIDTH_EXCEPTIONS)
    return table


def _build_translation() -> dict[int, str]:
    """One table for str.translate; ASCII rules are applied to every target so the mapping is composed."""
    combined: dict[str, str] = {}
    for table in (_fullwidth_table(), _PUNCTUATION, _LOOKALIKES, _INVISIBLE):
        combined.update(table)
    composed = {source: "".join(_ASCII_RULES.get(ch, ch) for ch in target) for source, target in combined.items()}
    composed.update(_ASCII_RULES)
    return str.maketrans(composed)


_TRANSLATION = _build_translation()
_SEQUENCE_PATTERN = re.compile("|".join(re.escape(seq) for seq in _SEQUENCES))
_TRAILING_SPACE = re.compile(r"[ \t]+$", flags=re.MULTILINE)
_EXTRA_BLANK_LINES = re.compile(r"\n{3,}")


def normalise_characters(text: str) -> str:
    """Apply the character mapping only (no whitespace changes)."""
    text = _SEQUENCE_PATTERN.sub(lambda match: _SEQUENCES[match.group(0)], text)
    return text.translate(_TRANSLATION)


def normalise_whitespace(text: str) -> str:
    """CRLF/CR to LF, no trailing spaces, at most one blank line in a row, no outer blank space.

    Each newline turns into a header token in the prompt, so stray blank lines would cost tokens and
    look unlike the training lyrics (sections separated by a single blank line).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_SPACE.sub("", text)
    text = _EXTRA_BLANK_LINES.sub("\n\n", text)
    return text.strip()


def clean_lyrics(text: str) -> str:
    """Lyrics as the Khala backbone expects them. Idempotent: cleaning twice changes nothing."""
    return normalise_whitespace(normalise_characters(text))
