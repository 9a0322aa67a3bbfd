#!/usr/bin/env bash
# Runbook: offboard a tenant — drop every page of its namespace from the store, then prove it is gone.
#
#   TENANT=t1 SALT=... KVC_STORE=/var/lib/kvc ./offboard_tenant.sh
#
# Exit: 0 dropped and verified gone, 1 pages of the namespace are still listed, 2 kvc could not run.
set -euo pipefail
KVC=${KVC:-kvc}
: "${TENANT:?set TENANT to the extra_key of the tenant}"
salt_args=()
if [[ -n "${SALT:-}" ]]; then salt_args=(--salt "$SALT"); fi

dropped=$("$KVC" ns drop "$TENANT" "${salt_args[@]}" --yes --json)
read -r pages fp < <(python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["pages"], d["namespace"]["salt_fingerprint"] or "-")' <<<"$dropped")
echo "offboard_tenant: dropped $pages pages of tenant $TENANT (salt fingerprint $fp)"

# Verify: the namespace is no longer listed with any page, and prefetching it finds nothing.
left=$("$KVC" ns ls --json | python3 -c '
import json, sys
fp = None if sys.argv[1] == "-" else sys.argv[1]
rows = [r for r in json.load(sys.stdin)["namespaces"]
        if r["extra_key"] == sys.argv[2] and r["salt_fingerprint"] == fp and r["pages"] > 0]
print(sum(r["pages"] for r in rows))' "$fp" "$TENANT")
warm=$("$KVC" prefetch --extra-key "$TENANT" "${salt_args[@]}" --json | python3 -c '
import json, sys; print(json.load(sys.stdin)["pages"])')
if [[ "$left" -ne 0 || "$warm" -ne 0 ]]; then
    echo "offboard_tenant: tenant $TENANT still has $left pages listed, $warm fetchable" >&2
    exit 1
fi
echo "offboard_tenant: verified: no page of tenant $TENANT is listed or fetchable"
