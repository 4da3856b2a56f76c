"""A private containerd instance (own root, state, socket, config) for the real-node tier.

Never touches a system containerd: every path (root, state, gRPC/ttrpc sockets, runc root,
netns mounts, CNI conf dir, host-local IPAM data) lives under directories we pass in.
The only shared locations are containerd-shim-runc-v2's sockets in /run/containerd/s/<hash>
(hash of our socket path, so they never collide) and CNI's result cache in /var/lib/cni,
both cleaned for our instance on stop().
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import IO

from .host import HostProcess, pid_alive, read_pid, run, stop_pid, wait_for

NAMESPACE = "k8s.io"
PINNED_LABEL = "io.cri-containerd.pinned=pinned"


def archive_refs(tarball: Path) -> list[str]:
    """Image names in a docker-archive (manifest.json RepoTags) or OCI layout tarball
    (index.json ``io.containerd.image.name`` annotations). Reads only the small JSON files."""
    import tarfile

    refs: list[str] = []
    with tarfile.open(tarball) as tf:
        for member in tf:
            if member.name not in ("manifest.json", "index.json"):
                continue
            fh = tf.extractfile(member)
            assert fh is not None
            data = json.load(fh)
            if member.name == "manifest.json":
                refs += [t for m in data for t in m.get("RepoTags") or []]
            else:
                refs += [
                    m["annotations"]["io.containerd.image.name"]
                    for m in data.get("manifests", [])
                    if "io.containerd.image.name" in (m.get("annotations") or {})
                ]
    return refs


def remove_empty_default_dirs() -> None:
    """Empty dirs that ctr/shims create under the default state dir /run/containerd (never
    non-empty ones: those could belong to another containerd)."""
    for d in ("runc/k8s.io", "runc", "fifo", "s", ""):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join("/run/containerd", d))


def _toml_str(value: str | Path) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class Containerd:
    """containerd + runc (Debian packages) with everything private to ``root``/``state``."""

    def __init__(
        self,
        root: Path,
        state: Path,
        cni_conf_dir: Path,
        sandbox_image: str,
        log_dir: Path,
        *,
        inherit_fds: tuple[int, ...] = (),
        cni_bin_dir: Path = Path("/usr/lib/cni"),
    ) -> None:
        self.root = Path(root)
        self.state = Path(state)
        self.cni_conf_dir = Path(cni_conf_dir)
        self.cni_bin_dir = Path(cni_bin_dir)
        self.sandbox_image = sandbox_image
        self.log_dir = Path(log_dir)
        self.socket = self.state / "containerd.sock"
        self.config_path = self.state / "config.toml"
        self.runc_root = self.state / "runc"
        self.proc = HostProcess(
            "containerd", ["containerd", "--config", self.config_path], log_dir=self.log_dir, pid_dir=self.state
        )
        self._lock_fd: int | None = None
        self.inherit_fds = tuple(inherit_fds)

    # ------------------------------------------------------------------ config
    def config_toml(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2
root = {_toml_str(self.root)}
state = {_toml_str(self.state)}
oom_score = 0
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = {_toml_str(self.socket)}

[ttrpc]
  address = {_toml_str(str(self.socket) + ".ttrpc")}

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = {_toml_str(self.root / "opt")}

[{cri}]
  sandbox_image = {_toml_str(self.sandbox_image)}
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # Lowering oom_score_adj needs CAP_SYS_RESOURCE, which this host's bounding set lacks:
  # without this, every sandbox (kubelet asks for -998) fails in runc init with
  # "can't get final child's PID from pipe: EOF". Clamp to containerd's own score (0).
  restrict_oom_score_adj = true
  tolerate_missing_hugetlb_controller = true
  disable_hugetlb_controller = true
  max_container_log_line_size = 16384

  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = false

    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        Root = {_toml_str(self.runc_root)}
        SystemdCgroup = false

  [{cri}.cni]
    bin_dir = {_toml_str(self.cni_bin_dir)}
    conf_dir = {_toml_str(self.cni_conf_dir)}
    max_conf_num = 1

  [{cri}.registry]
    config_path = ""
"""

    # --------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 60.0) -> None:
        for d in (self.root, self.state, self.cni_conf_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        # A crashed earlier run on the same state dir may have left a containerd.
        stale = read_pid(self.proc.pid_path)
        if stale is not None and pid_alive(stale):
            stop_pid(stale)
        self._lock_root()
        self.cleanup_leftovers()
        self.config_path.write_text(self.config_toml())
        self.socket.unlink(missing_ok=True)
        # containerd inherits the lock: the root stays locked for as long as it runs, even if
        # this Python process exits first (CLI `up`) or crashes.
        assert self._lock_fd is not None
        self.proc.start(pass_fds=(self._lock_fd, *self.inherit_fds))

        def ready() -> bool:
            self.proc.check_alive()
            return self._ready()

        wait_for(ready, timeout, what=f"containerd socket {self.socket}")

    def _ready(self) -> bool:
        if not self.socket.exists():
            return False
        return self.ctr("version", check=False).returncode == 0

    def _lock_root(self) -> None:
        """Serialise users of one (cached, persistent) containerd root."""
        lock_path = self.root.parent / (self.root.name + ".lock")
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            holders = self._root_users()
            raise RuntimeError(
                f"containerd root {self.root} is in use (lock {lock_path}; containerd PIDs "
                f"{holders or '?'}): another test run, or one that crashed (then run "
                "`python -m tests.cluster.node.realnode down --state-dir <its cluster dir>` or stop "
                "those PIDs); or set PHALANX_CACHE_DIR to a different directory"
            ) from exc
        self._lock_fd = fd

    def _root_users(self) -> list[int]:
        """PIDs of containerd processes whose config uses our root."""
        pids = []
        needle = f"root = {_toml_str(self.root)}"
        for proc_dir in Path("/proc").iterdir():
            try:
                argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
                if not argv[0].endswith(b"containerd") or b"--config" not in argv:
                    continue
                cfg = Path(argv[argv.index(b"--config") + 1].decode())
                if needle in cfg.read_text():
                    pids.append(int(proc_dir.name))
            except (OSError, IndexError, ValueError):
                continue
        return pids

    def _unlock_root(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def stop(self) -> None:
        """Remove all containers/sandboxes, stop containerd and its shims, unmount leftovers."""
        try:
            if self.proc.alive() and self.socket.exists():
                self.remove_all_containers()
        except Exception:
            pass
        self.proc.stop(timeout=20)
        self.cleanup_leftovers()
        self.socket.unlink(missing_ok=True)
        Path(str(self.socket) + ".ttrpc").unlink(missing_ok=True)
        remove_empty_default_dirs()
        self._unlock_root()

    # ------------------------------------------------------------------- ctr
    def ctr(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float | None = 120
    ) -> subprocess.CompletedProcess[str]:
        return run(
            ["ctr", "--address", self.socket, "--namespace", NAMESPACE, *args],
            check=check,
            input=input,
            timeout=timeout,
        )

    def images(self) -> dict[str, str]:
        """{ref: target digest} of images in the k8s.io namespace."""
        out = self.ctr("images", "ls").stdout.splitlines()[1:]
        result = {}
        for line in out:
            parts = line.split()
            if len(parts) >= 3:
                result[parts[0]] = parts[2]
        return result

    def import_image(self, tarball: Path, labels: dict[str, str] | None = None, timeout: float = 1800) -> float:
        """``ctr images import`` of an archive file; see :meth:`import_stream`."""
        t0 = time.monotonic()
        with tarball.open("rb") as stream:
            self.import_stream(stream, archive_refs(tarball), labels=labels, timeout=timeout)
        return time.monotonic() - t0

    def import_stream(
        self, stream: IO[bytes] | None, refs: list[str], labels: dict[str, str] | None = None, timeout: float = 1800
    ) -> None:
        """``ctr images import -`` (unpacked for overlayfs) from a tar stream, then label every
        ref with the CRI pinned label and ``labels`` (ctr 1.6's import has no --label)."""
        proc = subprocess.run(
            ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, "images", "import",
             "--snapshotter", "overlayfs", "-"],
            stdin=stream, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"ctr images import failed ({proc.returncode}): {proc.stderr}")
        all_labels = {"io.cri-containerd.pinned": "pinned", **(labels or {})}
        for ref in refs:
            self.ctr("images", "label", ref, *[f"{k}={v}" for k, v in all_labels.items()])

    def content_digests(self) -> set[str]:
        """Digests of the blobs in the content store."""
        lines = self.ctr("content", "ls", "-q").stdout.splitlines()
        return {line.strip() for line in lines if line.strip()}

    def image_labels(self, ref: str) -> dict[str, str] | None:
        """Labels of image ``ref``, or None if it is not present."""
        proc = self.ctr("images", "ls", f"name=={ref}", check=False)
        lines = proc.stdout.splitlines()[1:]
        if proc.returncode != 0 or not lines:
            return None
        last = lines[0].split()[-1]
        if last == "-":
            return {}
        return dict(kv.split("=", 1) for kv in last.split(",") if "=" in kv)

    def ensure_image(self, tarball: Path, key: str) -> float | None:
        """Import an archive unless all its refs are present with label phalanx.dev/key=key.
        Returns the import time, or None when nothing had to be imported."""
        refs = archive_refs(tarball)
        if refs and all((self.image_labels(r) or {}).get("phalanx.dev/key") == key for r in refs):
            return None
        return self.import_image(tarball, labels={"phalanx.dev/key": key})

    def remove_all_containers(self) -> None:
        tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
        for t in tasks:
            self.ctr("tasks", "kill", "--signal", "SIGKILL", t, check=False)
        deadline = time.monotonic() + 10
        while tasks and time.monotonic() < deadline:
            time.sleep(0.3)
            tasks = list(self.ctr("tasks", "ls", "-q", check=False).stdout.split())
            for t in tasks:
                self.ctr("tasks", "delete", "--force", t, check=False)
        for c in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.ctr("containers", "delete", c, check=False)

    # ---------------------------------------------------------- hard clean-up
    def shim_pids(self) -> list[int]:
        """containerd-shim-runc-v2 processes that belong to this instance."""
        pids = []
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            try:
                argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if not argv or not argv[0].endswith(b"containerd-shim-runc-v2"):
                continue
            if str(self.socket).encode() in argv:
                pids.append(int(proc_dir.name))
        return pids

    def cleanup_leftovers(self) -> None:
        for pid in self.shim_pids():
            stop_pid(pid, timeout=5, group=False)
        # Kill whatever still runs in containers' cgroups? runc state tells us the init pids.
        if self.runc_root.exists():
            for st in self.runc_root.glob("*/*/state.json"):
                init_pid: int | None
                try:
                    init_pid = json.loads(st.read_text()).get("init_process_pid")
                except (OSError, ValueError):
                    init_pid = None
                if init_pid and pid_alive(init_pid):
                    stop_pid(init_pid, timeout=2, group=False)
        self.unmount_under(self.root)
        self.unmount_under(self.state)
        # Per-run state (not the image cache in root): remove it wholesale.
        for sub in ("io.containerd.runtime.v2.task", "io.containerd.grpc.v1.cri", "netns", "runc"):
            shutil.rmtree(self.state / sub, ignore_errors=True)
        # CRI's per-sandbox/per-container files live under root; containers themselves
        # were deleted from the metadata store by remove_all_containers().
        for sub in ("sandboxes", "containers"):
            shutil.rmtree(self.root / "io.containerd.grpc.v1.cri" / sub, ignore_errors=True)

    @staticmethod
    def unmount_under(prefix: Path) -> None:
        prefix_s = str(Path(prefix).resolve())
        for _ in range(3):
            mounts = []
            with open("/proc/self/mountinfo") as fh:
                for line in fh:
                    mp = line.split()[4].encode().decode("unicode_escape")
                    if mp == prefix_s or mp.startswith(prefix_s + "/"):
                        mounts.append(mp)
            if not mounts:
                return
            for mp in sorted(mounts, key=len, reverse=True):
                run(["umount", "-l", mp], check=False)

    @staticmethod
    def remove_recorded_dir(record: Path) -> None:
        """Unmount and remove the directory whose path ``record`` holds (a run directory an
        earlier process left behind), then the record itself."""
        if not record.exists():
            return
        old = Path(record.read_text().strip())
        Containerd.unmount_under(old)
        shutil.rmtree(old, ignore_errors=True)
        record.unlink(missing_ok=True)

    def remove_stale_image_ids(self) -> list[str]:
        """Remove ``sha256:<image id>`` references (CRI adds them for images it has seen) whose
        image no longer has a name here: they would keep replaced images' GBs in the store."""
        refs = self.images()
        named = {digest for ref, digest in refs.items() if not ref.startswith("sha256:")}
        stale = [ref for ref, digest in refs.items() if ref.startswith("sha256:") and digest not in named]
        if stale:
            self.ctr("images", "rm", "--sync", *stale, timeout=600)
        return stale
