"""Job configuration: layout of parameters and buckets, the ring, the mirrors."""
