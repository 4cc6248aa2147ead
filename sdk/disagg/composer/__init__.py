"""The composer: indexed placement, all-or-nothing execution, recomposition, health and healing."""

from disagg.composer.composer import FabricComposer, KindUsage, PoolUsage, request_summary
from disagg.composer.index import Inventory
from disagg.composer.placement import Placer, describe_line

__all__ = ["FabricComposer", "Inventory", "KindUsage", "Placer", "PoolUsage", "describe_line", "request_summary"]
