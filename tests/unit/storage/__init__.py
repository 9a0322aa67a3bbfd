"""Tests of kvcache.storage, one file per module (a package: test basenames repeat across folders)."""
