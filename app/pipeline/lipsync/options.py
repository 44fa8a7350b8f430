"""The choices the lip-sync pipeline offers, named where it implements them (no heavy imports here, so the
settings module and the web can import them without torch): app/core/config.py validates its variables
against these."""

from __future__ import annotations

LIPSYNC_PRECISIONS = ("auto", "fp16", "fp32")  # musetalk.resolve_dtype
LIPSYNC_MASKS = ("jaw", "rectangle")  # inference.py draws them
LIPSYNC_PATHS = ("device", "reference")  # inference.run_lipsync's two ways of doing the per-frame work
