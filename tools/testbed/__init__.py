"""Test rigs: trainers that mirror their own traffic, network-namespace topologies, the gloo DDP
job, the mirror follower. Imported by tests, benchmarks and tools; never by a product stage."""
