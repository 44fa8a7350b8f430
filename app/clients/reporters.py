"""How a followed job is shown: one line per track (`describe`), its progress over its whole chain
(`track_fraction`), and the two reporters a follower feeds with records: tqdm bars on a terminal, plain lines in
logs and pipes (`make_reporter` picks)."""

from __future__ import annotations

import sys
from typing import Any, Protocol

from tqdm import tqdm

from app.core.kinds import KINDS, QUEUED, TERMINAL_STATES


def describe(track: dict[str, Any], kind: str) -> str:
    """One line for a track: its state, where a queued track stands, or the running stage and its detail."""
    state, index = track["state"], track["track"]
    if state == QUEUED:
        position, queue = track.get("queue_position") or 0, track.get("queue") or ""
        if not queue:
            return f"track {index} queued ({track.get('detail') or 'waiting for a worker'})"
        return f"track {index} queued #{position} on {queue}" if position else f"track {index} queued on {queue}"
    if state in ("failed", "canceled"):
        return f"track {index} {ended_reason(track)}"
    states = stage_states(kind)
    if state in states:
        return f"track {index} {state} [{states.index(state) + 1}/{len(states)}] {track.get('detail') or ''}".rstrip()
    return f"track {index} {state}"


def ended_reason(track: dict[str, Any]) -> str:
    """A failed or canceled track's state and why, the state word said once: the lifecycle's details already
    start with it ("canceled during backbone"), and a cancel leaves `error` empty (its reason is the detail)."""
    state = track["state"]
    reason = str(track.get("error") or track.get("detail") or "").strip()
    if not reason or reason == state:
        return state
    return reason if reason.split()[0].rstrip(":") == state else f"{state}: {reason}"


def stage_states(kind: str) -> list[str]:
    """The track states of `kind`'s stages, in order (none for a kind this client does not know)."""
    return [stage.state for stage in KINDS[kind].stages] if kind in KINDS else []


def track_fraction(track: dict[str, Any], kind: str) -> float:
    """How far the track is through its whole chain, 0..1: stages finished plus the running stage's own
    progress, each stage an equal part (the line says which, [k/n]). It only grows as stages follow each other
    (a stage's end and the next one's start are the same figure), where the stage's own progress falls back to
    0 at each new stage; a track that waits to resume counts the stages it has finished."""
    states = stage_states(kind)
    if track["state"] == "done" or not states:
        return 1.0 if track["state"] == "done" else 0.0
    if track["state"] in states:
        progress = min(max(float(track.get("progress") or 0), 0.0), 1.0)
        return (states.index(track["state"]) + progress) / len(states)
    finished = sum(
        1 for run in (track.get("stages") or {}).values() if isinstance(run, dict) and run.get("finished_at")
    )
    return min(finished, len(states)) / len(states)


def between_stages(track: dict[str, Any]) -> bool:
    """True while a track whose stage finished waits for its next one to start (status `waiting:<stage>`): a
    moment with nothing to report (its detail says only "waiting for the worker", at 0 % of a stage not begun)."""
    return str(track.get("status") or "").startswith("waiting:")


class Reporter(Protocol):
    def update(self, record: dict[str, Any]) -> None: ...
    def note(self, message: str) -> None: ...
    def close(self) -> None: ...


class BarReporter:
    """One tqdm bar per track showing its progress over its whole chain (track_fraction, so the bar never runs
    back at a stage change); the description is state + detail."""

    WIDTH = 52

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.bars: dict[int, tqdm] = {}

    def update(self, record: dict[str, Any]) -> None:
        for track in record["tracks"]:
            text = describe(track, record["kind"])[: self.WIDTH].ljust(self.WIDTH)
            bar = self.bars.get(track["track"])
            if bar is None:
                bar = self.bars[track["track"]] = tqdm(
                    desc=text,
                    total=100,
                    position=track["track"],
                    leave=True,
                    file=self.stream,
                    dynamic_ncols=True,
                    bar_format="{desc} {bar} {percentage:3.0f}% {elapsed}",
                )
            bar.set_description_str(text, refresh=False)
            bar.n = round(100 * track_fraction(track, record["kind"]))
            bar.refresh()

    def note(self, message: str) -> None:
        """A line of its own above the bars. Printed plainly it would land after the cursor, which sits at the end
        of a bar (tqdm redraws a bar in place with \\r, no newline): the message glued to the bar, wrapped on a
        narrow terminal, and left behind on screen as the bars moved on. tqdm.write clears the bars, prints the
        line and draws them again below it."""
        tqdm.write(message, file=self.stream)
        self.stream.flush()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


class LineReporter:
    """For logs and pipes: one line per track whenever its state, its queue position or whether its stage is
    loading a model changes. A track between two stages prints nothing (the next stage's start does)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.seen: dict[int, tuple[Any, ...]] = {}

    def update(self, record: dict[str, Any]) -> None:
        for track in record["tracks"]:
            if between_stages(track):
                continue
            loading = str(track.get("detail") or "").startswith("loading ")
            key = (track["state"], track.get("queue_position"), track.get("queue"), loading)
            if self.seen.get(track["track"]) != key:
                self.seen[track["track"]] = key
                self.note(describe(track, record["kind"]) + _percent(track, record["kind"]))

    def note(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def close(self) -> None:
        pass


def _percent(track: dict[str, Any], kind: str) -> str:
    """The track's progress over its chain while it is open; nothing once it has ended (it would only confuse)."""
    return "" if track["state"] in TERMINAL_STATES else f" ({100 * track_fraction(track, kind):.0f}%)"


def make_reporter(mode: str) -> Reporter:
    """Bars on a terminal, plain lines otherwise (or as forced with --progress)."""
    if mode == "bars" or (mode == "auto" and sys.stderr.isatty()):
        return BarReporter()
    return LineReporter()
