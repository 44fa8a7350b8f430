"""The prepare stage reads only what the output shows, within a scratch bound (issue 22, item 5): a short output
of a long face video decodes and searches the leading frames it shows, not the whole clip, and a stage whose
frames would pass ENCORE_MAX_SCRATCH_MB fails saying so. Real ffmpeg, real face finding, no Celery."""

from __future__ import annotations

import pytest

from app.pipeline.control import StageControl
from app.pipeline.lipsync import stages
from app.pipeline.lipsync.frames import source_frame, source_frames_shown, source_frames_to_decode
from app.pipeline.media.ffmpeg import MediaError
from harness.media import face_video, tone


@pytest.mark.parametrize("num_frames", [1, 2, 49, 50, 51, 100, 251])
@pytest.mark.parametrize(
    "source_fps, out_fps",
    [(None, 25.0), (25.0, 25.0), (30.0, 25.0), (24.0, 25.0), (29.97, 29.97), (60.0, 24.0), (12.5, 25.0)],
)
@pytest.mark.parametrize("held", [1, 7, 40, 60, 300])
def test_the_frames_shown_give_every_output_frame_what_the_whole_video_would(num_frames, source_fps, out_fps, held):
    """Decoding min(held, shown) frames changes no output frame's source frame, and nothing past them is shown."""
    shown = source_frames_shown(num_frames, source_fps, out_fps)
    kept = min(held, shown)
    for i in range(num_frames):
        whole = source_frame(i, held, source_fps, out_fps)
        assert whole < kept and source_frame(i, kept, source_fps, out_fps) == whole, (i, whole, kept)
    if held >= shown:  # the bound is tight: the last one counted is shown
        assert max(source_frame(i, held, source_fps, out_fps) for i in range(num_frames)) == shown - 1


@pytest.mark.parametrize("shown, decoded", [(0, 256), (1, 256), (50, 256), (256, 256), (257, 512), (3000, 4096)])
def test_the_frames_decoded_round_what_is_shown_up_to_a_power_of_two(shown, decoded):
    assert source_frames_to_decode(shown) == decoded


def test_a_short_output_of_a_long_video_decodes_the_frames_it_shows_rounded_up(tmp_path):
    video = face_video(tmp_path / "long.mp4", 24.0, size=64)  # 600 frames at 25 fps
    audio = tone(tmp_path / "voice.wav", 2.0)  # 50 output frames: 256 decoded (source_frames_to_decode)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    info = stages.run_prepare(video, audio, 25.0, scratch, StageControl(), 120)
    assert info["output_frames"] == 50
    assert info["source_frames"] == 256  # not 600
    assert (scratch / stages.FRAMES).stat().st_size == 256 * 64 * 64 * 3


def test_a_stage_whose_frames_would_pass_the_scratch_bound_fails_saying_so(tmp_path):
    video = face_video(tmp_path / "face.mp4", 3.2)
    audio = tone(tmp_path / "voice.wav", 2.0)  # the clip's 80 frames of 256x256 RGB (all read): 15 MiB
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(MediaError, match="ENCORE_MAX_SCRATCH_MB"):
        stages.run_prepare(video, audio, 25.0, scratch, StageControl(), 120, max_scratch_bytes=10 * 2**20)
    assert not (scratch / stages.FRAMES).exists()
    info = stages.run_prepare(video, audio, 25.0, scratch, StageControl(), 120, max_scratch_bytes=16 * 2**20)
    assert info["source_frames"] == 80
