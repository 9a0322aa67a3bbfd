"""The Lua scripts RedisStore runs on the server.

A script runs atomically: no other client's command interleaves with it. It is not rolled back when it fails
half-way, so every script checks everything first and writes after (the only write that can then fail is one
the server refuses for memory, and a script flagged with a ``#!lua`` line, as these are, is refused as a whole
before it starts when the server is over `maxmemory`). The shebang needs Redis >= 7.0 or Valkey >= 7.2.

Every key a script touches is declared in KEYS (what Redis Cluster needs to route it). The batch scripts
(`PUT_BATCH`, `REMOVE_BATCH`) touch keys of many slots and run on a standalone server only; a cluster runs
the one-key scripts (`PUT_PAGE`, `REMOVE_PAGE`, `NS_ADJUST`) instead (see README.md, cluster mode). `TOUCH`
takes many keys on a standalone server and one on a cluster.

Page record fields (one hash per page, so a page and its metadata come and go together):
``d`` u64 checksum + payload, ``m`` PageMeta (msgpack; hits and last access as of the write; an engine page's key),
``n`` namespace id hex, ``p`` parent hash hex (as in ``m``), ``h`` reads that ended at the page, ``a`` last access
(unix seconds: the latest read that served the page).
Namespace record fields: ``info`` NamespaceInfo (msgpack), ``created``, ``last``, ``pages``, ``bytes``, ``hits``,
and one ``r:<root hex>`` field per layout root the namespace's pages hang from.
"""

# How a put batch's page hangs from its parent (the `kind` argument of each page of PUT_BATCH):
#   "r"  its parent is its namespace's root
#   "b"  a token page whose parent is an earlier page of this batch (the batch check saw it)
#   "s"  a token page whose parent must be a stored page of its namespace: checked before anything is written,
#        and the whole batch is refused (KVCNS) when it is not
#   "e"  an engine page (named by its engine's key) whose parent is not the root: kept when the parent is a stored
#        page of its namespace and layout at the time it is written (an earlier page of the batch included), else
#        the page hangs from its namespace root (the root metadata and root hash passed with it): an engine's
#        parent link is a hint, never a condition (kvcache.storage.api). Its root is recorded either way. It hangs
#        from its root too when pages already hang below it (a dropped corrupt copy of it left them): linked under
#        one of them it would be its own ancestor, a cycle no eviction or walk from the root ever ends.
#
# The namespace and layout of a stored page are read from its `m` field without decoding it (Redis' cmsgpack
# knows no bin type): PageMeta is array_like, so its msgpack is the array header, then ns_id and layout_id, each
# a bin 8 of 16 bytes: bytes 2..37 (1-based) name both, and equal those of a page of the same namespace and
# layout (tests pin this encoding). A parent whose `m` is damaged does not match: the page hangs from its root.
#
# KEYS: [1] namespace index, [2 .. 1+nns] namespace records, then per page (5): page record, children set of its
# parent, parent page record, children set of its namespace root, its own children set; then the shares hash;
# last, the store's format record.
# ARGV: [1] now, [2] nns, per namespace (2): id hex, NamespaceInfo msgpack; per page (8): child member (the raw
# page hash), d, m, namespace number (1-based), parent hex, kind (above), m with the root as parent ("" unless
# kind is "e"), root hex.
# A namespace with a store share (field ``b:<id hex>`` of the shares hash) takes new pages while its bytes stay
# within it; its later new pages in the batch are rejected (what is stored of a chain stays a prefix).
# Returns {written, existing, rejected, outcomes}: outcomes one byte per page, in order, a PageOutcome
# (0 written, 1 existing, 2 rejected); an error KVCNOSTORE when the format record is gone (the server lost its
# data: nothing is written under a prefix that is no store), or KVCNS naming the first page of kind "s" whose
# parent is no stored page of its namespace.
PUT_BATCH = """#!lua
if redis.call('EXISTS', KEYS[#KEYS]) == 0 then
  return redis.error_reply('KVCNOSTORE the format record is gone')
end
local now = ARGV[1]
local nns = tonumber(ARGV[2])
local kb = 1 + nns
local ab = 2 + 2 * nns
local np = (#KEYS - kb - 2) / 5
local nshex = {}
for j = 1, nns do nshex[j] = ARGV[1 + 2 * j] end
local room, limited, full = {}, {}, {}
for j = 1, nns do
  local share = tonumber(redis.call('HGET', KEYS[#KEYS - 1], 'b:' .. nshex[j]) or '0')
  limited[j] = share > 0
  room[j] = share - tonumber(redis.call('HGET', KEYS[1 + j], 'bytes') or '0')
  full[j] = false
end
for i = 0, np - 1 do
  local o = ab + 8 * i
  if ARGV[o + 6] == 's' then
    local up = redis.call('HGET', KEYS[kb + 5 * i + 3], 'n')
    if (not up) or up ~= nshex[tonumber(ARGV[o + 4])] then
      return redis.error_reply('KVCNS ' .. i .. (up and ' stored' or ' missing'))
    end
  end
end
local written, existing, rejected = 0, 0, 0
local outcomes = {}
local pages, bytes = {}, {}
for j = 1, nns do pages[j] = 0; bytes[j] = 0 end
for i = 0, np - 1 do
  local o = ab + 8 * i
  local k = kb + 5 * i
  local pk = KEYS[k + 1]
  local j = tonumber(ARGV[o + 4])
  local size = string.len(ARGV[o + 2]) - 8
  if redis.call('EXISTS', pk) == 1 then
    existing = existing + 1
    outcomes[i + 1] = '\\1'
  elseif full[j] or (limited[j] and room[j] < size) then
    full[j] = true
    rejected = rejected + 1
    outcomes[i + 1] = '\\2'
  else
    local kind, meta, parent, ck = ARGV[o + 6], ARGV[o + 3], ARGV[o + 5], KEYS[k + 2]
    if kind == 'e' then
      local up = redis.call('HGET', KEYS[k + 3], 'm')
      if (not up) or string.sub(up, 2, 37) ~= string.sub(meta, 2, 37)
          or redis.call('EXISTS', KEYS[k + 5]) == 1 then
        meta, parent, ck = ARGV[o + 7], ARGV[o + 8], KEYS[k + 4]
      end
    end
    room[j] = room[j] - size
    redis.call('HSET', pk, 'd', ARGV[o + 2], 'm', meta, 'n', nshex[j], 'p', parent, 'h', 0, 'a', now)
    redis.call('SADD', ck, ARGV[o + 1])
    pages[j] = pages[j] + 1
    bytes[j] = bytes[j] + size
    if kind ~= 'b' and kind ~= 's' then redis.call('HSET', KEYS[1 + j], 'r:' .. ARGV[o + 8], 1) end
    written = written + 1
    outcomes[i + 1] = '\\0'
  end
end
for j = 1, nns do
  if pages[j] > 0 then
    local nk = KEYS[1 + j]
    redis.call('HSETNX', nk, 'info', ARGV[2 + 2 * j])
    redis.call('HSETNX', nk, 'created', now)
    redis.call('HINCRBY', nk, 'pages', pages[j])
    redis.call('HINCRBY', nk, 'bytes', bytes[j])
    local last = tonumber(redis.call('HGET', nk, 'last') or '0')
    if tonumber(now) > last then redis.call('HSET', nk, 'last', now) end
    redis.call('SADD', KEYS[1], nshex[j])
  end
end
return {written, existing, rejected, table.concat(outcomes)}
"""

# KEYS: [1] page record. ARGV: d, m, namespace id hex, parent hex, now. Returns 1 when written, 0 when stored.
PUT_PAGE = """#!lua
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'd', ARGV[1], 'm', ARGV[2], 'n', ARGV[3], 'p', ARGV[4], 'h', 0, 'a', ARGV[5])
return 1
"""

# KEYS: [1] namespace record. ARGV: NamespaceInfo msgpack ("" : only adjust a record that exists), now,
# pages delta, bytes delta, root hex ("" : none). Returns 1 when the record was changed.
NS_ADJUST = """#!lua
local nk = KEYS[1]
if ARGV[1] == '' then
  if redis.call('EXISTS', nk) == 0 then return 0 end
else
  redis.call('HSETNX', nk, 'info', ARGV[1])
  redis.call('HSETNX', nk, 'created', ARGV[2])
  local last = tonumber(redis.call('HGET', nk, 'last') or '0')
  if tonumber(ARGV[2]) > last then redis.call('HSET', nk, 'last', ARGV[2]) end
end
redis.call('HINCRBY', nk, 'pages', ARGV[3])
redis.call('HINCRBY', nk, 'bytes', ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', nk, 'r:' .. ARGV[5], 1) end
return 1
"""

# KEYS: page or namespace records. ARGV: [1] count field, [2] time field, then per key (2): increment, time.
# For each record that exists, adds to its count and raises its time to at least the given one (a record
# deleted meanwhile must not come back as a stub holding only these fields). A standalone server folds many
# records per call; a cluster calls it with one key (a call's keys must share a slot). Returns the records
# that existed.
TOUCH = """#!lua
local n = 0
for i = 1, #KEYS do
  local k = KEYS[i]
  if redis.call('EXISTS', k) == 1 then
    local inc = ARGV[1 + 2 * i]
    if inc ~= '0' then redis.call('HINCRBY', k, ARGV[1], inc) end
    local t = tonumber(redis.call('HGET', k, ARGV[2]) or '0')
    if tonumber(ARGV[2 + 2 * i]) > t then redis.call('HSET', k, ARGV[2], ARGV[2 + 2 * i]) end
    n = n + 1
  end
end
return n
"""

# The removal log (kvcache.storage.removals): one hash, ``P rm`` (one key, so a script on any node can write it),
# a ring of REMOVALS_KEPT places:
#   ``seq``             the number of the last removal recorded (HINCRBY)
#   ``q:<seq % kept>``  the subject recorded at that place of the ring
#   subject             "<seq> <reason> <unix seconds> <namespace id hex>" for subject "h" + raw page hash, or
#                       "n" + raw namespace id (a namespace removed whole: a drop, a TTL expiry)
# A new record takes the place of the record `kept` removals older (deleted unless a newer removal of the same
# subject replaced it), so the hash holds at most `kept` records and `kept` places. RECORD_LOG is the Lua that
# writes one record; the scripts below that remove pages carry it and run it for each page they remove.
RECORD_LOG = """
local function record_removal(rk, subject, word, at, nshex, kept)
  local seq = redis.call('HINCRBY', rk, 'seq', 1)
  local place = 'q:' .. (seq % kept)
  local old = redis.call('HGET', rk, place)
  if old then
    local v = redis.call('HGET', rk, old)
    if v and tonumber(string.match(v, '^(%d+)')) <= seq - kept then redis.call('HDEL', rk, old) end
  end
  redis.call('HSET', rk, place, subject, subject, seq .. ' ' .. word .. ' ' .. at .. ' ' .. nshex)
end
"""

# KEYS: [1] the removal log. ARGV: reason word, unix seconds, kept, then per record (2): subject, namespace id hex.
# Records each (a cluster's removals, whose page records live on other nodes; a namespace removed whole).
RECORD = "#!lua" + RECORD_LOG + """
for i = 4, #ARGV, 2 do
  record_removal(KEYS[1], ARGV[i], ARGV[1], ARGV[2], ARGV[i + 1], tonumber(ARGV[3]))
end
return (#ARGV - 3) / 2
"""

# The guard a removal checks inside its script, against the record as it is then:
#   "any"    the record's namespace and parent are still the ones the caller read (not rewritten meanwhile)
#   "sha"    ... and its `d` field still has the SHA-1 the caller saw (the corrupt bytes, not a rewrite)
#   "below"  ... and the parent page record is gone (the page is unreachable now); standalone only
#   "raw"    a record that is not a whole page (a field missing): delete the key, no index or counter to fix
#
# KEYS per page: page record, children set of its parent, namespace record, parent page record; last, the removal
# log. ARGV per page (5): child member, namespace id hex, parent hex, guard, SHA-1 hex ("" unless guard is "sha");
# then the reason word to record each whole page removed under ("": none, a namespace dropped whole), unix
# seconds, kept. Returns per page the payload bytes freed, or -1 when the guard kept the record.
REMOVE_BATCH = "#!lua" + RECORD_LOG + """
local out = {}
local np = (#KEYS - 1) / 4
local rk, word, at, kept = KEYS[#KEYS], ARGV[5 * np + 1], ARGV[5 * np + 2], tonumber(ARGV[5 * np + 3])
for i = 0, np - 1 do
  local pk, ck, nk, up = KEYS[4 * i + 1], KEYS[4 * i + 2], KEYS[4 * i + 3], KEYS[4 * i + 4]
  local o = 5 * i
  local guard = ARGV[o + 4]
  local freed = -1
  if guard == 'raw' then
    if redis.call('EXISTS', pk) == 1 then redis.call('DEL', pk); freed = 0 end
  else
    local rec = redis.call('HMGET', pk, 'n', 'p')
    local ok = rec[1] == ARGV[o + 2] and rec[2] == ARGV[o + 3]
    if ok and guard == 'sha' then ok = redis.sha1hex(redis.call('HGET', pk, 'd') or '') == ARGV[o + 5] end
    if ok and guard == 'below' then ok = redis.call('EXISTS', up) == 0 end
    if ok then
      freed = redis.call('HSTRLEN', pk, 'd') - 8
      redis.call('DEL', pk)
      redis.call('SREM', ck, ARGV[o + 1])
      if redis.call('EXISTS', nk) == 1 then
        redis.call('HINCRBY', nk, 'pages', -1)
        redis.call('HINCRBY', nk, 'bytes', -freed)
      end
      if word ~= '' then record_removal(rk, 'h' .. ARGV[o + 1], word, at, ARGV[o + 2], kept) end
    end
  end
  out[i + 1] = freed
end
return out
"""

# KEYS: [1] page record. ARGV: namespace id hex, parent hex, guard ("any", "sha" or "raw"), SHA-1 hex.
# The cluster form of one REMOVE_BATCH entry: only the record itself; the caller then fixes the children set
# and the namespace counters (other slots). Returns the payload bytes freed, or -1 when the guard kept it.
REMOVE_PAGE = """#!lua
local pk = KEYS[1]
if ARGV[3] == 'raw' then
  if redis.call('EXISTS', pk) == 1 then redis.call('DEL', pk); return 0 end
  return -1
end
local rec = redis.call('HMGET', pk, 'n', 'p')
if rec[1] ~= ARGV[1] or rec[2] ~= ARGV[2] then return -1 end
if ARGV[3] == 'sha' and redis.sha1hex(redis.call('HGET', pk, 'd') or '') ~= ARGV[4] then return -1 end
local freed = redis.call('HSTRLEN', pk, 'd') - 8
redis.call('DEL', pk)
return freed
"""
