"""What every test process shares: the cyclic garbage collector walks only what the tests allocate, and the fork
servers (`forkrun`) that a process of its own is forked from, without a Python start and kvc's imports each; and
the tests' order, where it decides how often a module's long fixture runs under pytest-xdist."""

import gc

import pytest

import forkrun

# Modules whose one module-scoped fixture is long: each runs first, so that one worker runs it (below).
_LONG_MODULE_FIXTURES = ("test_cli_goldens",)  # every case as a kvc process of its own: ~25 s


def pytest_collection_modifyitems(session, config, items):
    """Tests of `_LONG_MODULE_FIXTURES` first. pytest-xdist's worksteal hands each worker a contiguous block of the
    list and steals from the end of a block: at the front, one worker runs such a module's fixture once, where a
    block boundary through the module made both workers run it."""
    items.sort(key=lambda item: item.module.__name__ not in _LONG_MODULE_FIXTURES)


def pytest_collection_finish(session):
    """Every module the tests import is loaded once collection ends (torch, numpy, kvc: hundreds of thousands of
    objects that are never garbage); moved out of the collector's reach, a full collection during a test walks only
    what the tests made (with them in it, one costs ~0.1 s)."""
    gc.freeze()


@pytest.fixture(scope="session")
def forks():
    """A server that imported kvc's store commands once, to fork a kvc process per command from (`forkrun`)."""
    server = forkrun.Forks()
    yield server
    server.close()


@pytest.fixture(scope="session")
def engine_forks():
    """A server that imported kvc's engine too (torch), to fork `kvc serve`, `kvc replay` and other commands that
    drive a cache from (`forkrun`)."""
    server = forkrun.Forks(forkrun.ENGINE_MODULES)
    yield server
    server.close()
