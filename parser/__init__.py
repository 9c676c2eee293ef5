"""Wire decoding: RoCEv2 frames -> RDMA messages -> NCCL sends -> reduced all-reduce buffers."""
