"""The music pipeline (Khala-style): lyrics and tags → backbone (coarse codes) → superres (all codebooks) →
codec decode (44.1 kHz stereo) → export (WAV, MP3, JSON).

`stages.py` holds the four stages as plain functions over files; the other modules are the parts they use.
Nothing is imported here: the web imports `lyrics` without pulling in torch or megatron-core.
"""
