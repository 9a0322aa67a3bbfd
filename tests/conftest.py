"""What every test process shares: the cyclic garbage collector walks only what the tests allocate, and the fork
servers (`forkrun`) that a process of its own is forked from, without a Python start and kvc's imports each."""

import gc

import pytest

import forkrun


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
