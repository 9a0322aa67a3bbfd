"""Tests of kvcache.tree. A package so that its test modules may share a basename with one elsewhere
(tests/unit/test_shares.py and tree/test_shares.py): pytest's default import mode names them `test_shares` and
`tree.test_shares`."""
