"""ffmpeg/ffprobe work, by concern. Import from the module that does the job; nothing is re-exported here.

- `ffmpeg`: the one runner of the tools (timeouts, kills, `MediaError` with the stderr tail), the configured
  binaries, atomic output files;
- `probe`: `MediaInfo` of a file;
- `decode`: 16 kHz audio extraction, frames decoded once into a memory-mapped `FrameCache`;
- `encode`: the H.264 encoder choice and the `VideoWriter` of the lip-synced picture;
- `mux`: the final MP4 (picture from the model, sound only from the driving audio);
- `samples`: synthetic clips for the demo and the tests (not used by the pipeline).
"""
