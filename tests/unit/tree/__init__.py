"""Tests of kvcache.tree, one file per module (a package: test basenames repeat across folders)."""
