"""The pipeline is the layer that is testable alone: every module of app/pipeline imports, and both pipelines'
media work runs (tone, face clip, the three lip-sync stages, the music export), in a Python where importing
anything of `app` outside `app/pipeline` fails, with no ffmpeg or ffprobe on PATH: the only tools it can run
are the ones it is handed (here wrappers that log each call before running the real binary)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.processes import PYTHON, REPO

pytestmark = pytest.mark.slow  # both pipelines in a bare child process (~25 s here)

PIPELINE_ALONE = r'''
import importlib, importlib.abc, json, pkgutil, sys
from pathlib import Path


class RefuseTheRestOfApp(importlib.abc.MetaPathFinder):
    """Fails the import of every module of `app` outside `app.pipeline` (app.core.config above all)."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("app.") and name != "app.pipeline" and not name.startswith("app.pipeline."):
            raise ImportError(f"{name} is outside the pipeline")
        return None


sys.meta_path.insert(0, RefuseTheRestOfApp())

import app.pipeline
for module in pkgutil.walk_packages(app.pipeline.__path__, "app.pipeline."):
    importlib.import_module(module.name)

import cv2, skimage.data, torch
from app.pipeline.control import StageControl
from app.pipeline.lipsync import stages as lipsync
from app.pipeline.media import samples
from app.pipeline.media.ffmpeg import MediaTools
from app.pipeline.media.probe import probe
from app.pipeline.music import export, stages as music
from app.pipeline.profiles import load_lipsync_profile

ffmpeg, ffprobe, work, lipsync_models = sys.argv[1:5]
tools, work = MediaTools(ffmpeg=ffmpeg, ffprobe=ffprobe), Path(work)
face = cv2.resize(skimage.data.astronaut(), (256, 256), interpolation=cv2.INTER_AREA)
voice = samples.make_test_tone(work / "voice.wav", 1.2, 330.0, tools=tools)
video = samples.make_face_video(work / "face.mp4", face, 1.0, 25, tools=tools)
scratch = work / "scratch"
scratch.mkdir()
prepared = lipsync.run_prepare(video, voice, 25.0, scratch, StageControl(), 120, tools=tools)
models = lipsync.LipsyncModels(load_lipsync_profile("tiny", lipsync_models), "keep_loaded", device="cpu")
lipsync.run_lipsync_stage(models, {"fps": 25.0, "extra_margin": 10, "batch_size": 4}, scratch, StageControl(),
                          tools=tools)
muxed = lipsync.run_mux(scratch, voice, work / "out.mp4", StageControl(), 120, tools=tools)
song = 0.3 * torch.sin(torch.arange(44100) / 44100 * 2 * torch.pi * 440).repeat(2, 1)
wav = export.write_wav(song, work / "song.wav", 44100)
music.run_export(wav, work / "song.mp3", work / "song.json", {"seed": 1}, StageControl(), tools=tools)
print(json.dumps({"prepared_frames": prepared["source_frames"], "mux": muxed,
                  "mp3_s": probe(work / "song.mp3", tools=tools).duration_s,
                  "app_modules": sorted(name for name in sys.modules if name.startswith("app."))}))
'''


def logging_wrapper(path: Path, tool: str, log: Path) -> str:
    real = shutil.which(tool)
    assert real is not None, f"{tool} is not installed"
    path.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{log}"\nexec "{real}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_the_pipeline_runs_its_media_work_with_nothing_else_of_app_and_only_the_tools_it_is_given(
    tiny_models, tmp_path
):
    log, work, empty_path = tmp_path / "calls.log", tmp_path / "work", tmp_path / "no-tools-here"
    work.mkdir()
    empty_path.mkdir()
    ffmpeg, ffprobe = (logging_wrapper(tmp_path / f"logged-{tool}", tool, log) for tool in ("ffmpeg", "ffprobe"))
    env = {**os.environ, "PATH": str(empty_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [PYTHON, "-c", PIPELINE_ALONE, ffmpeg, ffprobe, str(work), str(tiny_models.parent / "lipsync-tiny")],
        cwd=REPO,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(name == "app.pipeline" or name.startswith("app.pipeline.") for name in result["app_modules"])
    assert result["prepared_frames"] == 25
    assert result["mux"]["frames"] == 30 and abs(result["mux"]["duration_s"] - 1.2) < 0.05
    assert 1.0 <= result["mp3_s"] < 1.1
    calls = log.read_text().splitlines()
    ran = {  # each part of the work, seen in the wrappers' log
        "tone": "aevalsrc=",
        "face clip": "-loop 1",
        "audio for whisper": "pcm_s16le",
        "frame decode": "rgb24 pipe:1",
        "picture": "-i pipe:0",
        "mux": "-map 0:v:0 -map 1:a:0",
        "mp3": "-f mp3",
        "probe": "ffprobe ",
    }
    missing = [part for part, mark in ran.items() if not any(mark in call for call in calls)]
    assert not missing, (missing, calls)
