#!/usr/bin/env bash
# Records the real-NCCL corpus (tests/pcaps/nccl-real/) on a machine with one GPU, in one call,
# within about 9 minutes on 16 cores, and packs it for the trip back. From the repository root:
#
#   tools/record/device_corpus.sh            (the device tool: command as is, carry [".carry"])
#
# Environment: NCCL_LIBS  folder of NCCL releases: nvidia-nccl-cu12/cu13 wheels (*.whl, unzipped
#                         here) or folders holding libnccl.so.2 (default .carry/nccl); torch's own
#                         libnccl.so.2 is always recorded too
#              DEBS       Debian packages the image may lack (default .carry/debs, tools/record/carry.sh)
#              OUT        where the packed corpus goes (default ./corpus-out; the device tool sets it)
#              BUDGET_S   seconds after which no new recording starts (default 420)
#              JOBS       recordings at a time (default 4: ranks busy-poll a core each, and share the GPU)
# Matrix, per release found: protocols auto, LL, LL128, Simple (2 ranks); 2 and 4 QPs per
# connection (RoCE; over sockets instead 2 threads x 2 sockets); 3 ranks auto. Each recording runs
# the replay check where the Cython kernels build; tests/test_nccl_real.py replays them all again.
set -u
cd "$(dirname "$0")/../.."
START=$(date +%s)
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/corpus-out}
CORPUS=tests/pcaps/nccl-real
BUDGET_S=${BUDGET_S:-420}
JOBS=${JOBS:-4}
NCCL_LIBS=${NCCL_LIBS:-.carry/nccl}
DEBS=${DEBS:-.carry/debs}
WORK=$(mktemp -d /tmp/record-corpus.XXXXXX)
mkdir -p "$OUT"
LOG=$OUT/corpus-log.txt
exec > >(tee "$LOG") 2>&1
say() { echo "[corpus $(( $(date +%s) - START ))s] $*"; }

# 1. the packages the image lacks, taken from the carried .debs (unpacked, never installed)
USE_DEBS=$WORK/debs
mkdir -p "$USE_DEBS"
pick() { for p in "$@"; do cp "$DEBS"/${p}_*.deb "$USE_DEBS"/ 2>/dev/null || say "no carried $p .deb"; done; }
ldconfig -p | grep -q 'libibverbs.so.1 ' || pick libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200
ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so >/dev/null 2>&1 || pick ibverbs-providers
command -v rdma >/dev/null || pick iproute2 libmnl0 libbsd0 libmd0 libcap2
command -v tcpdump >/dev/null || pick tcpdump libpcap0.8 libdbus-1-3
[ -f /usr/include/zlib.h ] || pick zlib1g-dev
DEBS_ARG=()
if ls "$USE_DEBS"/*.deb >/dev/null 2>&1; then
    DEBS_ARG=(--rdma-debs "$USE_DEBS")
    for d in "$USE_DEBS"/*.deb; do dpkg-deb -x "$d" "$USE_DEBS/root"; done
    export C_INCLUDE_PATH="$USE_DEBS/root/usr/include${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
    export LIBRARY_PATH="$USE_DEBS/root/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi

# 2. the package importable as `mirrorckpt` (the repository root is the package), kernels built in place
ln -sfn "$PWD" "$WORK/mirrorckpt"
export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}"
REPLAY=(--replay)
if ! $PY setup.py -q build_ext --inplace -j 16 > "$WORK/build.log" 2>&1; then
    say "the Cython kernels did not build (tail of the log below): recording without the replay check"
    tail -5 "$WORK/build.log"
    REPLAY=(--no-replay)
fi
MK=($PY -m mirrorckpt.tools.cli record)
"${MK[@]}" --check "${DEBS_ARG[@]}" | tee "$OUT/check.txt"
TRANSPORT=$(sed -n 's/^can record nccl over \(roce\|socket\)$/\1/p' "$OUT/check.txt")
if [ -z "$TRANSPORT" ]; then
    say "this machine cannot record NCCL (check.txt names what it lacks)"
    exit 2
fi

# 3. the releases: every wheel or folder under NCCL_LIBS, and torch's own
LIBS=()
for whl in "$NCCL_LIBS"/*.whl; do
    [ -e "$whl" ] || continue
    dir=$WORK/nccl/$(basename "$whl" .whl)
    mkdir -p "$dir" && $PY -m zipfile -e "$whl" "$dir" && LIBS+=("$(find "$dir" -name 'libnccl.so*' | head -1)")
done
while IFS= read -r lib; do LIBS+=("$lib"); done < <(find "$NCCL_LIBS" -name 'libnccl.so.2' 2>/dev/null)
LIBS+=("$($PY -c 'from mirrorckpt.tools.record.machine import bundled_nccl; print(bundled_nccl() or "")')")
declare -A SEEN
JOBLIST=$WORK/jobs
: > "$JOBLIST"
SMALL=(--model mlp:16,64,64,256 --bucket-cap-mb 0.005 --steps 2)  # buckets of 16.6 K, 4.2 K, 1.1 K elements
WIDE=(--model mlp:16,64,128,1024 --bucket-cap-mb 0.01 --steps 2)  # 132 K, 8.3 K, 1.1 K: every protocol under auto
for lib in "${LIBS[@]}"; do
    [ -n "$lib" ] || continue
    v=$($PY -c "import sys; from mirrorckpt.tools.record.nccl import Library; print(Library(sys.argv[1]).version)" "$lib") || continue
    [ -z "${SEEN[$v]:-}" ] || continue
    SEEN[$v]=1
    say "NCCL $v: $lib"
    t=$TRANSPORT
    rows=("v$v-$t-auto-r2 --nccl-lib $lib ${WIDE[*]}"
          "v$v-$t-LL-r2 --nccl-lib $lib --proto LL ${SMALL[*]}"
          "v$v-$t-Simple-r2 --nccl-lib $lib --proto Simple ${SMALL[*]}"
          "v$v-$t-LL128-r2 --nccl-lib $lib --proto LL128 ${SMALL[*]}")
    if [ "$t" = roce ]; then
        rows+=("v$v-$t-Simple-r2-q2 --nccl-lib $lib --proto Simple --qps 2 ${SMALL[*]}"
               "v$v-$t-LL-r2-q4 --nccl-lib $lib --proto LL --qps 4 ${SMALL[*]}")
    else
        rows+=("v$v-$t-Simple-r2-t2s2 --nccl-lib $lib --proto Simple --env NCCL_SOCKET_NTHREADS=2 --env NCCL_NSOCKS_PERTHREAD=2 ${SMALL[*]}")
    fi
    rows+=("v$v-$t-auto-r3 --nccl-lib $lib --ranks 3 ${WIDE[*]}")
    for k in "${!rows[@]}"; do echo "$k ${rows[$k]}"; done >> "$JOBLIST"
done
[ -s "$JOBLIST" ] || { say "no NCCL library found (NCCL_LIBS=$NCCL_LIBS, torch's none)"; exit 2; }
# first every release's first recording, then every release's second, ...
sort -n -k1,1 -s "$JOBLIST" | cut -d' ' -f2- > "$JOBLIST.sorted"
say "$(wc -l < "$JOBLIST") recordings, $JOBS at a time, none started after ${BUDGET_S}s"

one() {  # NAME ARGS...: one recording, unless the budget is spent
    local name=$1; shift
    if [ $(( $(date +%s) - START )) -gt "$BUDGET_S" ]; then echo "$name: not started (budget spent)" >> "$WORK/results"; return; fi
    local t0; t0=$(date +%s)
    "${MK[@]}" --out "$CORPUS/$name" --transport "$TRANSPORT" --no-ingress --max-mb 6 --timeout 150 \
        "${DEBS_ARG[@]}" "${REPLAY[@]}" "$@" > "$WORK/$name.out" 2>&1
    local rc=$?
    echo "$name: exit $rc in $(( $(date +%s) - t0 ))s: $(tail -1 "$WORK/$name.out")" >> "$WORK/results"
}
while IFS= read -r line; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.5; done
    # shellcheck disable=SC2086
    one $line &
done < "$JOBLIST.sorted"
wait
say "recordings done"
cat "$WORK/results"
for f in "$WORK"/*.out; do echo "== $(basename "$f")"; tail -4 "$f"; done > "$OUT/recordings.txt"

# 4. the corpus README lists what was recorded; pack everything for the trip back (files of 15 MB)
mkdir -p "$WORK/failed"
$PY - "$CORPUS" "$WORK/failed" <<'EOF'
import json, shutil, sys
from pathlib import Path
corpus = Path(sys.argv[1])
lines = []
failed = Path(sys.argv[2])
for d in sorted(p for p in corpus.iterdir() if p.is_dir() and not (p / "README.md").is_file()):
    shutil.move(str(d), str(failed / d.name))  # a recording that failed: its logs go back apart, no capture is kept
for d in sorted(p for p in corpus.iterdir() if (p / "truth.json").is_file()):
    rec = json.loads((d / "truth.json").read_text())["record"]
    verdict = next((ln.split(": ", 1)[1] for ln in (d / "README.md").read_text().splitlines()
                    if ln.startswith("- verdict when recorded:")), "?")
    lines.append(f"- `{d.name}`: {rec['library']}, {rec['transport']}, {(rec['gpu'] or {}).get('name')}; {verdict}")
readme = corpus / "README.md"
head = readme.read_text().split("## Captures")[0]
readme.write_text(head + "## Captures\n\n" + ("\n".join(lines) if lines else "none yet: the recording found nothing to keep") + "\n")
EOF
tar -C "$WORK/failed" --exclude='*.pcap' -cJf "$OUT/failed-logs.tar.xz" .
tar -C tests/pcaps -cf - nccl-real | xz -T0 -6 | split -b 15M -d - "$OUT/nccl-real.tar.xz.part-"
ls -l "$OUT"
say "unpack here with: cat nccl-real.tar.xz.part-* | xz -d | tar -x -C tests/pcaps"
