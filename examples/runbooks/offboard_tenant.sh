#!/usr/bin/env bash
# Needs bash (arrays, [[ ]], process substitution, pipefail): run ./offboard_tenant.sh or `bash offboard_tenant.sh`.
[ -n "${BASH_VERSION:-}" ] || { echo "$0: needs bash, not sh (run it as ./offboard_tenant.sh)" >&2; exit 2; }
# Runbook: offboard a tenant — drop every page of its namespace from the store, then prove it is gone.
#
#   NS_ID=3f1c0a9e5b7d2468 KVC_STORE=/var/lib/kvc ./offboard_tenant.sh          # the id `kvc ns ls` prints
#   TENANT=t1 FINGERPRINT=5bad764d95ac KVC_STORE=/var/lib/kvc ./offboard_tenant.sh   # or extra_key + fingerprint
#
# No salt is needed (nor ever put on a command line): the namespace is named by what `kvc ns ls` shows. Running
# it again after a success is a success (`ns drop --missing-ok`), so a retried cron job or a re-run ticket is safe.
# Exit: 0 dropped (or already gone) and verified gone, 1 the namespace is still listed, 2 kvc could not run.
set -euo pipefail
KVC=${KVC:-kvc}
if [[ -n "${NS_ID:-}" ]]; then
    target=(--id "$NS_ID")
elif [[ -n "${FINGERPRINT:-}" ]]; then
    : "${TENANT:?set TENANT (the extra_key) with FINGERPRINT}"
    target=(--fingerprint "$FINGERPRINT" "$TENANT")
else
    echo "offboard_tenant: set NS_ID, or TENANT and FINGERPRINT (see kvc ns ls)" >&2
    exit 2
fi

dropped=$("$KVC" ns drop "${target[@]}" --missing-ok --yes --json)
read -r was pages id < <(python3 -c '
import json, sys
d = json.load(sys.stdin)
print("dropped" if d["dropped"] else "absent", d["pages"], d["id"] or "-")' <<<"$dropped")
if [[ "$was" == dropped ]]; then
    echo "offboard_tenant: dropped $pages pages of namespace $id"
else
    echo "offboard_tenant: namespace ${NS_ID:-${TENANT:-}/${FINGERPRINT:-}} is not in the store (already offboarded)"
fi

# Verify: no namespace with that id (or that extra_key and fingerprint) is listed any more.
left=$("$KVC" ns ls -o jsonl | python3 -c '
import json, sys
ns_id, tenant, fp = sys.argv[1:4]
rows = [json.loads(line) for line in sys.stdin if line.strip()]
hits = [r for r in rows if (ns_id and r["id"] == ns_id) or (fp and r["salt_fingerprint"] == fp and r["extra_key"] == tenant)]
print(sum(r["pages"] for r in hits) if hits else 0)' "${NS_ID:-}" "${TENANT:-}" "${FINGERPRINT:-}")
if [[ "$left" -ne 0 ]]; then
    echo "offboard_tenant: the namespace still lists $left pages" >&2
    exit 1
fi
echo "offboard_tenant: verified: the namespace is no longer in the store"
