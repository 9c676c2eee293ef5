#!/bin/sh
# Regenerates the bundled capture sets with the traffic generator; the output is deterministic
# (fixed seeds, simulated clock, one torch thread), so a rerun gives the same bytes.
#
#   ./tests/pcaps/make.sh MIRRORCKPT [OUT_ROOT [SET ...]]
#
# MIRRORCKPT is the `mirrorckpt` executable (`make pcaps` passes .venv/bin/mirrorckpt); OUT_ROOT
# defaults to this folder; SETs default to all of them. Each set is a folder with the mirror
# captures, truth.json, initial_params.bin and job.toml (`mirrorckpt replay --config SET/job.toml`).
set -eu

BIN=${1:?usage: make.sh MIRRORCKPT [OUT_ROOT [SET ...]]}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=${2:-$HERE}
if [ $# -gt 2 ]; then shift 2; SETS="$*"; else SETS="demo ll_r2_noise_faults simple_r3_both ll128_bf16_v229 split_v212_ipv4_wrap"; fi

gen() {
    name=$1; shift
    rm -rf "$ROOT/$name"
    "$BIN" gen --out "$ROOT/$name" "$@" >/dev/null
    echo "$ROOT/$name"
}

for set in $SETS; do
    case $set in
    # The README's main command replays this one: 3 ranks, a small MLP in 2 DDP buckets, 10 Adam
    # steps, two adjacent ranks' egress (together they carry every reduced chunk).
    demo) gen demo --ranks 3 --model mlp:48,96,10 --bucket-cap-mb 0.004 --steps 10 --seed 7 \
              --optimizer adam --lr 0.001 --mirror 0:egress,1:egress ;;
    # Both directions of rank 1 with every kind of background traffic and every fault.
    ll_r2_noise_faults) gen ll_r2_noise_faults --ranks 2 --model mlp:32,64,8 --steps 4 --seed 11 \
              --mirror 1:both --noise all --noise-rate 3000 --loss 0.01 --duplicate 0.01 --reorder 0.01 \
              --corrupt 0.01 --truncate 0.01 --fault-seed 5 ;;
    # Simple: no flags; sends are told apart by their CTS, which both directions of a port carry.
    simple_r3_both) gen simple_r3_both --ranks 3 --protocol Simple --model mlp:32,64,8 --steps 3 --seed 12 \
              --optimizer sgd --momentum 0.9 --lr 0.01 --mirror 0:both,1:both ;;
    # LL128 with bf16 gradients on NCCL 2.29 (big-endian immediates, 64-byte CTS entries, cells).
    ll128_bf16_v229) gen ll128_bf16_v229 --ranks 2 --channels 2 --protocol LL128 --nccl-version 2.29 \
              --grad-dtype bfloat16 --model mlp:64,128,10 --steps 3 --seed 13 --mirror 0:egress,1:egress ;;
    # NCCL 2.12 split WRITE form as per-packet WRITE ONLY trains, IPv4, classic pcap, PSNs wrapping.
    split_v212_ipv4_wrap) gen split_v212_ipv4_wrap --ranks 2 --nccl-version 2.12 --write-only-train \
              --ipv4 --format pcap --psn-start wrap --mtu 4096 --model linear:5000 --steps 3 --seed 14 \
              --mirror 0:egress,1:egress ;;
    *) echo "make.sh: unknown capture set $set" >&2; exit 2 ;;
    esac
done
