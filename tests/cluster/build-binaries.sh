#!/usr/bin/env bash
# Build the third-party programs the cluster tiers need, from the Go module proxy, into a cache
# directory keyed by version. Idempotent: a module whose binaries are all present is skipped.
#
#   tests/cluster/build-binaries.sh                 # every module
#   tests/cluster/build-binaries.sh kubernetes etcd kwok
#   tests/cluster/build-binaries.sh --print-dir     # print the cache's bin directory and exit
#
# Modules (one wrapper Go module each under tests/cluster/go/, so MVS never merges versions):
#   kubernetes -> kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl
#   etcd       -> etcd
#   kwok       -> kwok
#   coredns    -> coredns
#   helm       -> helm
#   scheduler-plugins -> scheduler-plugins-scheduler (kube-scheduler with Coscheduling),
#                        scheduler-plugins-controller (PodGroup status)
#   kueue      -> kueue (the manager, webhooks included)
#   training-operator -> training-operator (Kubeflow's, for the scale benchmark; only when named)
#   prometheus -> promtool (checks the chart's alert rules)
#   gitops-checks -> gitops-checks (our program: kstatus and Argo CD's Lua, judging TrainingJobs);
#                    its version is a digest of its sources, so an edit rebuilds it
#
# Output: ${PHALANX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/phalanx}/bin/<module>-<version>/<binary>
# Versions come from the wrapper go.mod files; change a version there (then `go mod tidy`).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GO_DIR="$HERE/go"
CACHE_DIR="${PHALANX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/phalanx}"
BIN_ROOT="$CACHE_DIR/bin"

export GOTOOLCHAIN=local
export CGO_ENABLED=0
# The build must use the committed go.sum; never edit go.mod implicitly.
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

ALL_MODULES=(kubernetes etcd kwok coredns helm scheduler-plugins kueue prometheus gitops-checks)  # what the tests need

# module -> wrapper dir, Go module path, binaries
wrapper_dir() {
  case "$1" in
    kubernetes) echo "$GO_DIR/k8s" ;;
    etcd | kwok | coredns | helm | scheduler-plugins | kueue | training-operator | prometheus | gitops-checks) echo "$GO_DIR/$1" ;;
    *) echo "unknown module: $1" >&2; return 1 ;;
  esac
}
module_path() {
  case "$1" in
    kubernetes) echo "k8s.io/kubernetes" ;;
    etcd) echo "go.etcd.io/etcd/server/v3" ;;
    kwok) echo "sigs.k8s.io/kwok" ;;
    coredns) echo "github.com/coredns/coredns" ;;
    helm) echo "helm.sh/helm/v3" ;;
    scheduler-plugins) echo "sigs.k8s.io/scheduler-plugins" ;;
    kueue) echo "sigs.k8s.io/kueue" ;;
    training-operator) echo "github.com/kubeflow/training-operator" ;;
    prometheus) echo "github.com/prometheus/prometheus" ;;
    gitops-checks) echo "phalanx.invalid/tests/cluster/go/gitops-checks" ;;
  esac
}
binaries() {
  case "$1" in
    kubernetes) echo "kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl" ;;
    scheduler-plugins) echo "scheduler-plugins-scheduler scheduler-plugins-controller" ;;
    prometheus) echo "promtool" ;;
    *) echo "$1" ;;
  esac
}
# version of a requirement, read from go.mod without touching the network
required_version() { # <go.mod> <module path>
  if [[ "$2" == phalanx.invalid/* ]]; then # our own program: a digest of its sources
    (cd "$(dirname "$1")" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-12 | sed 's/^/src-/')
    return
  fi
  awk -v m="$2" '($1 == m && $2 ~ /^v/) {print $2; exit} ($1 == "require" && $2 == m) {print $3; exit}' "$1"
}

if [[ "${1:-}" == "--print-dir" ]]; then
  echo "$BIN_ROOT"
  exit 0
fi

modules=("$@")
if [[ ${#modules[@]} -eq 0 ]]; then modules=("${ALL_MODULES[@]}"); fi

command -v go >/dev/null || { echo "build-binaries: 'go' not found on PATH" >&2; exit 1; }
mkdir -p "$BIN_ROOT"


build_module() { # <module> <version> <out dir>
  local mod="$1" ver="$2" out="$3" dir
  dir="$(wrapper_dir "$mod")"
  cd "$dir"
  case "$mod" in
    kubernetes)
      local minor
      minor="$(echo "$ver" | cut -d. -f2)"
      local ldf=(
        -s -w
        -X "k8s.io/component-base/version.gitVersion=$ver"
        -X "k8s.io/component-base/version.gitMajor=1"
        -X "k8s.io/component-base/version.gitMinor=$minor"
        -X "k8s.io/component-base/version.gitTreeState=clean"
        -X "k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
        -X "k8s.io/client-go/pkg/version.gitVersion=$ver"
        -X "k8s.io/client-go/pkg/version.gitMajor=1"
        -X "k8s.io/client-go/pkg/version.gitMinor=$minor"
        -X "k8s.io/client-go/pkg/version.gitTreeState=clean"
        -X "k8s.io/client-go/pkg/version.buildDate=1970-01-01T00:00:00Z"
      )
      local pkgs=()
      for b in $(binaries kubernetes); do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
      # ONE go build for all six, so the shared packages compile once.
      go build -trimpath -ldflags "${ldf[*]}" -o "$out/" "${pkgs[@]}"
      ;;
    etcd)
      # etcd's version is a constant in go.etcd.io/etcd/api/v3/version; the module root is main.
      go build -trimpath -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ver" \
        -o "$out/etcd" go.etcd.io/etcd/server/v3
      ;;
    kwok)
      go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${ver#v}" \
        -o "$out/kwok" sigs.k8s.io/kwok/cmd/kwok
      ;;
    coredns)
      go build -trimpath -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$ver" \
        -o "$out/coredns" github.com/coredns/coredns
      ;;
    helm)
      local cg kmaj kmin
      cg="$(required_version go.mod k8s.io/client-go)"   # v0.37.0 -> Kubernetes 1.37
      kmaj=$(( $(echo "${cg#v}" | cut -d. -f1) + 1 ))
      kmin="$(echo "${cg#v}" | cut -d. -f2)"
      go build -trimpath -ldflags "-s -w \
        -X helm.sh/helm/v3/internal/version.version=$ver \
        -X helm.sh/helm/v3/internal/version.metadata= \
        -X helm.sh/helm/v3/internal/version.gitTreeState=clean \
        -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$kmaj \
        -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$kmin \
        -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$kmaj \
        -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kmin" \
        -o "$out/helm" helm.sh/helm/v3/cmd/helm
      ;;
    scheduler-plugins)
      # Built against the cluster's Kubernetes (the replace block), so it reports that version.
      local kver kminor
      kver="$(awk '$1 == "replace" && $2 == "k8s.io/kubernetes" {print $5; exit}' go.mod)"
      kminor="$(echo "$kver" | cut -d. -f2)"
      go build -trimpath -ldflags "-s -w \
        -X k8s.io/component-base/version.gitVersion=$kver \
        -X k8s.io/component-base/version.gitMajor=1 \
        -X k8s.io/component-base/version.gitMinor=$kminor" \
        -o "$out/" sigs.k8s.io/scheduler-plugins/cmd/scheduler sigs.k8s.io/scheduler-plugins/cmd/controller
      mv "$out/scheduler" "$out/scheduler-plugins-scheduler"
      mv "$out/controller" "$out/scheduler-plugins-controller"
      ;;
    kueue)
      go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$ver" \
        -o "$out/kueue" sigs.k8s.io/kueue/cmd/kueue
      ;;
    prometheus)
      # promtool only checks and tests rules here: leave out the cloud service-discovery plugins
      # (their SDKs are a fifth of the packages; Kubernetes SD stays, promtool imports it).
      go build -trimpath -tags remove_all_sd -ldflags "-s -w \
        -X github.com/prometheus/common/version.Version=${ver#v0.} \
        -X github.com/prometheus/common/version.Branch=release" \
        -o "$out/promtool" github.com/prometheus/prometheus/cmd/promtool
      ;;
    gitops-checks)
      go build -trimpath -ldflags "-s -w" -o "$out/gitops-checks" .
      ;;
    training-operator)
      go build -trimpath -ldflags "-s -w" -o "$out/training-operator" \
        github.com/kubeflow/training-operator/cmd/training-operator.v1
      ;;
  esac
}

status=0
start_all=$(date +%s)
for mod in "${modules[@]}"; do
  # Concurrent builders (two pytest sessions, `make test`'s late builder and a test waiting for one
  # program) serialise per module: a test that needs only this module waits for it, not for the rest.
  exec 9>"$BIN_ROOT/.build-$mod.lock"
  flock 9
  dir="$(wrapper_dir "$mod")"
  ver="$(required_version "$dir/go.mod" "$(module_path "$mod")")"
  if [[ -z "$ver" ]]; then echo "build-binaries: no version for $mod in $dir/go.mod" >&2; exit 1; fi
  target="$BIN_ROOT/$mod-$ver"
  missing=0
  for b in $(binaries "$mod"); do [[ -x "$target/$b" ]] || missing=1; done
  if [[ $missing -eq 0 ]]; then
    echo "build-binaries: $mod $ver cached in $target"
    exec 9>&-
    continue
  fi
  tmp="$BIN_ROOT/.tmp-$mod-$ver.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  echo "build-binaries: building $mod $ver ($(binaries "$mod")) -> $target"
  t0=$(date +%s)
  if (build_module "$mod" "$ver" "$tmp"); then
    t1=$(date +%s)
    rm -rf "$target"
    mv "$tmp" "$target"
    echo "build-binaries: built $mod $ver in $((t1 - t0)) s"
  else
    rc=$?
    t1=$(date +%s)
    rm -rf "$tmp"
    echo "build-binaries: FAILED $mod $ver after $((t1 - t0)) s (exit $rc)" >&2
    status=1
  fi
  exec 9>&-
done
echo "build-binaries: done in $(( $(date +%s) - start_all )) s (cache: $BIN_ROOT)"
exit $status
