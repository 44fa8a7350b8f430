"""The choices the music pipeline offers, named where it implements them (no heavy imports here, so the settings
module, the control plane and the web can import them without torch)."""

from __future__ import annotations

DEFAULT_SLOT_CAP = 16  # an engine's slots at most when sized from free memory (slots.default_slots)
