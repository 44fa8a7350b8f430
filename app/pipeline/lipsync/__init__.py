"""The lip-sync pipeline (MuseTalk v1.5): prepare (probe, 16 kHz audio, frames decoded once, faces) →
lipsync (MuseTalk inference) → mux (picture from the model, sound only from the driving audio).

`stages.py` holds the three stages as plain functions over a track's scratch folder; `inference.py` runs
MuseTalk over frames; `musetalk.py` loads its models; `faces.py` finds face landmarks and boxes; `frames.py` is the frame
vocabulary they share. Nothing is imported here: the web imports `frames` without pulling in torch.
"""
