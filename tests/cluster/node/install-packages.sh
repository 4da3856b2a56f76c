#!/bin/sh
# Install the Debian packages the real-node tier needs (containerd, runc, CNI plugins,
# iptables/conntrack for kube-proxy, debootstrap for the trainer rootfs, gcc/libc6-dev for the
# static pause binary, docker.io for the operator image: a private dockerd builds the Dockerfile,
# see operator_image.py).  Idempotent: exits quietly when everything is already installed.
# Services shipped by these packages are NOT started (policy-rc.d denies it for the duration
# of the install); the tests run their own private containerd.
set -eu

PKGS="containerd runc containernetworking-plugins iptables conntrack debootstrap \
      gcc libc6-dev iproute2 util-linux mount procps socat ethtool openssl ca-certificates \
      kmod docker.io"

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
        missing="$missing $p"
    fi
done
[ -z "$missing" ] && exit 0

if [ "$(id -u)" != 0 ]; then
    echo "install-packages.sh: need root to install:$missing" >&2
    exit 1
fi

echo "install-packages.sh: installing:$missing" >&2
export DEBIAN_FRONTEND=noninteractive
# Keep maintainer scripts from starting a system containerd.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    created_policy=1
fi
cleanup() { [ "$created_policy" = 1 ] && rm -f "$policy"; return 0; }
trap cleanup EXIT INT TERM

if ! apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
