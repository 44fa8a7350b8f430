"""The choices the music pipeline offers, named where it implements them (no heavy imports here, so the settings
module, the control plane and the web can import them without torch)."""

from __future__ import annotations

# an engine's slots at most when sized from free memory (slots.default_slots). 16, not more: on the 2-core CPU of
# bench/throughput.py a 32-row step costs 1.5x a 16-row one, which gave the burst a little (its list of other
# stages, the same work in any mode, dominates there) and doubled a newcomer's latency amid a backlog (2.0x its
# time alone against 1.28x at 16; docs/performance.md). ENCORE_BACKBONE_SLOTS sets more where a step is
# memory-bound (a GPU); the batched engine then runs only the 16-row tiles in use
DEFAULT_SLOT_CAP = 16
