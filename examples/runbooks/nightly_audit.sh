#!/usr/bin/env bash
# Needs bash (arrays, [[ ]], process substitution, pipefail): run ./nightly_audit.sh or `bash nightly_audit.sh`.
[ -n "${BASH_VERSION:-}" ] || { echo "$0: needs bash, not sh (run it as ./nightly_audit.sh)" >&2; exit 2; }
# Runbook: nightly integrity audit of the L3 store, for cron; alerts on anything but a clean store.
#
#   KVC_STORE=/var/lib/kvc ALERT_CMD='logger -p user.crit -t kvc' ./nightly_audit.sh
#
# `kvc audit` exits 0 when the store is clean, 1 when it found problems, 2 when it could not run (no store, a
# store it cannot open): every non-zero exit alerts, so a missing store is never silent under cron. Runs do not
# overlap: a second one while the first holds the lock alerts and exits 75 (EX_TEMPFAIL).
# Exit: the audit's code (75 when another run holds the lock). Alerts go to ALERT_CMD (default: stderr), one line
# each: per finding kind on exit 1, the error line on any other failure.
#
# A monitoring account that may read the store but not write its lock.mdb can run it: kvc then reads the store
# lock-free (it says so on stderr, and the ok line ends "read lock-free"). A permission problem is an error
# (exit 2, "could not run"), never a finding. A lock-free reader cannot hold a snapshot while writers go on: on a
# busy store its audit may fail with store_changed (exit 2, alerted as "could not run"); give that account write
# access to lock.mdb alone (it only registers readers there) for audits of a store in use.
set -uo pipefail
KVC=${KVC:-kvc}
ALERT_CMD=${ALERT_CMD:-}
LOCK=${KVC_AUDIT_LOCK:-${TMPDIR:-/tmp}/kvc-nightly-audit.lock}

alert() {
    if [[ -n "$ALERT_CMD" ]]; then $ALERT_CMD "$1"; else echo "$1" >&2; fi
}

exec 9>>"$LOCK" || { alert "ALERT kvc nightly audit: cannot open the lock file $LOCK"; exit 2; }
if ! flock -n 9; then
    alert "ALERT kvc nightly audit: another run holds $LOCK; skipped"
    exit 75
fi

errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
report=$("$KVC" audit --json 2>"$errors")
rc=$?
case $rc in
    0)
        how=""
        if grep -q "^kvc: note: .*read lock-free" "$errors"; then how="; read lock-free"; fi
        echo "nightly_audit: ok ($(python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["checked"].get("pages", 0), "pages checked;", ", ".join(d["audits"]), "audit", end="")' <<<"$report")$how)"
        ;;
    1)
        while IFS= read -r line; do alert "$line"; done < <(python3 -c '
import collections, json, sys
d = json.load(sys.stdin)
for kind, n in sorted(collections.Counter(v["kind"] for v in d["violations"]).items()):
    print(f"ALERT kvc store audit: {n} x {kind}")' <<<"$report")
        ;;
    *)
        alert "ALERT kvc nightly audit: kvc audit could not run (exit $rc): $(grep -v '^kvc: note: ' "$errors" | tail -n 1)"
        ;;
esac
exit $rc
