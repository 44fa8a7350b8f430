"""The Redis key layout is written once (app/core/keys.py): Python's `Layout` and the Lua scripts' generated
`keys_under` give the same key for every entry, checked on a real redis-server."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import redis

import app
from app.control import scripts
from app.control.jobs import JobStore
from app.control.lifecycle import lua_stages
from app.control.scripts import LUA_DIR, lua_source
from app.core.keys import KEYS, Layout, fields_of, lua_keys
from app.core.kinds import KINDS, TERMINAL_STATES, first_unfinished

REPO = Path(__file__).resolve().parents[1]

SAMPLE_PARTS = {
    "job_id": "0123456789abcdef0123456789abcdef",
    "track": 1,
    "task_id": "t-1",
    "name": "gpu0@h",
    "kind": "music",
    "state": "running",
    "queue": "gpu1",
    "scope": "tenant",
    "key_hash": "ab12",
    "worker": "webhooks@h",
    "tenant": "acme",
    "stage": "decode",
}


@pytest.fixture
def client(redis_base_url):
    connection = redis.Redis.from_url(f"{redis_base_url}/500", decode_responses=True)
    yield connection
    connection.close()


def test_every_key_is_the_same_in_python_and_in_lua(client):
    layout = Layout("pfx")
    expected = {name: layout.key(name, **{p: SAMPLE_PARTS[p] for p in fields_of(name)}) for name in KEYS}
    calls = ", ".join(
        f"{name} = K.{name}({', '.join(json.dumps(SAMPLE_PARTS[p]) for p in fields_of(name))})" for name in KEYS
    )
    code = lua_keys() + f"local K = keys_under(ARGV[1])\nreturn cjson.encode({{{calls}}})"
    assert json.loads(client.eval(code, 0, "pfx")) == expected
    assert expected["track"] == "pfx:job:0123456789abcdef0123456789abcdef:track:1"  # the shape clients' data has


def test_layout_methods_fill_the_table_patterns():
    layout = Layout("encore")
    assert layout.lease("j", 0) == "encore:lease:j:0" and layout.waiting("gpu0") == "encore:queue:gpu0:waiting"
    assert layout.stage_seconds("music", "decode") == "encore:metrics:stage_seconds:music:decode"
    with pytest.raises(TypeError, match="takes"):
        layout.key("track", job_id="j")  # a missing part is refused, never formatted as a half key


# The literal pieces of `KEYS` patterns (":job:", "queue:", ":waiting"): spelled in code, each would be a second copy
# of the layout. A bare ":" is left out: it also joins a set member ("job:track").
KEY_PIECES = {
    piece
    for pattern in KEYS.values()
    for piece in pattern.replace("{", "}").split("}")[::2]
    if ":" in piece and piece != ":"
}


def hand_spelled(text: str) -> list[str]:
    """The KEY_PIECES quoted in Lua `text` (comments left out)."""
    code = re.sub(r"--[^\n]*", "", text)
    return sorted(
        piece for piece in KEY_PIECES for quote in "'\"" if f"{quote}{piece}" in code or f"{piece}{quote}" in code
    )


def test_the_hand_spelled_check_sees_a_key_spelled_by_hand():
    assert hand_spelled("redis.call('ZCARD', P .. ':queue:' .. q .. ':waiting')") == [":waiting", "queue:"]
    assert hand_spelled('redis.call("DEL", P .. ":lock:" .. name)') == ["lock:"]
    assert hand_spelled("redis.call('ZCARD', K.waiting(q)); local m = job_id .. ':' .. track  -- a 'job:track'") == []


def test_no_lua_script_spells_a_key_by_hand(client):
    """Keys in the .lua files, and in every script as it is composed (its generated preludes too), come from K."""
    for path in LUA_DIR.glob("*.lua"):
        assert not hand_spelled(path.read_text()), path.name
    JobStore(client, "pfx")  # registers the lifecycle's and the estimates' scripts
    composed = scripts._registered[client]
    assert len(composed) >= 5  # the transition, the job read, forget, the snapshot, the estimates
    for source in composed:
        used = set(re.findall(r"\bK\.(\w+)\(", source))
        generated = lua_keys(used)  # only the keys a script uses: it builds them on every call
        assert source.startswith(generated) and not hand_spelled(source[len(generated) :]), source[-300:]
        assert used <= set(KEYS) and all(f"  K.{name} = function(" in generated for name in used)
        client.script_load(source)  # and compiles


def key_literals_in_python(source: str) -> list[str]:
    """The KEY_PIECES inside the string literals of Python `source` that could
    be a key: those with no whitespace (prose in docstrings and messages names keys, it does not build them),
    f-strings' literal parts included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not re.search(r"\s", node.value):
            found += [piece for piece in KEY_PIECES if piece in node.value]
    return sorted(found)


def test_the_python_check_sees_a_key_spelled_by_hand():
    assert key_literals_in_python('key = f"{self.prefix}:artifact:{job_id}:{name}"') == ["artifact:"]
    assert key_literals_in_python('"""A job: its queue: the lock: prose."""\nmember = f"{job}:{track}"') == []


def test_no_python_module_spells_a_key_by_hand():
    """Keys in Python come from the layout (`Layout`, from `KEYS`), never from a literal of their own."""
    for path in (REPO / "app").rglob("*.py"):
        if path.name != "keys.py":
            assert not key_literals_in_python(path.read_text()), path


def test_no_lua_lives_in_python_strings():
    """The scripts' bodies are .lua files; Python only generates tables (keys_under, the transition table)."""
    for path in Path(app.__file__).parent.rglob("*.py"):
        assert "redis.call(" not in path.read_text(), path


def test_lua_and_python_agree_on_terminal_states_and_the_first_unfinished_stage(client):
    statuses = [
        "new",
        "created",
        "parked",
        "queued",
        "running:backbone",
        "waiting:decode",
        "done",
        "failed",
        "canceled",
        "partial",
        "",
    ]
    runs: list[dict[str, Any]] = [
        {},
        {"backbone": {"finished_at": 1.0}},
        {"backbone": {"finished_at": None}},
        {
            "backbone": {"finished_at": 1.0},
            "superres": {"finished_at": 2.0},
            "decode": {"finished_at": 3.0},
            "export": {"finished_at": 4.0},
        },
        {"backbone": "junk", "superres": {"finished_at": 2.0}},
    ]
    code = (
        lua_source("tracks", lua_stages())
        + """
local statuses, runs, out = cjson.decode(ARGV[1]), cjson.decode(ARGV[2]), {terminal = {}, first = {}}
for _, s in ipairs(statuses) do if is_terminal(s) then out.terminal[#out.terminal + 1] = s end end
for n, run in ipairs(runs) do out.first[n] = first_unfinished(STAGES.music, cjson.encode(run)) end
return cjson.encode(out)"""
    )
    reply = json.loads(client.eval(code, 0, json.dumps(statuses), json.dumps(runs)))
    assert set(reply["terminal"]) == TERMINAL_STATES
    assert reply["first"] == [first_unfinished(KINDS["music"], run) for run in runs] == [0, 1, 0, 3, 0]


def test_scripts_run_with_their_prelude(client):
    assert lua_source("release_lock").startswith(lua_keys([]))  # it builds no key: its table is empty
    client.set("pfx:lock:x", "mine")
    from app.control.scripts import script

    release = script(client, "release_lock")
    assert release(keys=["pfx:lock:x"], args=["theirs"]) == 0 and client.get("pfx:lock:x") == "mine"
    assert release(keys=["pfx:lock:x"], args=["mine"]) == 1 and client.get("pfx:lock:x") is None
