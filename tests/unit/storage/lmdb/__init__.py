"""Tests of kvcache.storage.lmdb, one file per module (a package: test basenames repeat across folders)."""
