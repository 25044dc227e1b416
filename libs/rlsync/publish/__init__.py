"""Publishing weights from any training loop: the trainer's side of rlsync, embeddable.

    from rlsync.publish import WeightPublisher, WeightMap
"""

from rlsync.publish.mapping import WeightMap
from rlsync.publish.publisher import WeightPublisher

__all__ = ["WeightMap", "WeightPublisher"]
