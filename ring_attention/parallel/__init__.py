"""The parallel layer: the ring, Ulysses and their hybrid, the sharding helpers, the transport."""
