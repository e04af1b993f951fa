"""The one check the namespace tests share: can this machine make network namespaces?"""

from __future__ import annotations

import pytest

from kit.errors import NetnsUnavailable
from kit.testing.netns import check_available


def _netns_problem() -> str | None:
    try:
        check_available()
    except NetnsUnavailable as e:
        return str(e)
    return None


#: Why namespace tests cannot run here (None: they can).
NETNS_PROBLEM = _netns_problem()
skip_without_netns = pytest.mark.skipif(
    NETNS_PROBLEM is not None, reason=f"netns unavailable: {NETNS_PROBLEM}"
)
