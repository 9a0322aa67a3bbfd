#!/usr/bin/env bash
# Needs bash (arrays, [[ ]], process substitution, pipefail): run ./warm_tenant.sh or `bash warm_tenant.sh`.
[ -n "${BASH_VERSION:-}" ] || { echo "$0: needs bash, not sh (run it as ./warm_tenant.sh)" >&2; exit 2; }
# Runbook: warm a tenant's hottest prefixes before its traffic arrives.
#
#   TENANT=t1 KVC_SALT_FILE=/etc/kvc/t1.salt KVC_STORE=/var/lib/kvc ./warm_tenant.sh [MAX_PAGES]
#   TENANT=t1 KVC_SALT=... KVC_STORE=/var/lib/kvc ./warm_tenant.sh                  # or the salt in the environment
#
# The salt never goes on a command line (every local user can read those): kvc reads it from KVC_SALT or from the
# file KVC_SALT_FILE names (--salt-file). With KVC_SOCKET set (a live cache started by `kvc serve` or embedded in
# the engine), the pages land in that cache's L2; without it, the command checks what the store holds for the
# tenant and how fast it reads.
# Exit: 0 warmed, 3 nothing stored for the tenant (new tenant or wrong salt: check before paging anyone),
# 2 kvc could not run (message on stderr).
set -euo pipefail
KVC=${KVC:-kvc}
: "${TENANT:?set TENANT to the extra_key of the tenant}"
MAX_PAGES=${1:-4096}

args=(prefetch --extra-key "$TENANT" --max-pages "$MAX_PAGES" --json)
if [[ -n "${KVC_SALT_FILE:-}" ]]; then args+=(--salt-file "$KVC_SALT_FILE"); fi
result=$("$KVC" "${args[@]}")   # set -e: exit 2 from kvc stops the runbook here

# --json prints one object; pick the fields with Python (no jq needed on the host)
read -r pages hit bytes fp < <(python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["pages"], d["hit_tokens"], d["bytes"], d["namespace"]["salt_fingerprint"] or "-")' <<<"$result")

if [[ "$pages" -eq 0 ]]; then
    echo "warm_tenant: nothing stored for tenant $TENANT (salt fingerprint $fp)" >&2
    exit 3
fi
echo "warm_tenant: tenant $TENANT (salt fingerprint $fp): $pages pages, $hit tokens, $bytes bytes warmed"
