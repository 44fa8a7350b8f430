"""Request schemas (pydantic): one definition validates input and names the offending field."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.pipeline.music.lyrics import clean_lyrics
from app.pipeline.music.positions import longest_song_for

MAX_SEED = 2**31 - 1


class MusicRequest(BaseModel):
    """POST /api/v1/music. Limits that depend on deployment (duration range, track count, text sizes)
    come from the validation context: {"min_duration_s", "max_duration_s", "max_tracks", ...}."""

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["vocal", "instrumental"] = "vocal"
    tags: str | None = None
    prompt: str | None = Field(default=None, description="natural-language description of the song")
    lyrics: str | None = None
    duration_s: float | None = Field(default=None, description="song length in seconds")
    num_tracks: int = Field(default=2, ge=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    temperature: float = Field(default=1.0, ge=0.6, le=1.4)
    top_k: int = Field(default=80, ge=1, le=200)

    @field_validator("tags", "prompt", "lyrics")
    @classmethod
    def _strip(cls, value: str | None, info) -> str | None:
        if not isinstance(value, str):
            return value
        bad = untokenizable(value)
        if bad is not None:
            raise _field_error(info.field_name, bad)
        return value.strip()

    @model_validator(mode="after")
    def _deployment_limits(self, info) -> "MusicRequest":
        limits = info.context or {}
        max_text = limits.get("max_text_chars", 1000)
        for name in ("tags", "prompt"):
            value = getattr(self, name)
            if value and len(value) > max_text:
                raise _field_error(name, f"at most {max_text} characters")
        if not (self.tags or self.prompt):
            raise _field_error("tags", "give tags or a prompt describing the music")
        if self.lyrics and len(self.lyrics) > limits.get("max_lyrics_chars", 8000):
            raise _field_error("lyrics", f"at most {limits.get('max_lyrics_chars', 8000)} characters")
        if self.mode == "vocal":
            if not self.lyrics or not clean_lyrics(self.lyrics).strip():
                raise _field_error("lyrics", "required in vocal mode")
        low, high = limits.get("min_duration_s", 1.0), limits.get("max_duration_s", 600.0)
        if self.duration_s is None:
            self.duration_s = limits.get("default_duration_s", low)
        if not low <= self.duration_s <= high:
            raise _field_error("duration_s", f"must be between {low:g} and {high:g} seconds")
        profile = limits.get("profile")
        if profile is not None:
            longest = longest_song_for(profile, mode=self.mode, tags=self.tags, description=self.prompt,
                                       lyrics=self.lyrics)
            if self.duration_s > longest:
                raise _field_error("duration_s", f"at most {longest:g} seconds with this prompt and lyrics (the "
                                   f"model holds {profile.backbone.max_sequence_length} positions, prompt included)")
        max_tracks = limits.get("max_tracks", 4)
        if self.num_tracks > max_tracks:
            raise _field_error("num_tracks", f"at most {max_tracks}")
        return self


def untokenizable(text: str) -> str | None:
    """Why the tokenizer could not take `text` (a lone surrogate, which has no UTF-8 form; a control
    character other than tab and line breaks), or None."""
    for position, char in enumerate(text):
        code = ord(char)
        if 0xD800 <= code <= 0xDFFF:
            return f"contains a lone surrogate U+{code:04X} at position {position} (not valid Unicode text)"
        if (code < 0x20 and char not in "\t\n\r") or 0x7F <= code < 0xA0:
            return f"contains the control character U+{code:04X} at position {position}"
    return None


class FieldError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _field_error(field: str, message: str) -> FieldError:
    return FieldError(field, message)


def describe_validation_error(error: ValidationError) -> tuple[str, str]:
    """(field, message) for the first problem, in words a client can act on."""
    first = error.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return cause.field, cause.message
    field = ".".join(str(part) for part in first["loc"]) or "body"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    return field, message


class Accepted(BaseModel):
    """202 reply to a submission."""

    job_id: str
    status_url: str
    queue_position: int
    state: str
    note: str | None = None


class ErrorReply(BaseModel):
    """Every 4xx/5xx body: a message that names the field when one is at fault."""

    error: str
    field: str | None = None
