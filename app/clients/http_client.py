"""The HTTP side of Encore's clients: a thin requests wrapper with the base URL and the bearer token, its
errors (ApiError, with the server's own message), the client's two settings, and the server-sent events wire
format (`sse_messages`). Everything the clients say to the server goes through here; nothing heavy is imported."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import requests

from app.core.config import DEFAULT_WEB_URL


class ApiError(Exception):
    """An HTTP error or an unreachable server, with the server's own `error` message when it sent one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status is None or self.status >= 500


@dataclass(frozen=True)
class ClientSettings:
    """The client's own two settings, read alone: a client machine's environment may hold the server's
    variables too (a shared .env, a worker host), and their values are none of the client's business."""

    url: str = DEFAULT_WEB_URL  # ENCORE_URL
    token: str | None = None  # ENCORE_API_TOKEN

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ClientSettings":
        return cls(url=environ.get("ENCORE_URL", DEFAULT_WEB_URL), token=environ.get("ENCORE_API_TOKEN") or None)


@dataclass
class Client:
    """Thin wrapper over requests: base URL, bearer token, and errors turned into ApiError."""

    base_url: str
    token: str | None = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.session = requests.Session()
        if self.token:
            self.session.headers["Authorization"] = f"Bearer {self.token}"

    def url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else f"{self.base_url}{path}"

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout_s)
        try:
            reply = self.session.request(method, self.url(path), **kwargs)
        except requests.RequestException as exc:
            raise ApiError(f"cannot reach Encore at {self.base_url} ({failure_reason(exc)})") from exc
        if reply.status_code >= 400:
            raise ApiError(_error_message(reply), reply.status_code)
        return reply

    def json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.request(method, path, **kwargs).json()

    def download(self, path: str, target: Path) -> int:
        """Stream a file to `target` (via a .part file, so a broken transfer never looks complete)."""
        part = target.with_name(target.name + ".part")
        with self.request("GET", path, stream=True) as reply, open(part, "wb") as out:
            for chunk in reply.iter_content(1 << 20):
                out.write(chunk)
        part.replace(target)
        return target.stat().st_size


def failure_reason(exc: requests.RequestException) -> str:
    """The innermost cause in a few words (urllib3's wrapped messages are a paragraph long)."""
    cause: BaseException = exc
    while cause.__context__ is not None and cause.__context__ is not cause:
        cause = cause.__context__
    text = str(cause).split("] ", 1)[-1] if "] " in str(cause) else str(cause)
    return text[:160] or type(exc).__name__


def _error_message(reply: requests.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("error"):
        return f"{body['error']} (HTTP {reply.status_code})"
    return f"HTTP {reply.status_code}: {reply.text.strip()[:200] or reply.reason}"


def sse_messages(lines: Iterable[str]) -> Iterator[tuple[str, str | None, str]]:
    """(event name, id, data) per server-sent message; comments (heartbeats) and `retry:` skipped."""
    event: str = "message"
    event_id: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield event, event_id, "\n".join(data)
            event, event_id, data = "message", None, []
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "id":
            event_id = value
        elif name == "data":
            data.append(value)
