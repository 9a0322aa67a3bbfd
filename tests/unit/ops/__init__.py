"""Tests of kvcache.ops, one file per module (a package: test basenames repeat across folders)."""
