-- ---- a track's status and stages, for every script that reads them (one rule each, as in Python) ----
-- TERMINAL (generated from app/core/kinds.TERMINAL_STATES, app/control/lifecycle.lua_stages): the ended states.
local function is_terminal(status) return TERMINAL[status] == true end
local function is_open(status) return status ~= '' and not is_terminal(status) end
-- The 0-based index of the first stage in `names` that the stages JSON (a track's `stages` field) does not
-- record as finished; the last when every one is (app/core/kinds.first_unfinished).
local function first_unfinished(names, stages_json)
  local done = cjson.decode(stages_json or '{}')
  for n, name in ipairs(names) do
    local s = done[name]
    if type(s) ~= 'table' or not s.finished_at or s.finished_at == cjson.null then return n - 1 end
  end
  return #names - 1
end
