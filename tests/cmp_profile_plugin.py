"""A pytest plugin for the GPU tier on the CMP code path (`bash cuda/gpu_run.sh MODE --profile cmp` loads it with
`-p tests.cmp_profile_plugin`): the profile CMPCHAT_PROFILE names applies before any test module is collected, so
nothing a test imports or compiles can load another NVVM first (`cmpchat/cudart/target.py`)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from cmpchat.cudart.target import activate

    activate()
