"""Tests of kvcache, one package a folder (a package each, so test files may share a name across folders)."""
