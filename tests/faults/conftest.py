"""The fault suite (issue 14): trials of crashes, concurrent growth, corrupted B-trees, hostile admin-socket
peers, Redis data loss and fuzzed inputs. Each trial is real (processes killed with SIGKILL, bytes flipped in a
real LMDB file, a real second local user, a real redis-server); each test records its trials in a table printed at
the end of the run (trials, survived, lost).

Size: the default run fits CI (about two minutes on two idle cores). `--long` (when the run names this folder,
``pytest tests/faults --long``) or env ``KVC_FAULTS=long`` multiplies the trials by `LONG_FACTOR`; env
``KVC_FAULTS=<n>`` multiplies them by n. The damage matrix (`matrix`, issue 36) runs its CI sample by default and
its whole product under either, or with env ``KVC_DAMAGE_MATRIX=full``. The fork servers its trials start kvc
from (`forks`, `engine_forks`) are tests/conftest.py's.
"""

from __future__ import annotations

import pytest

import faultkit


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help=f"fault suite: run {faultkit.LONG_FACTOR}x the trials of the CI size")


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "long", False):
        faultkit.set_scale(faultkit.LONG_FACTOR)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if faultkit.ROWS:
        terminalreporter.write_sep("-", "fault trials")
        for line in faultkit.table().splitlines():
            terminalreporter.write_line(line)
