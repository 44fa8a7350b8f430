"""The control plane's Lua scripts: each lives in app/control/lua/<name>.lua, is read once per process and is
called by its SHA (redis-py's Script sends EVALSHA, and loads the script again only when the server answers
NOSCRIPT, e.g. after a Redis restart). A script that builds keys starts with the generated `keys_under` of
app/core/keys.py, so the key layout is written once, in Python."""
from __future__ import annotations

from functools import cache
from pathlib import Path

import redis
from redis.commands.core import Script

from app.core.keys import lua_keys

LUA_DIR = Path(__file__).with_name("lua")


@cache
def lua_source(name: str, *preludes: str) -> str:
    """The text of lua/<name>.lua after the generated `keys_under` and any other preludes (Lua definitions
    generated from Python tables, such as the lifecycle's transition table)."""
    return "".join((lua_keys(), *preludes, (LUA_DIR / f"{name}.lua").read_text()))


def script(client: redis.Redis, name: str, *preludes: str) -> Script:
    """The script lua/<name>.lua bound to `client`."""
    return client.register_script(lua_source(name, *preludes))
