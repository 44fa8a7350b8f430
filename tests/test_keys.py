"""The Redis key layout is written once (app/core/keys.py): Python's `Layout` and the Lua scripts' generated
`keys_under` give the same key for every entry, checked on a real redis-server."""
from __future__ import annotations

import json

import pytest
import redis

from app.control.scripts import LUA_DIR, lua_source
from app.core.keys import KEYS, Layout, fields_of, lua_keys

SAMPLE_PARTS = {"job_id": "0123456789abcdef0123456789abcdef", "track": 1, "task_id": "t-1", "name": "gpu0@h",
                "kind": "music", "state": "running", "queue": "gpu1", "scope": "tenant", "key_hash": "ab12",
                "worker": "webhooks@h"}


@pytest.fixture
def client(redis_base_url):
    connection = redis.Redis.from_url(f"{redis_base_url}/500", decode_responses=True)
    yield connection
    connection.close()


def test_every_key_is_the_same_in_python_and_in_lua(client):
    layout = Layout("pfx")
    expected = {name: layout.key(name, **{p: SAMPLE_PARTS[p] for p in fields_of(name)}) for name in KEYS}
    calls = ", ".join(f"{name} = K.{name}({', '.join(json.dumps(SAMPLE_PARTS[p]) for p in fields_of(name))})"
                      for name in KEYS)
    code = lua_keys() + f"local K = keys_under(ARGV[1])\nreturn cjson.encode({{{calls}}})"
    assert json.loads(client.eval(code, 0, "pfx")) == expected
    assert expected["track"] == "pfx:job:0123456789abcdef0123456789abcdef:track:1"  # the shape clients' data has


def test_layout_methods_fill_the_table_patterns():
    layout = Layout("encore")
    assert layout.lease("j", 0) == "encore:lease:j:0" and layout.waiting("gpu0") == "encore:queue:gpu0:waiting"
    assert layout.metric("stage_seconds", "gpu0") == "encore:metrics:stage_seconds:gpu0"
    with pytest.raises(TypeError, match="takes"):
        layout.key("track", job_id="j")  # a missing part is refused, never formatted as a half key


def test_no_lua_script_spells_a_key_by_hand():
    """Keys in the .lua files come from K: a literal piece of a pattern (":job:", ":queue:") would be a second
    copy of the layout."""
    literals = {piece for pattern in KEYS.values() for piece in pattern.replace("{", "}").split("}")[::2]
                if ":" in piece}
    for path in LUA_DIR.glob("*.lua"):
        text = path.read_text()
        assert not [piece for piece in literals if f"'{piece}" in text or f"{piece}'" in text], path.name


def test_scripts_run_with_their_prelude(client):
    assert lua_source("release_lock").startswith(lua_keys())
    client.set("pfx:lock:x", "mine")
    from app.control.scripts import script
    release = script(client, "release_lock")
    assert release(keys=["pfx:lock:x"], args=["theirs"]) == 0 and client.get("pfx:lock:x") == "mine"
    assert release(keys=["pfx:lock:x"], args=["mine"]) == 1 and client.get("pfx:lock:x") is None
