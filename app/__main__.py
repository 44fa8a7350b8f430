"""`python -m app`: `events` runs the events server, whose entry is the HTTP layer's (app/http/events_server.py);
every other command is the command-line client (app/clients/cli.py), the same as the installed `encore` command.
Each side is imported only when asked for: the client never loads aiohttp or Redis, the server never loads tqdm."""

from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["events"]:
        from app.http.events_server import command_line as events_server

        return events_server(argv[1:])
    from app.clients.cli import main as client

    return client(argv, prog="python -m app")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
