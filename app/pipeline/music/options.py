"""The choices the music pipeline offers, named where it implements them (no heavy imports here, so the settings
module, the control plane and the web can import them without torch)."""

from __future__ import annotations

# an engine's slots at most when sized from free memory (slots.default_slots). 32: a step of 32 rows costs less
# than two of 16 on a memory-bound GPU (about one) and on the 2-core CPU of bench/throughput.py (1.5x), and the
# batched engine runs only the 16-row tiles in use, so slots past the tracks cost nothing there
DEFAULT_SLOT_CAP = 32
