"""Every lip-sync upload rejection is answered before anything is queued."""

from __future__ import annotations

import io

import pytest

from app.pipeline.media.probe import probe
from harness.media import face_video, matroska_that_says, tone, upload


@pytest.fixture
def stack(make_stack):
    return make_stack(
        ENCORE_MAX_VIDEO_MB="1", ENCORE_MAX_AUDIO_MB="0.5", ENCORE_MIN_VIDEO_S="3", ENCORE_MAX_AUDIO_S="30"
    )


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    return {
        "video": face_video(root / "face.mp4", 3.2),
        "video30": face_video(root / "face30.mp4", 3.2, fps=30),
        "video150": face_video(root / "face150.mp4", 3.2, fps=150, size=64),
        "short_video": face_video(root / "short.mp4", 2.0),
        "audio": tone(root / "voice.wav", 2.0),
        "long_audio": tone(root / "long.mp3", 31.0),
        "garbage": _write(root / "garbage.mp4", b"\x00not a video at all" * 100),
        "big": _write(root / "big.mp4", b"\x00" * (1024 * 1024 + 10)),
    }


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _assert_rejected(stack, reply, status: int, field: str, words: str):
    assert reply.status_code == status, reply.get_json()
    body = reply.get_json()
    assert body["field"] == field and words in body["error"], body
    assert stack.client.get("/api/v1/jobs").get_json()["jobs"] == []
    assert stack.redis.zcard("encore:unrouted") == 0
    assert not any((stack.root / "uploads").glob("*/*")), "staged upload left behind"


def test_oversized_video_is_413(stack, clips):
    _assert_rejected(stack, upload(stack.client, clips["big"], clips["audio"]), 413, "video", "limit is 1 MB")


def test_a_body_larger_than_both_limits_together_is_413_naming_body(stack, clips):
    """Refused before it is read, as the form's other 413s are: naming `body` (it named no field)."""
    most = int((1 + 0.5 + 1) * 2**20)  # ENCORE_MAX_VIDEO_MB + ENCORE_MAX_AUDIO_MB + 1
    with open(clips["audio"], "rb") as audio:
        reply = stack.client.post(
            "/api/v1/lipsync",
            data={"video": (io.BytesIO(b"\x00" * most), "face.mp4"), "audio": (audio, "voice.wav")},
            content_type="multipart/form-data",
        )
    _assert_rejected(stack, reply, 413, "body", "larger than 2.5 MiB")


def test_unreadable_mp4_is_400(stack, clips):
    _assert_rejected(stack, upload(stack.client, clips["garbage"], clips["audio"]), 400, "video", "cannot be read")


def test_video_without_video_stream_is_400(stack, clips):
    _assert_rejected(stack, upload(stack.client, clips["audio"], clips["audio"]), 400, "video", "no video stream")


def test_audio_without_audio_stream_is_400(stack, clips):
    _assert_rejected(stack, upload(stack.client, clips["video"], clips["video"]), 400, "audio", "no audio stream")


def test_too_short_video_is_400(stack, clips):
    _assert_rejected(stack, upload(stack.client, clips["short_video"], clips["audio"]), 400, "video", "at least 3 s")


def test_too_long_audio_is_400(stack, clips):
    _assert_rejected(
        stack, upload(stack.client, clips["video"], clips["long_audio"]), 400, "audio", "the limit is 30 s"
    )


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"fps": "fast"}, "fps"),
        ({"fps": "-1"}, "fps"),
        ({"batch_size": "0"}, "batch_size"),
        ({"color": "red"}, "color"),
        ({"extra_margin": "1.5"}, "extra_margin"),
    ],
)
def test_bad_form_fields_are_400(stack, clips, fields, field):
    reply = upload(stack.client, clips["video"], clips["audio"], **fields)
    assert reply.status_code == 400 and reply.get_json()["field"] == field, reply.get_json()


def test_an_empty_webhook_form_field_is_an_absent_one(stack, clips):
    """As for every other field of the form (and as the OpenAPI document says): no webhook, not a refusal."""
    reply = upload(stack.client, clips["video"], clips["audio"], webhook="", webhook_events="")
    assert reply.status_code == 202, reply.get_json()
    assert "webhook" not in stack.client.get(f"/api/v1/jobs/{reply.get_json()['job_id']}").get_json()


@pytest.mark.parametrize("fps", ["1e-320", "0.5", "0.999"])
def test_a_frame_rate_below_one_is_refused_naming_fps_not_the_audio(stack, clips, fps):
    """A tiny fps made one frame outlast any audio, and the refusal then named `audio` (its shortest length is
    one frame period)."""
    reply = upload(stack.client, clips["video"], clips["audio"], fps=fps)
    _assert_rejected(stack, reply, 400, "fps", "must be 0 (the video's own rate) or from 1 to 120")


def test_missing_file_and_non_multipart_are_400(stack, clips):
    with open(clips["video"], "rb") as video:
        reply = stack.client.post(
            "/api/v1/lipsync", data={"video": (video, "v.mp4")}, content_type="multipart/form-data"
        )
    _assert_rejected(stack, reply, 400, "audio", "file missing")
    reply = stack.client.post("/api/v1/lipsync", json={"video": "x"})
    assert reply.status_code == 400 and reply.get_json()["field"] == "body"


def test_fps_zero_means_the_sources_and_job_waits_for_a_worker(stack, clips):
    reply = upload(stack.client, clips["video"], clips["audio"], fps="0")
    assert reply.status_code == 202, reply.get_json()
    record = stack.job(reply.get_json()["job_id"])
    assert record["kind"] == "lipsync" and record["params"]["fps"] == 25  # the 25 fps clip's own
    assert record["params"]["fps_from"] == "source"
    assert record["params"]["output_frames"] == 50  # floor(2.0 s x 25 fps)
    assert record["tracks"][0]["state"] == "queued"
    assert not any((stack.root / "uploads").glob("*/*")), "staged upload left behind"


def _params(stack, video, audio, **fields) -> dict:
    reply = upload(stack.client, video, audio, **fields)
    assert reply.status_code == 202, reply.get_json()
    return stack.job(reply.get_json()["job_id"])["params"]


def test_output_fps_is_the_sources_unless_the_request_gives_one(stack, clips):
    recorded = {
        name: _params(stack, clips["video30"], clips["audio"], **fields)
        for name, fields in (("missing", {}), ("given", {"fps": "25"}), ("zero", {"fps": "0"}))
    }
    picked = {name: (p["fps"], p["source_fps"], p["fps_from"], p["output_frames"]) for name, p in recorded.items()}
    assert picked == {
        "missing": (30, 30, "source", 60),
        "given": (25, 30, "request", 50),
        "zero": (30, 30, "source", 60),
    }  # 2.0 s of audio


def test_a_source_rate_above_the_forms_range_falls_back_to_the_default(stack, clips):
    params = _params(stack, clips["video150"], clips["audio"])
    assert (params["fps"], params["source_fps"], params["fps_from"]) == (25, 150, "default")


def test_an_audio_file_whose_header_says_5_s_over_two_minutes_is_refused_from_what_it_holds(make_stack, tmp_path):
    """Its length is counted in decoded samples, not read from the header (which said 5 s over 2 h once)."""
    stack = make_stack(ENCORE_MAX_AUDIO_S="60")
    lying = matroska_that_says(tone(tmp_path / "long.wav", 120.0), tmp_path / "says5.mka", 5.0)
    assert probe(lying).duration_s < 6  # what a header-only check saw
    reply = upload(stack.client, face_video(tmp_path / "face.mp4", 3.2), lying)
    _assert_rejected(stack, reply, 400, "audio", "is longer than 61.0 s long (decoded); the limit is 60 s")


def test_an_audio_file_whose_header_says_two_minutes_over_2_s_runs_as_2_s(make_stack, tmp_path):
    stack = make_stack()
    lying = matroska_that_says(tone(tmp_path / "short.wav", 2.0), tmp_path / "says120.mka", 120.0)
    assert probe(lying).duration_s > 100
    reply = upload(stack.client, face_video(tmp_path / "face.mp4", 3.2), lying)
    assert reply.status_code == 202, reply.get_json()
    params = stack.job(reply.get_json()["job_id"])["params"]
    assert abs(params["audio_duration_s"] - 2.0) < 0.05 and params["output_frames"] == 50


def test_a_face_video_longer_than_the_limit_is_refused_whatever_its_header_says(make_stack, tmp_path):
    stack = make_stack(ENCORE_MAX_VIDEO_S="5", ENCORE_MIN_VIDEO_S="1")
    audio = tone(tmp_path / "voice.wav", 2.0)
    honest = face_video(tmp_path / "long.mp4", 6.0)
    _assert_rejected(
        stack, upload(stack.client, honest, audio), 400, "video", "is 6.0 s long (150 frames); the limit is 5 s"
    )
    lying = matroska_that_says(honest, tmp_path / "says3.mkv", 3.0)
    assert probe(lying).duration_s < 4
    _assert_rejected(stack, upload(stack.client, lying, audio), 400, "video", "(150 frames); the limit is 5 s")
    assert upload(stack.client, face_video(tmp_path / "ok.mp4", 3.2), audio).status_code == 202


def test_a_face_video_with_too_many_pixels_to_decode_is_refused(make_stack, tmp_path):
    stack = make_stack(ENCORE_MAX_VIDEO_FRAME_PIXELS=str(50 * 256 * 256))  # 50 frames of 256x256
    reply = upload(stack.client, face_video(tmp_path / "face.mp4", 3.2), tone(tmp_path / "voice.wav", 2.0))
    _assert_rejected(stack, reply, 400, "video", "holds 80 frames of 256x256")


def test_an_upload_whose_output_would_pass_the_scratch_bound_is_refused_before_it_is_queued(make_stack, tmp_path):
    stack = make_stack(ENCORE_MAX_SCRATCH_MB="5")  # the clip's 80 frames of 256x256 (all read) take 15 MiB
    reply = upload(stack.client, face_video(tmp_path / "face.mp4", 3.2), tone(tmp_path / "voice.wav", 2.0))
    _assert_rejected(stack, reply, 400, "video", "the 80 frames of 256x256 this output reads would take 15 MiB")
