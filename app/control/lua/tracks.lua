-- ---- a track's status and stages, for every script that reads them (one rule each, as in Python) ----
-- TERMINAL (generated from app/core/kinds.TERMINAL_STATES, app/control/lifecycle.lua_stages): the ended states.
local function is_terminal(status) return TERMINAL[status] == true end
local function is_open(status) return status ~= '' and not is_terminal(status) end
-- The job's overall state from how many of its tracks wait (created, parked, queued), run (a stage running or
-- waiting for the next), are done, failed or canceled: queued | running | done | failed | canceled | partial (some
-- done, the others not); nil for none. The one rule: the transitions keep the job indexes by it, reads answer it.
local function overall_state(c)
  local n = c.waiting + c.active + c.done + c.failed + c.canceled
  if n == 0 then return nil end
  if c.waiting == n then return 'queued' end
  if c.waiting + c.active > 0 then return 'running' end
  if c.done == n then return 'done' end
  if c.failed == n then return 'failed' end
  if c.canceled == n then return 'canceled' end
  if c.done > 0 then return 'partial' end
  if c.canceled > 0 then return 'canceled' end
  return 'failed'
end
-- The same from the tracks' states as clients see them (queued, a stage's name, or how it ended); a job with no
-- track is failed (its tracks expired under it).
local function overall_of(states)
  local c = {waiting = 0, active = 0, done = 0, failed = 0, canceled = 0}
  for _, s in ipairs(states) do
    if s == 'queued' then c.waiting = c.waiting + 1
    elseif s == 'done' or s == 'failed' or s == 'canceled' then c[s] = c[s] + 1
    else c.active = c.active + 1 end
  end
  return overall_state(c) or 'failed'
end
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
