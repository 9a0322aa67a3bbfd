"""Unit tests: tests/unit/<package>/test_<module>.py mirrors kvcache/<package>/<module>.py."""
