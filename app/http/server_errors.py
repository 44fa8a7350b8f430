"""JSON answers for the requests gunicorn refuses before the app sees them.

gunicorn answers a request line over `limit_request_line` (414), too many or too large header fields (431), and
a request it cannot parse (400) itself, with an HTML page. Every other refusal of Encore's is JSON naming the
field (docs/api.md), and clients parse it as such, so the web tier runs gunicorn's gthread worker with its error
writer replaced by one that writes Encore's error body. gunicorn still decides what to refuse and with which
status; only the body changes. (gunicorn calls `gunicorn.util.write_error` for these answers; the replacement is
installed in the worker process, which serves nothing else.)
"""

from __future__ import annotations

import json
import socket
from typing import Any

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

MAX_DETAIL_CHARS = 200  # gunicorn's message may quote the request: bounded, and JSON-escaped


def _field(status: int) -> str:
    """What part of the request a refusal is about, in the words of Encore's other errors."""
    return {414: "url", 431: "headers", 417: "Expect", 501: "Transfer-Encoding"}.get(status, "request")


def _message(status: int, reason: str, detail: str, cfg: Any) -> str:
    if status == 414:
        return f"url: the request line is longer than {cfg.limit_request_line} bytes"
    if status == 431:
        return (
            f"headers: more than {cfg.limit_request_fields} header fields, or one longer than "
            f"{cfg.limit_request_field_size} bytes"
        )
    detail = detail[:MAX_DETAIL_CHARS]
    return f"{_field(status)}: {reason}" + (f" ({detail})" if detail else "")


def json_error_writer(cfg: Any):
    """A drop-in for gunicorn.util.write_error(sock, status, reason, message) that answers JSON."""

    def write_error(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
        body = json.dumps({"error": _message(status_int, reason, mesg, cfg), "field": _field(status_int)}).encode()
        head = (
            f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin1")
        util.write_nonblock(sock, head + body)

    return write_error


class JsonErrorThreadWorker(ThreadWorker):
    """gunicorn's gthread worker whose own refusals (414, 431, 400, ...) are JSON."""

    def init_process(self) -> None:
        util.write_error = json_error_writer(self.cfg)
        super().init_process()
