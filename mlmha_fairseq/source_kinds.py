"""What the multi-source task tells the multi-source model about its sources, in a module
that both may import (the model does not depend on the data code)."""
from dataclasses import dataclass
from typing import Tuple

TEXT, IMAGE = "text", "image"


@dataclass(frozen=True)
class SourceLayout:
    """The sources of a multi-source model, in ``--source-langs`` order: their names,
    kinds (:data:`TEXT` or :data:`IMAGE`), the index of the primary source (the one
    fairseq's generator sees as ``src_tokens``) and the feature size of each image source
    (0 for text)."""

    names: Tuple[str, ...]
    kinds: Tuple[str, ...]
    primary_index: int
    image_channels: Tuple[int, ...]

    @classmethod
    def of_task(cls, task) -> "SourceLayout":
        """The layout of a ``multi_source_translation`` task."""
        return cls(tuple(task.source_names), tuple(task.source_kinds), task.primary_index,
                   tuple(task.image_channels.get(name, 0) for name in task.source_names))

    def __len__(self) -> int:
        return len(self.names)
