"""Lip-sync jobs through HTTP on a real worker: MuseTalk at tiny size, real ffmpeg, real face photo."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest

from app.pipeline.media.probe import probe
from harness.processes import wait_until
from harness.media import blank_video, face_video, tone, upload

FPS = 25


@pytest.fixture
def stack(make_stack):
    stack = make_stack()
    stack.start_worker(0)
    return stack


def _submit(stack, video, audio, **fields) -> str:
    reply = upload(stack.client, video, audio, **fields)
    assert reply.status_code == 202, reply.get_json()
    return reply.get_json()["job_id"]


def _download(stack, job_id, tmp_path):
    reply = stack.client.get(f"/api/v1/jobs/{job_id}/video.mp4")
    assert reply.status_code == 200 and reply.headers["Content-Type"] == "video/mp4"
    path = tmp_path / f"{job_id}.mp4"
    path.write_bytes(reply.data)
    return path


def _streams(path) -> list[str]:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-show_entries", "stream=codec_type", "-of", "csv=p=0", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return out.split()


def _pcm(path, seconds: float | None = None) -> np.ndarray:
    argv = ["ffmpeg", "-v", "error", "-i", str(path), "-map", "0:a:0", "-ac", "1", "-ar", "16000", "-f", "s16le", "-"]
    raw = subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout
    return np.frombuffer(raw, np.int16).astype(np.float64)


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    n = min(len(a), len(b))
    a, b = a[:n] - a[:n].mean(), b[:n] - b[:n].mean()
    return float(abs(np.dot(a, b)) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-9))


def _frame_means(path) -> np.ndarray:
    info = probe(path)
    argv = ["ffmpeg", "-v", "error", "-i", str(path), "-f", "rawvideo", "-pix_fmt", "gray", "-"]
    raw = subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout
    return np.frombuffer(raw, np.uint8).reshape(-1, info.height * info.width).mean(axis=1)


def test_lipsync_job_output_has_driving_audio_and_exact_frames(stack, tmp_path):
    own_track = tone(tmp_path / "own.wav", 3.2, freq=440.0)
    video = face_video(tmp_path / "face.mp4", 3.2, FPS, audio=own_track)  # the source's own, different sound
    driving = tone(tmp_path / "driving.wav", 2.0, freq=1375.0)
    job_id = _submit(stack, video, driving, fps=FPS)
    record = stack.wait_job(job_id, timeout=180)
    assert record["state"] == "done", record
    track = record["tracks"][0]
    assert [s for s in ("prepare", "lipsync", "mux") if s in track["stages"]] == ["prepare", "lipsync", "mux"]
    assert track["stages"]["lipsync"]["info"]["frames_generated"] == 50
    assert track["stages"]["lipsync"]["info"]["profile"] == "tiny"  # which MuseTalk models served it
    assert track["stages"]["prepare"]["info"]["faces"] == "landmarks"  # dlib's 68 points on the astronaut
    assert (track["stages"]["lipsync"]["info"]["mask"], track["stages"]["lipsync"]["info"]["faces"]) == (
        "jaw",
        "landmarks",
    )

    out = _download(stack, job_id, tmp_path)
    assert sorted(_streams(out)) == ["audio", "video"]
    info = probe(out)
    assert info.frame_count == 50  # floor(2.0 s x 25 fps)
    assert abs(info.duration_s - 2.0) <= 1 / FPS + 0.03
    result = _pcm(out)
    assert _correlation(result, _pcm(driving)) > 0.8
    assert _correlation(result, _pcm(own_track)) < 0.2
    assert not (stack.settings.worker_cache_dir / "tracks" / f"{job_id}-0").exists(), "scratch left behind"


@pytest.mark.slow  # another lip-sync job (~28 s here)
def test_audio_longer_than_video_cycles_frames_without_pre_looping(stack, tmp_path):
    video = face_video(tmp_path / "face.mp4", 3.0, FPS)
    longer = tone(tmp_path / "long.wav", 4.0)
    shorter = tone(tmp_path / "short.wav", 1.5)
    long_job, short_job = _submit(stack, video, longer, fps=FPS), _submit(stack, video, shorter, fps=FPS)
    long_record, short_record = stack.wait_job(long_job, timeout=240), stack.wait_job(short_job, timeout=240)
    assert long_record["state"] == "done" and short_record["state"] == "done"
    stages = long_record["tracks"][0]["stages"]
    assert stages["prepare"]["info"]["source_frames"] == 75
    assert stages["lipsync"]["info"]["frames_generated"] == 100  # not 2 x 75: the video was never looped
    assert probe(_download(stack, long_job, tmp_path)).frame_count == 100
    short = probe(_download(stack, short_job, tmp_path))
    assert short.frame_count == 37 and abs(short.duration_s - 1.5) <= 1 / FPS + 0.03


@pytest.mark.slow  # two more stacks and jobs (~19 s here)
def test_output_fps_is_the_sources_unless_requested(make_stack, tmp_path):
    """A 30 fps face clip: with no fps the output is 30 fps, with fps=25 it is 25 fps (the source resampled,
    not slowed down); either way the MP4 lasts as long as the driving audio. Clips are 1 s of video (30
    frames, so both outputs cycle back) and 1.2 s of audio."""
    stack = make_stack(ENCORE_MIN_VIDEO_S="1")
    stack.start_worker(0)
    video = face_video(tmp_path / "face30.mp4", 1.0, 30)
    driving = tone(tmp_path / "driving.wav", 1.2, freq=1375.0)
    own, asked = _submit(stack, video, driving), _submit(stack, video, driving, fps=25)
    for job_id, fps, frames in ((own, 30, 36), (asked, 25, 30)):
        record = stack.wait_job(job_id, timeout=180)
        assert record["state"] == "done", record
        assert (record["params"]["fps"], record["params"]["source_fps"]) == (fps, 30)
        stages = record["tracks"][0]["stages"]
        assert stages["prepare"]["info"]["source_frames"] == 30
        lipsync = stages["lipsync"]["info"]
        assert (lipsync["frames_generated"], lipsync["source_fps"], lipsync["precision"]) == (frames, 30, "fp32")
        info = probe(_download(stack, job_id, tmp_path))
        assert info.fps == fps and info.frame_count == frames  # floor(1.2 s x fps)
        assert abs(info.duration_s - 1.2) <= 1 / fps + 0.03
        assert abs(info.video_duration_s - 1.2) <= 1 / fps + 0.03


@pytest.mark.slow  # two more lip-sync jobs (~27 s here)
def test_no_face_fails_clearly_and_missing_faces_are_filled(stack, tmp_path):
    audio = tone(tmp_path / "a.wav", 1.0)
    blank = blank_video(tmp_path / "blank.mp4", 3.0)
    failed = stack.wait_job(_submit(stack, blank, audio), timeout=120)
    assert failed["state"] == "failed"
    assert "no face detected" in failed["tracks"][0]["error"]
    assert not (stack.settings.worker_cache_dir / "tracks" / f"{failed['job_id']}-0").exists()

    face = face_video(tmp_path / "face.mp4", 3.0, FPS)
    mixed = tmp_path / "mixed.mp4"  # 1.5 s of face, then 1.5 s of grey
    subprocess.run(
        [
            "ffmpeg",
            "-v",
            "error",
            "-y",
            "-i",
            str(face),
            "-i",
            str(blank),
            "-filter_complex",
            ("[0:v]trim=0:1.5,setpts=PTS-STARTPTS[a];[1:v]trim=0:1.5,setpts=PTS-STARTPTS[b];[a][b]concat=n=2:v=1[v]"),
            "-map",
            "[v]",
            "-c:v",
            "libx264",
            "-pix_fmt",
            "yuv420p",
            str(mixed),
        ],
        check=True,
        timeout=60,
    )
    record = stack.wait_job(_submit(stack, mixed, tone(tmp_path / "b.wav", 2.8)), timeout=180)
    assert record["state"] == "done", record
    prepared = record["tracks"][0]["stages"]["prepare"]["info"]
    assert 0 < prepared["frames_with_face"] < prepared["source_frames"]
    means = _frame_means(_download(stack, record["job_id"], tmp_path))
    assert len(means) == 70 and means.min() > 40, "black frames in the output"


@pytest.mark.slow  # a long lip-sync job canceled (~16 s here)
def test_cancel_during_lipsync(stack, tmp_path):
    video = face_video(tmp_path / "face.mp4", 3.0, FPS)
    job_id = _submit(stack, video, tone(tmp_path / "long.wav", 25.0), fps=FPS)
    wait_until(
        lambda: (lambda t: t["state"] == "lipsync" and t["progress"] > 0)(stack.job(job_id)["tracks"][0]),
        120,
        what="lipsync progress",
    )
    asked = time.monotonic()
    stack.client.delete(f"/api/v1/jobs/{job_id}")
    record = stack.wait_job(job_id, timeout=5, interval=0.05)
    assert time.monotonic() - asked < 5 and record["state"] == "canceled"
    wait_until(
        lambda: not (stack.settings.worker_cache_dir / "tracks" / f"{job_id}-0").exists(), 5, what="scratch removal"
    )
    assert stack.client.get(f"/api/v1/jobs/{job_id}/video.mp4").status_code == 404
    after = stack.wait_job(_submit(stack, video, tone(tmp_path / "a.wav", 1.0)), timeout=120)
    assert after["state"] == "done"
