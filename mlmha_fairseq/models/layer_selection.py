"""Layer lists of the options that put a mechanism in some layers only (``--mma-layers``,
``--dc-encoder-layers``, ``--dc-decoder-layers``): ``none``, ``all`` or 1-based layers and
inclusive ranges such as ``1,3,5-6``."""
import re
from typing import FrozenSet

from ..errors import UsageError

NO_LAYERS, ALL_LAYERS = "none", "all"
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_layers(value: str, num_layers: int, option: str, stack: str) -> FrozenSet[int]:
    """0-based indices of the layers that ``value`` names in a ``stack`` ("encoder" or
    "decoder") of ``num_layers``; a ValueError naming ``option`` otherwise."""
    value = value.strip().lower()
    if value == NO_LAYERS:
        return frozenset()
    if value == ALL_LAYERS:
        return frozenset(range(num_layers))
    layers = set()
    for part in value.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise UsageError(f"{option} {value!r}: expected none, all, or 1-based layers and "
                             "ranges such as 1-3 or 1,3,5-6")
        first, last = int(match[1]), int(match[2] or match[1])
        if not 1 <= first <= last <= num_layers:
            raise UsageError(f"{option} {value!r}: {part.strip()} is not a range of {stack} layers "
                             f"within 1..{num_layers}")
        layers.update(range(first - 1, last))
    return frozenset(layers)
