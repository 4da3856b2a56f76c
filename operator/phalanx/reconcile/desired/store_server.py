import json, os, re, signal, sys, threading, time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from torch.distributed import TCPStore
port = int(os.environ["PHALANX_RENDEZVOUS_PORT"])
key = os.environ["PHALANX_COMPLETION_KEY"]
progress_key = os.environ.get("PHALANX_PROGRESS_KEY")
job = os.environ["PHALANX_JOB_UID"]
step_key = os.environ.get("PHALANX_STEP_TIME_KEY")
try:
    step_ranks = max(0, min(int(os.environ.get("PHALANX_STEP_TIME_RANKS", "0")), STEP_MAX_RANKS))
except ValueError:
    step_ranks = 0
NAME, HOST = re.compile(NAME), re.compile(HOST)
store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                 multi_tenant=True, timeout=timedelta(hours=1))
lock = threading.Lock()
def record(name, limit=MAX_BYTES):
    if not name or not store.check([name]):
        return {}
    raw = store.get(name)
    try:
        done = json.loads(raw) if len(raw) <= limit else None
    except Exception:  # malformed or nested past the recursion limit
        done = None
    return done if isinstance(done, dict) and done.get("job") == job else {}
def count(value):
    return value if type(value) is int and 0 <= value < 2**53 else None
def moment(value):
    ok = type(value) in (int, float) and 946684800 <= value <= 7258118400
    return float(value) if ok else None
def number(value):
    return float(value) if type(value) in (int, float) and -1e300 <= value <= 1e300 else None
def progress_lines(report):
    attempt, step, at = count(report.get("attempt")), count(report.get("step")), moment(report.get("time"))
    total, metrics = report.get("totalSteps"), report.get("metrics", {})
    if None in (attempt, step, at) or (total is not None and count(total) is None):
        return []
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        return []
    label = f'job="{job}"'
    lines = [f"phalanx_training_progress_attempt{{{label}}} {attempt}",
             f"phalanx_training_progress_step{{{label}}} {step}",
             f"phalanx_training_progress_timestamp_seconds{{{label}}} {at!r}"]
    if total is not None:
        lines.append(f"phalanx_training_progress_total_steps{{{label}}} {total}")
    for name, metric in sorted(metrics.items()):
        if not NAME.fullmatch(name) or not isinstance(metric, dict):
            return []
        value, when, seen = number(metric.get("value")), count(metric.get("step")), moment(metric.get("time"))
        if None in (value, when, seen):
            return []
        named = f'{label},name="{name}"'
        lines += [f"phalanx_training_progress_metric{{{named}}} {value!r}",
                  f"phalanx_training_progress_metric_step{{{named}}} {when}",
                  f"phalanx_training_progress_metric_timestamp_seconds{{{named}}} {seen!r}"]
    return lines
def step_lines(reports):
    lines = []
    for rank, report in enumerate(reports):
        attempt, step, host = count(report.get("attempt")), count(report.get("step")), report.get("host")
        seconds = report.get("seconds")
        if None in (attempt, step) or report.get("rank") != rank or type(rank) is not int:
            continue
        if type(host) is not str or not HOST.fullmatch(host):
            continue
        if type(seconds) not in (int, float) or not 0 < seconds <= MAX_STEP_SECONDS:
            continue
        label = f'job="{job}",attempt="{attempt}",rank="{rank}",host="{host}"'
        lines += [f"phalanx_training_rank_step_seconds{{{label}}} {float(seconds)!r}",
                  f"phalanx_training_rank_step{{{label}}} {step}"]
    return lines
class Status(BaseHTTPRequestHandler):
    def do_GET(self):
        lines = []
        with lock:
            done, report = record(key), record(progress_key)
            steps = [record(f"{step_key}{rank}", STEP_MAX_BYTES) for rank in range(step_ranks if step_key else 0)]
        for field in ("attempt", "step", "rank"):
            value = done.get(field)
            if isinstance(value, int) and not isinstance(value, bool):
                lines.append(f'phalanx_training_completed_{field}{{job="{job}"}} {value}')
        lines += progress_lines(report)
        lines += step_lines(steps)
        body = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = ThreadingHTTPServer(("", int(os.environ["PHALANX_STORE_METRICS_PORT"])), Status)
threading.Thread(target=server.serve_forever, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print(f"phalanx rendezvous store listening on port {port}", flush=True)
while True:
    time.sleep(3600)
