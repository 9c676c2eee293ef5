#!/bin/sh
# Debian packages the test suite needs: tshark (dissection check), tcpdump, openssl (the TLS tests
# make their certificates with it), DPDK 22.11 with the pcap and af_packet virtual devices, iproute2
# (network namespaces, tc), ISA-L (the ICRC's CRC-32), systemd's systemd-analyze (the unit in docs/deploy is
# verified). Installs only what is missing; without root
# it says what to install and stops. Packages named as arguments are installed instead of the list
# (`make demo` installs libisal-dev alone).
set -e
need=""
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }
all="tshark tcpdump iproute2 ethtool openssl systemd dpdk libdpdk-dev librte-net-pcap23 librte-net-af-packet23
     librte-net-null23 librte-mempool-ring23 zlib1g-dev libisal-dev gcc pkg-config"
for p in ${*:-$all}; do
    have "$p" || need="$need $p"
done
[ -z "$need" ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "missing Debian packages:$need (run as root: apt-get install$need)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
apt-get update -q
apt-get install -y -q $need
