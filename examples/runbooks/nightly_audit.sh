#!/usr/bin/env bash
# Runbook: nightly integrity audit of the L3 store; alerts when it finds problems.
#
#   KVC_STORE=/var/lib/kvc ALERT_CMD='logger -p user.crit' ./nightly_audit.sh
#
# `kvc audit` exits 0 when the store is clean, 1 when it found problems, 2 when it could not run.
# Exit: the audit's code. On 1 the findings go to ALERT_CMD (default: stderr) one line per kind.
set -uo pipefail
KVC=${KVC:-kvc}
ALERT_CMD=${ALERT_CMD:-}

report=$("$KVC" audit --json)
rc=$?
case $rc in
    0)
        echo "nightly_audit: ok ($(python3 -c 'import json,sys; c=json.load(sys.stdin)["checked"]; print(c.get("pages", 0), "pages checked")' <<<"$report"))"
        ;;
    1)
        summary=$(python3 -c '
import collections, json, sys
d = json.load(sys.stdin)
for kind, n in sorted(collections.Counter(v["kind"] for v in d["violations"]).items()):
    print(f"ALERT kvc store audit: {n} x {kind}")' <<<"$report")
        if [[ -n "$ALERT_CMD" ]]; then
            while IFS= read -r line; do $ALERT_CMD "$line"; done <<<"$summary"
        else
            echo "$summary" >&2
        fi
        ;;
    *)
        echo "nightly_audit: kvc audit could not run (exit $rc)" >&2
        ;;
esac
exit $rc
