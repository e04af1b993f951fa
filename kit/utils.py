"""hivemind's ``hivemind.utils`` names that ported hivemind scripts use, re-exported.

For ported hivemind scripts only (``import kit as hivemind`` then ``hivemind.utils.get_dht_time()``):
kit's own code imports these from where they live, ``kit.dht``. Nothing else belongs here.
"""

from kit.dht.node import get_dht_time
from kit.dht.storage import ValueWithExpiration

__all__ = ["ValueWithExpiration", "get_dht_time"]
