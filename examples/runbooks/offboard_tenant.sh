#!/usr/bin/env bash
# Needs bash (arrays, [[ ]], process substitution, pipefail): run ./offboard_tenant.sh or `bash offboard_tenant.sh`.
[ -n "${BASH_VERSION:-}" ] || { echo "$0: needs bash, not sh (run it as ./offboard_tenant.sh)" >&2; exit 2; }
# Runbook: offboard a tenant — drop every page of its namespace from the store and from every live cache that
# serves the store, then prove it is gone. Needs python3 too.
#
#   NS_ID=3f1c0a9e5b7d2468 KVC_STORE=/var/lib/kvc ./offboard_tenant.sh          # the id `kvc ns ls` prints
#   TENANT=t1 FINGERPRINT=5bad764d95ac KVC_STORE=/var/lib/kvc ./offboard_tenant.sh   # or extra_key + fingerprint
#   KVC_SOCKET=/run/kvc/engine.sock NS_ID=... KVC_STORE=... ./offboard_tenant.sh    # through a live cache
#
# No salt is needed (nor ever put on a command line): the namespace is named by what `kvc ns ls` shows.
# Live caches (`kvc serve`) record themselves in the store: while one holds the tenant, the offline drop is
# refused (exit 2, naming its socket) because that cache would write the tenant back; run again with KVC_SOCKET
# set to that socket, and the drop goes through it. Every other live cache of the store follows the drop.
# Running it again after a success is a success (the store records the drop), so a retried cron job or a re-run
# ticket is safe; a name that matches nothing the store holds or ever dropped (a typo) fails loudly.
# Exit: 0 dropped (or dropped before, as the store records) and verified gone; 1 the namespace is still listed,
# or nothing by that name was ever in the store; 2 kvc refused (a malformed id, a live cache holds the tenant)
# or could not run.
set -euo pipefail
KVC=${KVC:-kvc}
if [[ -n "${NS_ID:-}" ]]; then
    target=(--id "$NS_ID")
    named="id $NS_ID"
elif [[ -n "${FINGERPRINT:-}" ]]; then
    : "${TENANT:?set TENANT (the extra_key) with FINGERPRINT}"
    target=(--fingerprint "$FINGERPRINT" "$TENANT")
    named="$TENANT/$FINGERPRINT"
else
    echo "offboard_tenant: set NS_ID, or TENANT and FINGERPRINT (see kvc ns ls)" >&2
    exit 2
fi

# kvc's own errors (a malformed id, a live cache holding the tenant) are one line on stderr, exit 2: set -e
# ends the runbook with them.
dropped=$("$KVC" ns drop "${target[@]}" --missing-ok --yes --json)
read -r was pages id < <(python3 -c '
import json, sys
d = json.load(sys.stdin)
state = "dropped" if d["dropped"] else ("before" if d["dropped_before"] is not None else "never")
print(state, d["store_pages"] + d["device_pages"] + d["host_pages"], d["id"] or "-")' <<<"$dropped")
case "$was" in
    dropped) echo "offboard_tenant: dropped $pages pages of namespace $id${KVC_SOCKET:+ through $KVC_SOCKET}" ;;
    before) echo "offboard_tenant: namespace $named is not in the store (already offboarded: the store records its drop)" ;;
    *)
        echo "offboard_tenant: no namespace $named in the store, and no record that it was ever dropped:" \
             "check NS_ID / TENANT / FINGERPRINT against kvc ns ls" >&2
        exit 1 ;;
esac

# Verify: no namespace with that id (or that extra_key and fingerprint) is listed in the store any more, nor, with
# KVC_SOCKET, in the live cache's tiers.
count_left() {
    python3 -c '
import json, sys
ns_id, tenant, fp = sys.argv[1:4]
rows = [json.loads(line) for line in sys.stdin if line.strip()]
hits = [r for r in rows if (ns_id and r["id"] == ns_id.lower())
        or (fp and r["salt_fingerprint"] == fp.lower() and r["extra_key"] == tenant)]
print(sum(r["pages"] + (r["device"]["pages"] + r["host"]["pages"] if "device" in r else 0) for r in hits))' \
        "${NS_ID:-}" "${TENANT:-}" "${FINGERPRINT:-}"
}
left=$(env -u KVC_SOCKET "$KVC" ns ls -o jsonl | count_left)
if [[ -n "${KVC_SOCKET:-}" ]]; then
    left=$(( left + $("$KVC" --socket "$KVC_SOCKET" ns ls -o jsonl | count_left) ))
fi
if [[ "$left" -ne 0 ]]; then
    echo "offboard_tenant: the namespace still lists $left pages" >&2
    exit 1
fi
echo "offboard_tenant: verified: the namespace is no longer in the store${KVC_SOCKET:+ nor in the live cache}"
