#!/usr/bin/env bash
# Fetches, on a machine that reaches Debian's archive, what a GPU machine reaching no registry may
# lack for `mirrorckpt record`, into .carry/ (ignored by git) so it can travel with the tree:
#   .carry/debs/   rdma-core's user-space libraries (libibverbs1, ibverbs-providers and libnl),
#                  iproute2 (the `rdma` tool), tcpdump with libpcap, zlib1g-dev (to build the
#                  Cython kernels): a few MB. device_corpus.sh unpacks only those the image lacks.
#   .carry/nccl/   NCCL releases, as `pip download` wheels of nvidia-nccl-cu12 / -cu13, only if
#                  NCCL_RELEASES is set (e.g. NCCL_RELEASES="2.18.3 2.21.5"): each wheel is
#                  150-300 MB, so they fit only where the transfer to the GPU machine allows it.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .carry/debs
(cd .carry/debs && apt-get download libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 \
    iproute2 libmnl0 libbsd0 libmd0 libcap2 tcpdump libpcap0.8 libdbus-1-3 zlib1g-dev)
du -sh .carry/debs
for release in ${NCCL_RELEASES:-}; do
    mkdir -p .carry/nccl
    python3 -m pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
        -d .carry/nccl "nvidia-nccl-cu12==${release}"
done
