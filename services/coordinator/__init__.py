"""The coordinator: the fleet's registry, the weight-sync sequences, and the generation gateway."""
