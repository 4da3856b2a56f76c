#!/usr/bin/env bash
# Regenerate tests/cluster/go/k8s/go.mod + go.sum for another Kubernetes patch/minor release.
#
#   tests/cluster/go/update-k8s.sh v1.34.4
#
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/client-go, ...) at v0.0.0 and
# replaces them with ./staging/... ; as a dependency those replaces are ignored, so the wrapper
# module replaces every one of them with the published v0.<minor>.<patch> tag. The list is derived
# from the go.mod the proxy serves, never hard-coded. Needs only the Go module proxy.
set -euo pipefail
K8S="${1:?usage: update-k8s.sh v1.MINOR.PATCH}"
STG="v0.${K8S#v1.}"
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/k8s"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod

cd "$DIR"
KMOD="$(go list -m -json "k8s.io/kubernetes@$K8S" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
GOVER="$(go mod edit -json "$KMOD" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Go"])')"
printf 'module phalanx.invalid/tests/cluster/go/k8s\n\ngo %s\n' "$GOVER" > go.mod
rm -f go.sum
for m in $(go mod edit -json "$KMOD" | python3 -c '
import json, sys
d = json.load(sys.stdin)
print("\n".join(r["Path"] for r in d["Require"] if r["Version"] == "v0.0.0"))'); do
  go mod edit -replace="$m=$m@$STG"
done
go mod edit -require="k8s.io/kubernetes@$K8S"
for c in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
  go mod edit -tool="k8s.io/kubernetes/cmd/$c"
done
go mod tidy
echo "updated $DIR/go.mod to k8s.io/kubernetes $K8S (staging $STG); run tests/cluster/build-binaries.sh kubernetes"
