"""The control plane's Lua scripts: each lives in app/control/lua/<name>.lua, is read once per process, registered
once per client and called by its SHA (redis-py's Script sends EVALSHA, and loads the script again only when the
server answers NOSCRIPT, e.g. after a Redis restart).

A script is composed of: the generated `keys_under` of app/core/keys.py (so the key layout is written once, in
Python), any preludes generated from other Python tables (the lifecycle's transition table and stages, the
backlog's constants), the library chunks it uses (lua/tracks.lua, lua/backlog_write.lua, lua/estimate.lua:
local functions shared by several scripts), then its own body."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from weakref import WeakKeyDictionary

import redis
import redis.asyncio
from redis.commands.core import AsyncScript, Script

from app.core.keys import lua_keys

LUA_DIR = Path(__file__).with_name("lua")
_USED_KEY = re.compile(r"\bK\.(\w+)\(")  # the keys a script builds (only those are defined: see lua_keys)

_registered: WeakKeyDictionary[redis.Redis, dict[str, Script]] = WeakKeyDictionary()
_registered_async: WeakKeyDictionary[redis.asyncio.Redis, dict[str, AsyncScript]] = WeakKeyDictionary()


@cache
def _read(name: str) -> str:
    return (LUA_DIR / f"{name}.lua").read_text()


@cache
def lua_source(name: str, *preludes: str, libraries: tuple[str, ...] = ()) -> str:
    """The text of lua/<name>.lua after the generated `keys_under` (defining the keys the text uses), any other
    preludes (Lua definitions generated from Python tables, such as the lifecycle's transition table) and the
    library chunks lua/<library>.lua."""
    text = "".join((*preludes, *(_read(library) for library in libraries), _read(name)))
    return lua_keys(_USED_KEY.findall(text)) + text


def script(client: redis.Redis, name: str, *preludes: str, libraries: tuple[str, ...] = ()) -> Script:
    """The script lua/<name>.lua (composed as `lua_source` says) bound to `client`, registered once per client."""
    source = lua_source(name, *preludes, libraries=libraries)
    scripts = _registered.setdefault(client, {})
    if source not in scripts:
        scripts[source] = client.register_script(source)
    return scripts[source]


def async_script(
    client: redis.asyncio.Redis, name: str, *preludes: str, libraries: tuple[str, ...] = ()
) -> AsyncScript:
    """The same script bound to an asyncio client (the events server, app/http/events_server.py)."""
    source = lua_source(name, *preludes, libraries=libraries)
    scripts = _registered_async.setdefault(client, {})
    if source not in scripts:
        scripts[source] = client.register_script(source)
    return scripts[source]
