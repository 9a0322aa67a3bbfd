"""Tests of kvcache.live."""
