"""Fleets on Ray: one fleet file, placement with Ray resources, scaling while running (`rlsync up`)."""

from rlsync.fleet.spec import FleetSpec, RolloutGroup, TrainerSpec, load, parse

__all__ = ["Fleet", "FleetSpec", "RolloutGroup", "TrainerSpec", "load", "parse"]


def __getattr__(name: str):
    if name == "Fleet":  # Ray is imported only by what uses it
        from rlsync.fleet.launcher import Fleet

        return Fleet
    raise AttributeError(name)
