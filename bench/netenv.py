"""Shared pieces of the transport benchmarks (bench/reload.py, bench/fanout.py): two emulated
regions on one machine, the S3 server and relays placed in them, receiver processes, the
measurements and the pipeline model that extrapolates from them.

Regions. The *trainer region* is a network namespace joined to this one (the *rollout region*)
by a veth pair; the "cross-region" link is shaped with ``tc qdisc ... tbf`` on both ends of the
pair (this kernel has tbf and htb, not netem: bandwidth only; the round trip is what the veth
gives, measured and reported). Inside the rollout region traffic stays on loopback (the fast
intra-cluster links). Every byte a receiver reads from the trainer region crosses the shaped
link, and the bytes that crossed it are read from the veth's counters. The namespace and the
veth pair are removed on exit (``close``, ``atexit``, and a stale one from a killed run is
removed by name before a new one is made).

Where namespaces cannot be made (not root, no ``ip``/``tc``, a container without
CAP_NET_ADMIN) or ``shaping="proxy"`` is asked for, the trainer region's services listen on
127.0.0.1 and are reached through an in-process rate limiter: a TCP proxy whose connections share
one token bucket at the link rate (it also counts the bytes). Results say which was used
(``Region.kind``).

Nothing here talks to anything but these namespaces and loopback.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from nemo_dcr.stores import S3Store  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402

# the dense checkpoint, at a key of the store's own layout that no version uses: a relay forwards
# nothing else upstream (the dense reload "via relay" goes through the same relay as the deltas)
RAW_KEY = "versions/999999999999/dense/part-00000.dcr"
BUCKET = "nemo-dcr-bench"
TARGETS = {"delta_over_floor": 1.25, "fanout_over_one": 1.25, "keyframe_over_raw": 1.0}
# the published systems' figures, for the table printed next to the extrapolation (seconds)
PAPER = [
    {"source": "paper", "model": "120B", "what": "delta reload (range)", "seconds": (22.6, 49.7)},
    {"source": "paper", "model": "120B", "what": "dense reload", "seconds": 750.0},
    {"source": "paper", "model": "1T", "change": 0.03, "what": "delta via relay tree", "seconds": 150.0},
    {"source": "paper", "model": "1T", "what": "dense reload", "seconds": 87.5 * 60},
    {"source": "NeMo-RL", "model": "247 GB", "change": 0.03, "what": "over S3", "seconds": 20.2},
    {"source": "NeMo-RL", "model": "247 GB", "change": 0.05, "what": "over S3", "seconds": 25.8},
    {"source": "NeMo-RL", "model": "247 GB", "change": 0.03, "what": "over ZeroMQ relay tree", "seconds": 24.1},
    {"source": "NeMo-RL", "model": "247 GB", "change": 0.05, "what": "over ZeroMQ relay tree", "seconds": 33.8},
]


# ----------------------------------------------------------------------------- model
def model(elements: int, seed: int = 0) -> dict:
    """A BF16 state of about ``elements`` elements: sixteen square-ish matrices and one vector
    (at the publisher's default part sizes a keyframe is several objects from ~20M elements on,
    a delta from ~130M on)."""
    g = torch.Generator().manual_seed(seed)
    n_mat = 16
    side = max(8, int((elements / (n_mat + 0.02)) ** 0.5))
    out = {f"layers.{i}.weight": (torch.randn(side, side, generator=g) * 0.02).bfloat16() for i in range(n_mat)}
    out["norm.weight"] = torch.ones(max(1, elements - n_mat * side * side), dtype=torch.bfloat16)
    return out


def changed(state: dict, rate: float, seed: int = 1) -> dict:
    """``rate`` of every tensor's elements nudged by an optimizer-step-like relative amount.
    INJECTED changes (random positions, not an optimizer's): results label them so."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        v = v.clone()
        flat = v.view(-1)
        n = max(1, int(flat.numel() * rate))
        idx = torch.randperm(flat.numel(), generator=g)[:n]
        x = flat[idx].float()
        y = (x + x.abs().clamp_min(1e-3) * 0.02 * torch.randn(n, generator=g)).bfloat16()
        flat[idx] = torch.where(y == flat[idx], (flat[idx].view(torch.int16) ^ 1).view(torch.bfloat16), y)
        out[k] = v
    return out


def raw_bytes(state: dict) -> bytes:
    return b"".join(v.contiguous().view(torch.uint8).numpy().tobytes() for v in state.values())


def nbytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def memcpy_seconds(state: dict, reps: int = 3) -> float:
    """One copy of the receiver's tensors (best of ``reps``): the floor's compute term."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        best = min(best, time.perf_counter() - t)
    return best


def same_bits(a: dict, b: dict, what: str) -> None:
    for k, v in b.items():
        if not torch.equal(a[k].view(torch.int16), v.view(torch.int16)):
            raise AssertionError(f"{what}: {k} is not bit-exact")


# ----------------------------------------------------------------------------- processes
def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


class Proc:
    """A child process that prints one line starting with ``ready_prefix`` once it serves; the
    rest of that line is kept as ``self.ready``. Stopped with SIGTERM, then SIGKILL.

    Its output is read by a thread from the start, line by line (``readline``): a child that
    goes on logging after its ready line (a relay's warnings) would otherwise fill the pipe and
    block on its next write, mid-measurement. The last lines stay in ``tail`` for errors."""

    def __init__(self, cmd: list, ready_prefix: str, env: dict | None = None, stdin=None):
        self.ready_prefix = ready_prefix
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=stdin,
                                     text=True, env=child_env(env))
        self.ready = None
        self.tail: collections.deque = collections.deque(maxlen=200)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        _LIVE.add(self)

    def _pump(self) -> None:
        try:
            for line in self.proc.stdout:
                self.tail.append(line)
                self._lines.put(line)
        except (OSError, ValueError) as e:  # (undecodable output, a pipe closed under us)
            self.tail.append(f"[output unreadable: {e}]\n")
        finally:
            self._lines.put("")  # end of output, as readline's

    def readline(self, timeout: float | None = None) -> str:
        """The child's next output line; "" once its output ended (or after ``timeout`` s)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return ""
        if not line:
            self._lines.put("")  # (every later call sees the end too)
        return line

    def wait_ready(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            line = self.readline(left)
            if not line:
                break
            if line.startswith(self.ready_prefix):
                self.ready = line[len(self.ready_prefix):].strip()
                return self.ready
        self.stop()
        raise RuntimeError(f"{self.ready_prefix!r} never came within {timeout:g} s: " + "".join(self.tail)[-2000:])

    def stop(self) -> None:
        _LIVE.discard(self)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


_LIVE: set = set()


def relay(upstream: str, listen: str, prefix: list | None = None, env: dict | None = None) -> Proc:
    """``python -m nemo_dcr relay`` (started, not yet ready: call ``wait_ready`` -> its URL)."""
    cmd = (prefix or []) + [sys.executable, "-m", "nemo_dcr", "relay", "--listen", listen, "--upstream", upstream,
                            "--poll-interval", "0.05"]
    return Proc(cmd, "nemo-dcr relay: serving", env)


def relay_url(p: Proc) -> str:
    return p.ready.rsplit(" at ", 1)[1].strip()


def relay_tree(upstream: str, receivers: int, fanout: int, env: dict | None = None) -> tuple[list, list]:
    """Relays in the rollout region, fan-out ``fanout``, enough levels for ``receivers`` leaves:
    -> (relay processes, the URL each receiver reads from). The root's upstream is ``upstream``."""
    levels = max(1, math.ceil(math.log(max(receivers, 1), fanout) - 1e-9))
    procs, parents = [], [upstream]
    for depth in range(levels):
        started = [relay(parents[i // fanout] if depth else upstream, "127.0.0.1:0", env=env)
                   for i in range(fanout ** depth)]
        for p in started:  # start a whole level, then wait: they import in parallel
            p.wait_ready()
        procs += started
        parents = [relay_url(p) for p in started]
    return procs, [parents[i % len(parents)] for i in range(receivers)]


def stop_all(procs) -> None:
    for p in reversed(list(procs)):
        p.stop()


def s3_server(prefix: list | None, host: str) -> Proc:
    """The moto S3 server of the tests (tests/dcr_testing/s3.py) in its own process on ``host``
    (inside the trainer region when ``prefix`` is its ``ip netns exec``)."""
    return Proc((prefix or []) + [sys.executable, os.path.abspath(__file__), "s3", "--host", host],
                "s3 endpoint ", stdin=subprocess.PIPE)


def _serve_s3(host: str) -> None:
    from dcr_testing.s3 import moto_server
    with moto_server(host) as m:
        import boto3
        boto3.session.Session().client("s3", endpoint_url=m.endpoint_url, region_name="us-east-1") \
            .create_bucket(Bucket=BUCKET)
        print(f"s3 endpoint {m.endpoint_url}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin or ends us


def s3_env(endpoint: str) -> dict:
    from dcr_testing.s3 import DUMMY_AWS_ENV
    return {**DUMMY_AWS_ENV, "NEMO_DCR_S3_ENDPOINT": endpoint}


def s3_store(endpoint: str, prefix: str, **kw) -> S3Store:
    os.environ.update(s3_env(endpoint))
    return S3Store(BUCKET, prefix, endpoint_url=endpoint, **kw)


# ----------------------------------------------------------------------------- regions
class _Bucket:
    """One link's token bucket shared by every connection through it (a virtual clock: each
    write waits until the link would have sent the bytes before it)."""

    def __init__(self):
        self.bps, self.t, self.lock = None, 0.0, threading.Lock()

    def take(self, n: int) -> None:
        if not self.bps:
            return
        with self.lock:
            now = time.monotonic()
            self.t = max(now, self.t) + n * 8 / self.bps
            wait = self.t - now
        if wait > 0:
            time.sleep(wait)


class _Proxy:
    """127.0.0.1:port -> target, both directions paced by ``bucket`` and held back ``delay``
    seconds each (half the round trip added: propagation delay, in user space since this kernel's
    tc has no netem); counts bytes toward us."""

    def __init__(self, target: tuple, up: _Bucket, down: _Bucket, counter: list, delay: float = 0.0):
        self.target, self.up, self.down, self.counter, self.delay = target, up, down, counter, delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="bench-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(self.target)
            except OSError:
                c.close()
                continue
            for a in (c, s):
                a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(c, s, self.up, None, self.delay), daemon=True).start()
            threading.Thread(target=self._pump, args=(s, c, self.down, self.counter, self.delay), daemon=True).start()

    @staticmethod
    def _pump(src, dst, bucket, counter, delay: float = 0.0) -> None:
        # with a delay, what arrives is queued with the time it may leave, and a sender thread
        # sends it then: the link's rate is kept (the pacing is on arrival), each byte is late
        # by ``delay``
        late: queue.SimpleQueue | None = queue.SimpleQueue() if delay > 0 else None

        def send_late():
            while True:
                due, data = late.get()
                if data is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    dst.sendall(data)
                except OSError:
                    break
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send_late, daemon=True) if late is not None else None
        if sender is not None:
            sender.start()
        try:
            while True:
                data = src.recv(64 * 1024)
                if not data:
                    break
                bucket.take(len(data))
                if counter is not None:  # before it is passed on: a reader that has it sees it counted
                    counter[0] += len(data)
                if late is not None:
                    late.put((time.monotonic() + delay, data))
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            if late is not None:
                late.put((0.0, None))  # the sender shuts dst's write side once the rest is out
            for s, how in (((dst, socket.SHUT_WR),) if late is None else ()) + ((src, socket.SHUT_RD),):
                try:
                    s.shutdown(how)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def delaying_proxy(host: str, port: int, delay: float) -> Proc:
    """A proxy process (``netenv.py proxy``) on 127.0.0.1 forwarding to ``host:port``, each
    direction's bytes held back ``delay`` seconds, unpaced; ready: ``.ready`` is its port."""
    p = Proc([sys.executable, os.path.abspath(__file__), "proxy", "--target", f"{host}:{port}",
              "--delay", repr(delay)], "proxy port ", stdin=subprocess.PIPE)
    p.wait_ready()
    return p


class Region:
    """The trainer region: ``prefix`` runs a command inside it, services listen on ``host``,
    and ``reach(url)`` is how the rollout region reaches one. ``shape(mbit)`` sets the link's
    rate (None: unshaped, e.g. while publishing inside the trainer region), ``slow_bytes()``
    the bytes that crossed the link toward the rollout region so far."""

    def __init__(self, shaping: str = "auto", rtt: float = 0.0):
        self.kind, self.note, self.mbit, self._link = None, None, None, None
        self.rtt = max(0.0, float(rtt))  # seconds added to every round trip across the link
        self._proxies: list = []
        if shaping in ("auto", "netns"):
            try:
                self._link = _Veth()
                self.kind = "netns+veth, tc tbf"
            except RuntimeError as e:
                if shaping == "netns":
                    raise
                self.note = f"network namespaces unavailable ({e}); in-process rate limiter used instead"
        if self._link is None:
            self.kind = "in-process rate limiter (TCP proxy on loopback)"
        self._up, self._down, self._count = _Bucket(), _Bucket(), [0]  # (the proxies' pacing: no veth)
        if self.rtt:
            self.kind += f", +{self.rtt * 1e3:g} ms round trip (user-space delaying proxy)"
        atexit.register(self.close)

    @property
    def host(self) -> str:
        return self._link.far_ip if self._link else "127.0.0.1"

    @property
    def prefix(self) -> list:
        return ["ip", "netns", "exec", self._link.ns] if self._link else []

    def reach(self, url: str) -> str:
        """``http://host:port/...`` of a trainer-region service -> the URL the rollout region uses
        (through a proxy in the rollout region where the link is emulated in user space: its rate
        without namespaces, its added round trip with ``rtt``)."""
        if self._link and not self.rtt:
            return url
        head, rest = url.split("://", 1)
        hostport, _, path = rest.partition("/")
        host, port = hostport.rsplit(":", 1)
        if self._link:
            # the added round trip alone (tc paces the link): a proxy process of its own, as the
            # S3 server and the relays are, so that this process's CPU is the receiver's alone
            # and its pumping threads take no GIL from the receiver being measured. In this
            # process they added 3 ms of its CPU to a 1 % delta sync and 5-15 ms to a 3 % one
            # (45M BF16, 1 Gbit/s, two alternated pairs); the wall times did not move beyond
            # their noise (docs/results.md, "A delaying proxy of its own")
            p = delaying_proxy(host, int(port), self.rtt / 2)
            self._proxies.append(p)
            local = int(p.ready)
        else:  # the in-process rate limiter: its buckets and byte count are this process's
            p = _Proxy((host, int(port)), self._up, self._down, self._count, self.rtt / 2)
            self._proxies.append(p)
            local = p.port
        return f"{head}://127.0.0.1:{local}" + (f"/{path}" if path else "")

    def shape(self, mbit: float | None) -> None:
        self.mbit = mbit
        if self._link:
            self._link.shape(mbit)
        else:
            self._up.bps = self._down.bps = mbit * 1e6 if mbit else None

    def slow_bytes(self) -> int:
        return self._link.rx_bytes() if self._link else self._count[0]

    def close(self) -> None:
        if self._link:
            self._link.close()
            self._link = None
        for p in self._proxies:
            p.stop() if isinstance(p, Proc) else p.close()
        self._proxies = []


class _Veth:
    NS, HERE_IF, THERE_IF = "dcrbench", "dcrb-near", "dcrb-far"
    NEAR, FAR = "10.213.7.1", "10.213.7.2"

    def __init__(self):
        if os.geteuid() != 0:
            raise RuntimeError("not root")
        if not (shutil.which("ip") and shutil.which("tc")):
            raise RuntimeError("no ip/tc")
        self.ns, self.far_ip = self.NS, self.FAR
        self.close()  # a stale pair from a killed run
        try:
            for c in (f"ip netns add {self.NS}",
                      f"ip link add {self.HERE_IF} type veth peer name {self.THERE_IF}",
                      f"ip link set {self.THERE_IF} netns {self.NS}",
                      f"ip addr add {self.NEAR}/24 dev {self.HERE_IF}", f"ip link set {self.HERE_IF} up",
                      f"ip -n {self.NS} addr add {self.FAR}/24 dev {self.THERE_IF}",
                      f"ip -n {self.NS} link set {self.THERE_IF} up", f"ip -n {self.NS} link set lo up"):
                _sh(c)
        except RuntimeError:
            self.close()
            raise

    def shape(self, mbit: float | None) -> None:
        for dev, n in ((self.HERE_IF, ""), (self.THERE_IF, f"-n {self.NS} ")):
            if mbit:
                burst = max(64 * 1024, int(mbit * 1e6 / 8 / 250))  # ~4 ms of the rate
                _sh(f"tc {n}qdisc replace dev {dev} root tbf rate {mbit}mbit burst {burst} latency 200ms")
            else:
                subprocess.run(f"tc {n}qdisc del dev {dev} root".split(), capture_output=True)

    def rx_bytes(self) -> int:
        with open(f"/sys/class/net/{self.HERE_IF}/statistics/rx_bytes") as f:
            return int(f.read())

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.HERE_IF], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.NS], capture_output=True)


def _sh(cmd: str) -> None:
    try:
        subprocess.run(cmd.split(), check=True, capture_output=True, text=True)
    except (subprocess.CalledProcessError, OSError) as e:
        raise RuntimeError(f"{cmd}: {(getattr(e, 'stderr', '') or str(e)).strip()}") from None


@atexit.register
def _stop_children() -> None:
    stop_all(list(_LIVE))


# ----------------------------------------------------------------------------- measurements
def rtt(store, key: str, n: int = 5) -> float:
    """Median of ``n`` small requests (a HEAD / size) to ``store``: one round trip."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        store.size(key)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def dense_reload(store, tensors: dict) -> float:
    """Stream the raw checkpoint into the receiver's tensors as the bytes arrive."""
    t = time.perf_counter()
    size, chunks = store.get_stream(RAW_KEY)
    flat = [v.view(-1).view(torch.uint8) for v in tensors.values()]
    i, off = 0, 0
    for b in chunks:
        mv = memoryview(b)
        while len(mv):
            dst = flat[i]
            n = min(len(mv), dst.numel() - off)
            with warnings.catch_warnings():  # read-only bytes, only read from
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(mv[:n], dtype=torch.uint8)
            dst[off:off + n].copy_(src)
            mv, off = mv[n:], off + n
            if off == dst.numel():
                i, off = i + 1, 0
    return time.perf_counter() - t


def stage_sums(spans) -> dict:
    out: dict = {}
    for s in spans:
        out[s.stage] = out.get(s.stage, 0.0) + s.seconds
    return {k: round(v, 5) for k, v in out.items()}


def busy(spans, stage: str) -> float:
    """Seconds during which at least one ``stage`` span was open (overlaps counted once)."""
    iv = sorted((s.start, s.end) for s in spans if s.stage == stage)
    total, cur = 0.0, None
    for a, b in iv:
        if cur is None or a > cur[1]:
            if cur:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur else 0.0)


def delta_reload(store, held: dict, version: int = 0, stream: bool = True, speculate: bool = True) -> dict:
    """``Follower.sync`` from ``version`` (``held``, not re-verified) to the newest: -> its
    figures and the receiver's tensors (checked by the caller). ``speculate``: the follower's
    reads of the next version's parts beside its HEAD read (``sync/speculate.py``)."""
    tensors = {k: v.clone() for k, v in held.items()}
    f = Follower(store, tensors, version=version, verify_initial=False, stream=stream, speculate=speculate)
    # this process's CPU is the receiver's: the S3 server and relays are processes of their own
    # (with the in-process rate limiter, its threads count here too)
    cpu = time.process_time()
    r = f.sync()
    cpu = time.process_time() - cpu
    return {"seconds": r.seconds, "cpu": cpu, "bytes": r.bytes, "version": r.version, "changed": r.changed,
            "speculated": r.speculated,
            "stages": stage_sums(r.spans), "fetch_busy": busy(r.spans, "fetch"),
            "spans": [(s.stage, s.what, round(s.start, 5), round(s.end, 5)) for s in r.spans], "tensors": tensors}


def timeline(spans: list, width: int = 60) -> str:
    """An ASCII timeline: one row per stage, '#' where a span of it was open."""
    if not spans:
        return ""
    end = max(s[3] for s in spans) or 1e-9
    rows = []
    for stage in dict.fromkeys(s[0] for s in spans):
        line = [" "] * width
        for st, _, a, b in spans:
            if st == stage:
                for i in range(int(a / end * (width - 1)), int(b / end * (width - 1)) + 1):
                    line[i] = "#"
        rows.append(f"  {stage:>7} |{''.join(line)}|")
    rows.append(f"  {'':>7}  0{'':{width - 10}}{end * 1e3:8.1f} ms")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- receivers
def receiver_main(elements: int, endpoint: str | None) -> None:
    """A receiver process, reused across runs (torch imported and the model built once): per
    line on stdin (a store URL) open that store and say "prepared"; on the next line sync a
    fresh copy of version 0 to the newest version and print the figures as JSON. The next copy
    is made before the answer, outside the timed window."""
    if endpoint:
        os.environ.update(s3_env(endpoint))
    from nemo_dcr.stores import open_store
    v0 = model(elements)
    tensors = {k: v.clone() for k, v in v0.items()}
    print("ready", flush=True)
    for url in sys.stdin:  # prepare (open the store, read version 0's manifest), then sync on "go"
        try:
            f = Follower(open_store(url.strip()), tensors, version=0, verify_initial=False, stream=True)
            print("prepared", flush=True)
            sys.stdin.readline()
            t = time.time()
            r = f.sync()
            out = {"start": t, "end": time.time(), "seconds": r.seconds, "bytes": r.bytes, "version": r.version}
        except Exception as e:  # reported to the parent, which fails the run
            out = {"error": f"{type(e).__name__}: {e}"}
        tensors = {k: v.clone() for k, v in v0.items()}
        print(json.dumps(out), flush=True)


class Receivers:
    """``n`` receiver processes holding version 0 of an ``elements`` model, started (torch
    imported, model built) before any clock starts."""

    def __init__(self, n: int, elements: int, endpoint: str | None = None):
        self.procs = [Proc([sys.executable, os.path.abspath(__file__), "receiver", "--elements", str(elements)]
                           + (["--endpoint", endpoint] if endpoint else []), "ready", stdin=subprocess.PIPE)
                      for _ in range(n)]
        for p in self.procs:
            p.wait_ready()

    def sync(self, urls: list) -> dict:
        """The first len(urls) receivers sync at once, each from its URL -> time until the last
        one finished (from the moment the first was told)."""
        procs = self.procs[:len(urls)]
        for p, u in zip(procs, urls):
            p.proc.stdin.write(u + "\n")
            p.proc.stdin.flush()
        for p in procs:
            line = p.readline()
            if line.strip() != "prepared":
                raise RuntimeError(f"a receiver could not open its store: {line}")
        go = time.time()
        for p in procs:
            p.proc.stdin.write("go\n")
            p.proc.stdin.flush()
        outs = []
        for p in procs:
            line = p.readline()
            o = json.loads(line) if line.startswith("{") else {"error": "".join(p.tail)[-2000:]}
            if "error" in o or o["version"] != 1:
                raise RuntimeError(f"a receiver did not reach version 1: {o}")
            outs.append(o)
        return {"receivers": len(urls), "to_last": max(o["end"] for o in outs) - go,
                "each": sorted(round(o["seconds"], 4) for o in outs)}

    def close(self) -> None:
        stop_all(self.procs)


def with_s3_in_trainer_region(shaping: str, measure, rtt: float = 0.0) -> tuple:
    """Make the regions (``rtt`` seconds added to each round trip across the link), start the S3
    server in the trainer region, run ``measure(region, endpoint)`` (endpoint: how the rollout
    region reaches the server) and tear everything down -> (its result, a description of the link
    emulation, a note or None)."""
    region = Region(shaping, rtt)
    s3 = None
    try:
        s3 = s3_server(region.prefix, region.host)
        return measure(region, region.reach(s3.wait_ready())), region.kind, region.note
    finally:
        if s3 is not None:
            s3.stop()
        region.close()


def parser(doc: str):
    """An argument parser with the options both benchmarks take."""
    import argparse
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small, in-process limiter, under a minute")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shaping", choices=("auto", "netns", "proxy"), default=None,
                    help="netns+veth+tbf (root), the in-process limiter, or auto (netns where possible); "
                         "default: auto, --quick: proxy")
    ap.add_argument("--workers", type=int, default=8, help="receiver workers assumed by the extrapolation")
    ap.add_argument("--rtt-ms", type=float, default=0.0,
                    help="round trip added across the link, in user space (a delaying proxy; tc here has no netem)")
    from nemo_dcr.codec.versions import FORMAT_VERSION, VERSIONS
    ap.add_argument("--format-version", type=int, choices=sorted(VERSIONS), default=FORMAT_VERSION,
                    help=f"the publisher's delta format version (default {FORMAT_VERSION}; 3: HEAD carries the "
                         "manifest, chunks stream inside an object)")
    return ap


def footer(res: dict) -> list:
    """The published figures, printed next to the extrapolation (not measured here), and the notes."""
    return ["", "PUBLISHED (for comparison, not measured here)"] + [
        f"  {p['source']}: {p['model']}{' at ' + format(p['change'], '.0%') if 'change' in p else ''}, {p['what']}: "
        f"{'{:g}-{:g}'.format(*p['seconds']) if isinstance(p['seconds'], tuple) else format(p['seconds'], 'g')} s"
        for p in PAPER] + [
        f"note: {n}" for n in res["notes"]]


def report(res: dict, as_json: bool, table) -> int:
    print(json.dumps(res, indent=1) if as_json else table(res))
    return 0


def machine() -> dict:
    import platform
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "load_1min": round(os.getloadavg()[0], 2)}


# ----------------------------------------------------------------------------- model of the pipeline
PARAMS = {"120B": 120e9, "247 GB (NeMo-RL)": 123.5e9, "1T": 1e12}
# inter-region rates the published dense figures imply (120B: 240 GB in 750 s; 1T: 2 TB in 87.5 min)
IMPLIED_LINK = {"120B": 240e9 * 8 / 750, "247 GB (NeMo-RL)": 240e9 * 8 / 750, "1T": 2e12 * 8 / (87.5 * 60)}

def pipeline_model(params: float, change: float, *, bytes_per_elem: float, link_bps: float, rtt: float,
                   achieved: float, receiver_s_per_elem: float, workers: int, receivers: int = 1,
                   fanout: int | None = None, intra_bps: float = 100e9, chunk_bytes: float = 4 << 20) -> dict:
    """Reload time of a ``params``-element BF16 model at ``change``, EXTRAPOLATED from measured
    rates: the delta's bytes per element (measured at this change rate), the fraction of the link
    rate a transfer achieved, and the receiver's decode+apply+verify seconds per model element on
    one core here (split over ``workers`` per receiver). The stages pipeline, so a reload takes
    the slowest stage plus a round trip per hop and one chunk per relay level to fill the pipe.

    ``fanout=None``: every receiver reads from the store across the slow link (it carries every
    receiver's copy); else a relay tree in the rollout region crosses it once, and each relay
    sends ``fanout`` copies over the intra-cluster links."""
    delta = params * bytes_per_elem
    eff = link_bps * achieved
    compute = params * receiver_s_per_elem / workers
    if fanout is None:
        wire, hops, fill = receivers * delta * 8 / eff, 1, 0.0
    else:
        levels = max(1, math.ceil(math.log(max(receivers, 1), fanout) - 1e-9))
        wire = max(delta * 8 / eff, min(fanout, receivers) * delta * 8 / intra_bps)
        hops, fill = levels + 1, levels * chunk_bytes * 8 / intra_bps
    total = max(wire, compute) + hops * rtt + fill
    return {"delta_bytes": delta, "wire": wire, "compute": compute, "seconds": total,
            "dense": params * 2 * 8 / eff * (receivers if fanout is None else 1) + rtt,
            "transport_share": wire / total}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="bench/netenv.py child processes (used by the benchmarks)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("s3")
    s.add_argument("--host", default="127.0.0.1")
    r = sub.add_parser("receiver")
    r.add_argument("--elements", type=int, required=True)
    r.add_argument("--endpoint", default=None)
    x = sub.add_parser("proxy")
    x.add_argument("--target", required=True, help="HOST:PORT the proxy forwards to")
    x.add_argument("--delay", type=float, required=True, help="seconds each direction's bytes are held back")
    a = ap.parse_args(argv)
    if a.cmd == "s3":
        _serve_s3(a.host)
    elif a.cmd == "proxy":
        host, port = a.target.rsplit(":", 1)
        p = _Proxy((host, int(port)), _Bucket(), _Bucket(), [0], a.delay)  # (unpaced: tc paces the link)
        print(f"proxy port {p.port}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin or ends us
    else:
        receiver_main(a.elements, a.endpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
