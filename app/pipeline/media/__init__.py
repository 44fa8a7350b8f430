"""ffmpeg/ffprobe work (being split by concern: this re-export is removed by the next commit)."""
from app.pipeline.media.ffmpeg import *  # noqa: F401,F403
from app.pipeline.media.ffmpeg import MediaError  # noqa: F401
