"""The fault campaign: randomized end-to-end runs of the whole system with faults injected at
random points, and invariants checked against ground truth the harness keeps itself.

One campaign keeps its infrastructure for all runs (the S3 server, two fault proxies, two
relays, the publisher group and the followers are long-lived processes); each run wipes the
store, opens a fresh Publisher and fresh receivers, publishes a few versions while injecting
its faults, then stops the faults and checks that every receiver converges. See
docs/reliability.md for the fault model and the figures.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

from nemo_dcr.chaos import truth
from nemo_dcr.chaos.engine import EngineProc
from nemo_dcr.stores import checksums

FAULTS = ("kill_pub_rank", "kill_follower", "kill_relay", "obj_corrupt", "obj_truncate", "obj_delete", "obj_replace",
          "manifest_corrupt", "manifest_delete", "head_corrupt", "head_truncate", "slow_serve", "http_errors",
          "throttle", "transit_damage", "reorder_head", "dup_delivery", "s3_restart_empty", "disk_full_pub",
          "disk_full_recv", "readonly_pub", "readonly_recv", "pub_restart", "retention_race", "foreign_signed",
          "unsigned_inject")
# engine mode (--engine vllm): SIGKILL of the engine's process mid-refit (it holds the worker);
# the harness starts a fresh engine on the base checkpoint, which must refit to HEAD
ENGINE_FAULTS = ("kill_engine",)
# a forged version (another key, or none) is refused only by receivers that verify signatures;
# without signing, whoever can write the store is trusted by design
SIGNED_ONLY = ("foreign_signed", "unsigned_inject")
# a store restarted empty and rewritten from version 0 is a rollback to a verifier: refused
# (ReplayError) by design, for as long as the receiver runs (tests/test_signing.py)
UNSIGNED_ONLY = ("s3_restart_empty",)
FORGED_EPOCH = -1  # the content a forger publishes: no real publish has it
S3_ONLY = {"slow_serve", "http_errors", "throttle", "transit_damage", "reorder_head", "dup_delivery",
           "s3_restart_empty"}


def kinds(sign: bool, engine: bool = False) -> list:
    """The fault kinds of a campaign, in the order ``--fast`` takes them: a signed campaign's
    own first (the forgeries, then the stale HEAD a verifier must refuse). Engine mode: the
    engine is the one receiver, ``kill_engine`` stands for ``kill_follower``."""
    if engine:
        return [f if f != "kill_follower" else "kill_engine" for f in kinds(sign)]
    if not sign:
        return [f for f in FAULTS if f not in SIGNED_ONLY]
    first = [*SIGNED_ONLY, "reorder_head"]
    return first + [f for f in FAULTS if f not in first and f not in UNSIGNED_ONLY]

LOCAL_ONLY = {"disk_full_pub", "readonly_pub"}  # the publisher's disk is the local store's
# damage done to the store itself after a publish, before receivers fetch
DAMAGE = {"obj_corrupt", "obj_truncate", "obj_delete", "obj_replace", "manifest_corrupt", "manifest_delete",
          "head_corrupt", "head_truncate", *SIGNED_ONLY}
PROXY = {"slow_serve": {"delay": 0.5}, "http_errors": {"error": 0.15}, "throttle": {"throttle": 0.2},
         "transit_damage": {"corrupt": 0.25, "truncate": 0.2}, "reorder_head": {"stale_head": 0.4},
         "dup_delivery": {"replay": 0.3}}
# RolloutLoaders: on the store directly; through a relay with the store as fallback; through the
# relay alone
FOLLOWERS = ("loader", "relay", "relay-only")
# engine mode: the real vLLM engine (nemo_dcr.chaos.engine), on the store directly or through a
# relay with the store as fallback (drawn per run)
ENGINE_RECEIVERS = ("engine",)
ENGINE_CHUNK_ELEMS = 16384  # the engine's checkpoint is ~0.4 M elements (the small model's chunks: 256)
BUCKET, PREFIX = "nemo-dcr-chaos", "chaos"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
           "AWS_CONFIG_FILE": "/nonexistent/nemo-dcr-chaos",
           "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/nemo-dcr-chaos"}
HEAD_DAMAGED = "HEAD"  # in _Run.damaged: the harness damaged HEAD (receivers' errors name it so)
REPLY_S = 90.0  # a worker that answers nothing for this long is hung: a violation
START_S = 300.0  # starting a worker or a relay on a starved machine (fork server, gloo rendezvous)


@dataclass
class Totals:
    runs: int = 0
    steps: int = 0
    faults: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)     # faults that could not be injected, and why
    violations: list = field(default_factory=list)
    corruptions: int = 0
    checks: int = 0                                       # receiver states compared bit for bit
    errors_reported: int = 0                              # updates that raised (allowed: nothing applied silently)
    rekeyed: int = 0
    fallbacks: int = 0
    went_back: int = 0                                    # a receiver reported an older version than it held
    refused_forged: int = 0                               # updates refused: unsigned or untrusted (SignatureError)
    refused_replay: int = 0                               # updates refused: an older HEAD (ReplayError)
    converged: int = 0
    converged_after_keyframe: int = 0
    not_converged: int = 0
    engine_restarts: int = 0                              # engine mode: engines started afresh after a kill
    convergence_s: list = field(default_factory=list)
    publishes: Counter = field(default_factory=Counter)
    proxy: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    aborted: list = field(default_factory=list)           # runs the harness itself could not finish, and why
    formats: Counter = field(default_factory=Counter)     # publisher (re)starts by the format version drawn
    format_moves: int = 0                                 # (re)starts in another format than the last, in a run

    def as_json(self) -> dict:
        cs = sorted(self.convergence_s)

        def pct(p):
            return round(cs[min(len(cs) - 1, int(p * len(cs)))], 3) if cs else None
        return {"runs": self.runs, "steps": self.steps, "faults": dict(sorted(self.faults.items())),
                "skipped": dict(self.skipped), "silent_corruptions": self.corruptions,
                "violations": self.violations, "bit_checks": self.checks, "errors_reported": self.errors_reported,
                "rekeyed": self.rekeyed, "fallbacks": self.fallbacks, "went_back_on_stale_head": self.went_back,
                "refused_forged": self.refused_forged, "refused_replay": self.refused_replay,
                "converged": self.converged, "converged_after_keyframe": self.converged_after_keyframe,
                "not_converged": self.not_converged, "engine_restarts": self.engine_restarts,
                "convergence_rate": (self.converged + self.converged_after_keyframe) / self.runs if self.runs else None,
                "convergence_s": {"p50": pct(0.5), "p95": pct(0.95), "max": cs[-1] if cs else None},
                "publishes": dict(self.publishes), "proxy_injected": dict(self.proxy), "aborted": self.aborted,
                **({"publisher_formats": dict(sorted(self.formats.items())), "format_moves": self.format_moves}
                   if self.formats else {}),
                "seconds": round(self.seconds, 1)}


class _Violation(Exception):
    pass


# ----------------------------------------------------------------------------- processes

class _Worker:
    """A worker process (fork server) and its command pipe."""

    def __init__(self, ctx, target, args):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(*args[:-1], child, args[-1]) if args else (child,), daemon=True)
        self.proc.start()
        child.close()
        self.dead = False

    def send(self, cmd):
        self.conn.send(cmd)

    def recv(self, timeout=REPLY_S):
        if not self.conn.poll(timeout):
            raise TimeoutError("no answer")
        return self.conn.recv()

    def kill(self):
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.dead = True
        self.conn.close()


class _Relay:
    def __init__(self, upstream: str, cache: str, env: dict, port: int = 0):
        """Started by ``spawn()`` and ``wait()`` (a campaign starts its processes together)."""
        self.upstream, self.cache, self.env = upstream, cache, env
        self.port = port

    def start(self):
        self.spawn()
        self.wait()

    def spawn(self):
        os.makedirs(self.cache, exist_ok=True)
        cmd = [sys.executable, "-m", "nemo_dcr", "relay", "--listen", f"127.0.0.1:{self.port}", "--upstream",
               self.upstream, "--cache-dir", self.cache, "--poll-interval", "0.2"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **self.env})

    def wait(self):
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "serving" not in line:
            raise RuntimeError(f"relay did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1].strip().split("/")[0])

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(START_S)

    def ensure(self):
        if not self.alive():
            self.start()


class _S3Server:
    def __init__(self, port: int):
        """Started by ``spawn()`` and ``wait()``."""
        self.port = port

    def start(self):
        self.spawn()
        self.wait()

    def spawn(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "nemo_dcr.chaos.s3server", "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def wait(self):
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"S3 server did not start: {line!r}")
        import boto3
        boto3.session.Session().client("s3", endpoint_url=f"http://127.0.0.1:{self.port}",
                                       region_name="us-east-1").create_bucket(Bucket=BUCKET)

    def restart_empty(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(START_S)
        self.start()

    def stop(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(START_S)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Disk:
    """A small tmpfs (root only) whose fullness and writability the harness controls; without
    the privilege the disk faults are skipped and counted as such."""

    def __init__(self, path: str, size_mb: int):
        self.path = path
        os.makedirs(path, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", path],
                           capture_output=True, text=True)
        self.mounted = r.returncode == 0
        self.why = r.stderr.strip()

    def fill(self) -> bool:
        """Take every free byte; False where that could not be done. A disk this step already
        made read-only (the step drew both faults) cannot take the filler: the harness aborted
        such a run with EROFS before (docs/reliability.md)."""
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        try:
            fd = os.open(os.path.join(self.path, ".filler"), os.O_CREAT | os.O_WRONLY, 0o600)
        except OSError:
            return False
        try:
            os.posix_fallocate(fd, 0, free)
        except OSError:
            pass
        finally:
            os.close(fd)
        return os.statvfs(self.path).f_bavail == 0

    def unfill(self):
        try:
            os.unlink(os.path.join(self.path, ".filler"))
        except FileNotFoundError:
            pass

    def readonly(self, ro: bool, wait_s: float = 5.0) -> bool:
        """Remount read-only (or back). The kernel refuses ``ro`` while any file on the disk is
        open for writing (EBUSY): a relay may still be finishing a cache file from the last
        step. Those writes end on their own, so the remount is retried until ``wait_s``; a disk
        that stays busy is reported (False) and the caller counts the fault as skipped."""
        deadline = time.monotonic() + wait_s
        while True:
            r = subprocess.run(["mount", "-o", f"remount,{'ro' if ro else 'rw'}", self.path],
                               capture_output=True, text=True)
            if r.returncode == 0:
                return True
            if not ro or "busy" not in r.stderr.lower() or time.monotonic() > deadline:
                return False
            time.sleep(0.02)  # polling the kernel's answer, not waiting for a guessed time

    def close(self):
        if self.mounted:
            self.readonly(False)
            subprocess.run(["umount", "-l", self.path], capture_output=True)


# ----------------------------------------------------------------------------- the campaign

class Campaign:
    def __init__(self, seed: int = 0, workdir: str | None = None, fast: bool = False, sabotage: str | None = None,
                 log=None, engine: str | None = None):
        """``engine="vllm"``: engine mode, a real vLLM engine is the receiver (DcrError, before
        anything starts, when its venv is missing)."""
        import multiprocessing

        from nemo_dcr.chaos.proxy import FaultProxy
        from nemo_dcr.chaos.workers import PRELOAD
        from nemo_dcr.sync.signing import generate_key
        self.seed, self.fast, self.sabotage, self.sign = seed, fast, sabotage, False
        self.engine, self.base = engine, None
        self.force: tuple[str, ...] = ()
        self.receivers: tuple[str, ...] = FOLLOWERS
        if engine is not None:
            from nemo_dcr.chaos.engine import MISSING, vllm_python
            from nemo_dcr.errors import DcrError
            if engine != "vllm":
                raise DcrError(f"chaos: unknown engine {engine!r} (vllm)")
            py = vllm_python()
            if py is None:
                raise DcrError(f"chaos --engine vllm: {MISSING}")
            self.engine_python, self.receivers = py, ENGINE_RECEIVERS
        # the publisher's key (receivers trust its public half) and a forger's
        self.key, self.foreign_key = generate_key(), generate_key()
        self.log = log or (lambda s: None)
        self.rng = random.Random(seed)
        self.own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="nemo-dcr-chaos-")
        names = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "NEMO_DCR_S3_ENDPOINT", *AWS_ENV)
        self._saved_env = {k: os.environ.get(k) for k in names}  # the moto server's dummy credentials, until close()
        for k in names:
            os.environ.pop(k, None)
        os.environ.update(AWS_ENV)
        self.totals = Totals()
        self.store_disk = _Disk(os.path.join(self.workdir, "store-fs"), 64)
        self.recv_disk = _Disk(os.path.join(self.workdir, "recv-fs"), 64)
        self.local_root = os.path.join(self.store_disk.path, "store")
        os.makedirs(self.local_root, exist_ok=True)
        # every process starts at once (most of the start-up is each one importing its modules),
        # then the harness waits for each to say it is ready
        self.s3 = _S3Server(_free_port())
        self.s3.spawn()
        self.pub_proxy = FaultProxy(self.s3.port, seed=truth.hash_seed(seed, 1))
        self.recv_proxy = FaultProxy(self.s3.port, seed=truth.hash_seed(seed, 2))
        self.relay_local = _Relay(self.local_root, os.path.join(self.recv_disk.path, "cache-local"), {})
        self.relay_s3 = _Relay(f"s3://{BUCKET}/{PREFIX}", os.path.join(self.recv_disk.path, "cache-s3"),
                               {**AWS_ENV, "NEMO_DCR_S3_ENDPOINT": self.recv_proxy.url})
        self.relay_local.spawn()
        self.relay_s3.spawn()
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.env = dict(AWS_ENV)
        self.pubs: list = []
        self.followers: dict = {}
        self.engine_ckpt = os.path.join(self.workdir, "engine-checkpoint")
        self._start_publishers(wait=False)
        self.s3.wait()
        self.relay_local.wait()
        self.relay_s3.wait()
        for w in self.pubs:
            w.recv(START_S)
        for i in range(len(self.receivers)):
            self._start_follower(i)
        if engine is not None:  # the engine's process wrote its checkpoint before it started
            self.base = truth.load_base(self.engine_ckpt)

    def batch(self, runs: int, seed: int | None = None, sabotage: str | None = None, sign: bool = False,
              progress: str | None = None, force: tuple = (), formats: tuple = ()) -> dict:
        """``runs`` runs on this campaign's infrastructure, counted afresh -> their summary.
        Several batches (the CI subset, the signed subset and the self-test) share one start-up;
        a batch's runs depend only on its ``seed``, ``sign`` and the run index, as in a campaign
        of its own. ``sign``: the publisher signs (Ed25519, a namespace per run) and every
        receiver trusts its public key. ``force``: fault kinds added to every run. ``formats``:
        delta format versions the publishers write, one drawn at each (re)start of theirs where
        there are several (a store moving between formats mid-run, with its followers on it);
        none: the writer's default, and no draw (a seed's runs stay what they were)."""
        t0 = time.monotonic()
        _check_options(sign, self.engine)
        if seed is not None:
            self.seed = seed
        self.sabotage, self.sign, self.totals, self.force = sabotage, sign, Totals(), tuple(force)
        self.formats = tuple(formats)

        def summary():
            self.totals.seconds = time.monotonic() - t0
            return {"seed": self.seed, "fast": self.fast, "sabotage": sabotage, "signed": sign,
                    "engine": self.engine, **({"formats": list(formats)} if formats else {}),
                    **self.totals.as_json()}
        for i in range(runs):
            self.run(i)
            if progress:
                from nemo_dcr.util.atomic import write_atomic
                write_atomic(progress, json.dumps(summary(), indent=2).encode())
        return summary()

    # -- processes --------------------------------------------------------------------------
    def _start_publishers(self, wait=True):
        from nemo_dcr.chaos.workers import publisher_main
        for w in self.pubs:
            w.kill()
        port = _free_port()
        self.pubs = [_Worker(self.ctx, publisher_main, (r, port, self.env)) for r in range(truth.WORLD)]
        for w in self.pubs if wait else ():
            w.recv(START_S)

    def _start_follower(self, i):
        from nemo_dcr.chaos.workers import follower_main
        old = self.followers.get(i)
        if old is not None:
            old.kill()
        w: _Worker | EngineProc
        if self.engine is not None:
            w = EngineProc(self.engine_python, self.engine_ckpt, self.env, START_S)
            try:
                w.recv(START_S)
            except (TimeoutError, EOFError, OSError) as e:
                w.kill()
                raise RuntimeError(f"the engine did not start ({type(e).__name__}): {w.tail()}") from e
        else:
            w = _Worker(self.ctx, follower_main, (self.env,))
            w.recv(START_S)
        self.followers[i] = w
        return w

    def close(self):
        for w in [*self.pubs, *self.followers.values()]:
            try:
                w.send({"op": "exit"})
            except Exception:
                pass
            w.kill()
        for r in (self.relay_local, self.relay_s3):
            r.kill()
        self.s3.stop()
        self.store_disk.close()
        self.recv_disk.close()
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- stores -----------------------------------------------------------------------------
    def _specs(self, backend):
        """(publisher's store, direct receiver's store, the relay's URL, the harness's own view)."""
        from nemo_dcr.chaos.workers import open_store
        if backend == "local":
            pub = {"kind": "local", "root": self.local_root, "create": True}
            direct, relay = dict(pub, create=False), self.relay_local
            own = open_store(pub)
        else:
            s3 = {"kind": "s3", "bucket": BUCKET, "prefix": PREFIX}
            pub, direct = dict(s3, endpoint=self.pub_proxy.url), dict(s3, endpoint=self.recv_proxy.url)
            relay = self.relay_s3
            own = open_store(dict(s3, endpoint=f"http://127.0.0.1:{self.s3.port}"), cache=True)
        return pub, direct, relay, own

    def _wipe(self, own):
        for k in own.list(""):
            own.delete(k)

    # -- one run ----------------------------------------------------------------------------
    def run(self, index: int) -> None:
        rng = random.Random(truth.hash_seed(self.seed, index))
        t = self.totals
        ks = kinds(self.sign, self.engine is not None)
        primary = ks[index % len(ks)] if self.fast else rng.choice(ks)
        backend = "s3" if primary in S3_ONLY else "local" if primary in LOCAL_ONLY else rng.choice(["local", "s3"])
        others = [f for f in ks if f not in (S3_ONLY if backend == "local" else LOCAL_ONLY)]
        faults = [primary] + rng.sample(others, rng.randint(0, 1 if self.fast else 2))
        faults += [f for f in self.force if f not in faults]
        n_steps = rng.randint(2, 3) if self.fast else rng.randint(4, 6)
        when = {f: rng.randrange(n_steps) for f in faults}
        retain = 0 if "retention_race" in faults else rng.choice([None, 0, 1, 2])
        kf_every = 2 if "retention_race" in faults else rng.choice([2, 3, 4])
        r = _Run(self, index, rng, backend, retain, kf_every)
        self.log(f"run {index}: {backend}, faults {sorted(when.items(), key=lambda x: x[1])}, "
                 f"retain {retain}, keyframe every {kf_every}")
        try:
            r.setup()
            for s in range(n_steps):
                now = [f for f in faults if when[f] == s]
                t.faults.update(now)
                r.step(now)
                t.steps += 1
            r.converge()
        except _Violation:
            pass
        except (TimeoutError, EOFError, OSError, subprocess.TimeoutExpired, RuntimeError) as e:
            # the harness's own processes did not start or answer in time (not an invariant of
            # the system under test): the run is not counted, its workers are started afresh
            t.aborted.append(f"run {index}: {type(e).__name__}: {e}"[:300])
            self.log(f"  run {index} aborted by the harness: {type(e).__name__}: {e}")
            r.teardown()
            self._start_publishers()
            for i in range(len(self.receivers)):
                self._start_follower(i)
            return
        finally:
            r.teardown()
        t.runs += 1


class _Run:
    """The state of one run: the store's history as the harness saw it commit, the receivers,
    the faults in force."""

    def __init__(self, c: Campaign, index, rng, backend, retain, kf_every):
        self.c, self.index, self.rng, self.backend = c, index, rng, backend
        self.retain, self.kf_every = retain, kf_every
        self.format_version: int | None = None  # the publishers' last (re)start's, where drawn
        self.t = c.totals
        self.pub_spec, self.direct_spec, self.relay, self.own = c._specs(backend)
        self.contents = truth.Contents(truth.hash_seed(c.seed, index), c.base)
        # engine mode: the engine reads through a relay (the store as fallback) in half the runs
        self.engine_via_relay = c.engine is not None and rng.random() < 0.5
        self.epoch, self.next_c = 0, 0
        self.manifests: dict = {}     # manifest key -> (epoch, content) for every committed manifest seen
        self.published_fps: set = set()
        self.fresh_fps: set = set()   # what a receiver holds before its first version (its own zeros)
        self.head: tuple | None = None  # (version, manifest key) of the newest commit
        self.damaged: set = set()     # store keys the harness itself damaged
        self.proxy_steps = 0
        self.disk_faults: list = []
        self.pending_damage: list = []
        self.verified: set = set()    # objects whose bytes check_store has checked
        self.stopped: list = []
        self.answers: dict = {}       # receiver -> (version, manifest key, error) of its last update
        self.namespace = f"chaos-{c.seed}-{index}"  # what a signed run's versions are signed for
        self.held: dict = {}          # receiver -> newest version it reported (since it started)

    # -- setup / teardown -------------------------------------------------------------------
    def setup(self):
        c = self.c
        for d in (c.store_disk, c.recv_disk):
            d.readonly(False)
            d.unfill()
        c.pub_proxy.clear()
        c.recv_proxy.clear()
        c.pub_proxy.forget()
        c.recv_proxy.forget()
        c.relay_local.ensure()
        c.relay_s3.ensure()
        if self.backend == "local":
            shutil.rmtree(c.local_root, ignore_errors=True)
            os.makedirs(c.local_root)
        else:
            self._wipe_s3()
        self._open_publishers()
        for i in c.followers:
            self._open_follower(i)

    def _wipe_s3(self):
        for _ in range(3):
            try:
                self.c._wipe(self.own)
                return
            except Exception:
                time.sleep(0.2)
        self.c._wipe(self.own)

    def teardown(self):
        c = self.c
        for w in self.stopped:
            try:
                os.kill(w.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for d in (c.store_disk, c.recv_disk):
            d.readonly(False)
            d.unfill()
        c.pub_proxy.clear()
        c.recv_proxy.clear()
        self.t.proxy.update(c.pub_proxy.counts + c.recv_proxy.counts)
        c.pub_proxy.counts.clear()
        c.recv_proxy.counts.clear()

    def _open_publishers(self):
        from nemo_dcr.sync.signing import private_key_pem
        key = private_key_pem(self.c.key).decode() if self.c.sign else None
        formats = self.c.formats
        fv = {} if not formats else {"format_version": self.rng.choice(formats) if len(formats) > 1 else formats[0]}
        if fv:
            self.t.formats[fv["format_version"]] += 1
            last, self.format_version = self.format_version, fv["format_version"]
            self.t.format_moves += last is not None and last != self.format_version
        for w in self.c.pubs:
            w.send({"op": "open", "seed": self.contents.seed, "store": self.pub_spec,
                    "keyframe_every": self.kf_every, "retain": self.retain, "signing_key": key,
                    "namespace": self.namespace, **fv,
                    **({} if self.c.engine is None else {"base": self.c.engine_ckpt,
                                                         "chunk_elems": ENGINE_CHUNK_ELEMS})})
        for w in self.c.pubs:
            rep = w.recv(START_S)
            if not rep.get("ok"):
                raise RuntimeError(f"publisher open failed: {rep}")

    def _follower_spec(self, i):
        kind = self.c.receivers[i]
        relay = {"kind": "http", "url": self.relay.url}
        if kind == "engine":
            kind = "relay" if self.engine_via_relay else "loader"
        store = {"loader": self.direct_spec, "relay": {"kind": "list", "of": [relay, self.direct_spec]},
                 "relay-only": relay}[kind]
        from nemo_dcr.sync.signing import public_key_text
        trusted = public_key_text(self.c.key) if self.c.sign else None
        return {"op": "open", "store": store, "sabotage": self.c.sabotage, "trusted": trusted,
                "namespace": self.namespace}

    def _open_follower(self, i):
        w = self.c.followers[i]
        w.send(self._follower_spec(i))
        rep = w.recv(START_S)
        if not rep.get("ok"):
            raise RuntimeError(f"follower open failed: {rep}")

    # -- a step -----------------------------------------------------------------------------
    def step(self, faults):
        c = self.c
        # faults in force from before the publish
        proxy = {}
        for f in faults:
            if f in PROXY:
                proxy.update(PROXY[f])
                self.proxy_steps = self.rng.randint(1, 2)
        if proxy:
            # the receivers' side always; the publisher's side too for errors and throttling
            c.recv_proxy.set(**{**c.recv_proxy.faults, **proxy})
            pub_side = {k: v for k, v in proxy.items() if k in ("error", "throttle", "delay")}
            if pub_side:
                c.pub_proxy.set(**{**c.pub_proxy.faults, **pub_side})
        for f in faults:
            if f in ("disk_full_pub", "disk_full_recv", "readonly_pub", "readonly_recv"):
                disk = c.store_disk if f.endswith("pub") else c.recv_disk
                if not disk.mounted:
                    self.t.skipped[f"{f}: no tmpfs ({disk.why})"] += 1
                    continue
                ok = disk.fill() if f.startswith("disk_full") else disk.readonly(True)
                if not ok:
                    self.t.skipped[f"{f}: could not be made (busy, or read-only already)"] += 1
                self.disk_faults.append(disk)
            elif f == "s3_restart_empty":
                c.s3.restart_empty()
                self.epoch += 1  # the publisher now writes another history under the same URL
                self.held.clear()
                self.head = None
            elif f == "pub_restart":
                c._start_publishers()
                self._open_publishers()
        self.publish(kill="kill_pub_rank" in faults)
        # the store's disk faults were for this publish: lifted before the harness writes its
        # own damage there
        for d in [d for d in self.disk_faults if d is c.store_disk]:
            d.readonly(False)
            d.unfill()
            self.disk_faults.remove(d)
        # damage to the newest version's objects, manifest or HEAD, before receivers fetch
        # them (deferred to the next step while nothing is committed yet)
        self.pending_damage = [f for f in [*self.pending_damage, *faults]
                               if f in DAMAGE and not self.damage(f)]
        self.update_all(faults)
        # faults that last one step
        for d in self.disk_faults:
            d.readonly(False)
            d.unfill()
        self.disk_faults.clear()
        if self.proxy_steps:
            self.proxy_steps -= 1
            if not self.proxy_steps:
                c.recv_proxy.clear()
                c.pub_proxy.clear()
        c.relay_local.ensure()
        c.relay_s3.ensure()

    def publish(self, kill=False, keyframe=False) -> bool:
        c = self.c
        content = (self.epoch, self.next_c)
        self.next_c += 1
        for w in c.pubs:
            w.send({"op": "publish", "content": content, "keyframe": keyframe})
        killed = None
        if kill:
            time.sleep(self.rng.uniform(0, 0.4))
            killed = self.rng.randrange(len(c.pubs))
            c.pubs[killed].kill()
        reps = []
        for i, w in enumerate(c.pubs):
            if i == killed:
                continue
            try:
                reps.append(w.recv())
            except (TimeoutError, EOFError, OSError):
                reps.append({"ok": False, "error": "no answer"})
        ok = killed is None and all(r.get("ok") for r in reps)
        if not ok:
            c.log(f"  publish {content} failed: {[r.get('error') for r in reps]}")
        self.t.publishes["ok" if ok else "failed"] += 1
        if killed is not None or any(r.get("error", "").startswith(("no answer", "RuntimeError")) for r in reps):
            # a dead rank breaks the group (as does a collective that timed out: gloo's errors are
            # RuntimeErrors, the package's own are typed): start a new one; it rebuilds its base
            # from the store
            c._start_publishers()
            self._open_publishers()
            self.t.publishes["group_restarts"] += 1
        self._observe()
        if ok:
            self.check_store()
        return ok

    def _observe(self):
        """Learn what is committed, from the store directly (not through the proxies)."""
        from nemo_dcr.sync.versions import read_head
        try:
            head, _ = read_head(self.own)
        except Exception as ex:
            if HEAD_DAMAGED not in self.damaged:
                self.violation(f"HEAD unreadable: {ex}")
            return  # the harness damaged it: nothing new was committed (the publisher refuses)
        self.damaged.discard(HEAD_DAMAGED)  # a publish replaced it
        if head is None or head.manifest in self.damaged:
            return  # nothing committed, or the forgery the harness itself wrote
        self.head = (head.version, head.manifest)
        for m in self._walk(head):
            if m.key in self.manifests:
                break
            e, cc = m.meta["chaos"]
            if e == FORGED_EPOCH:  # a forgery is never a committed version
                continue
            self.manifests[m.key] = (e, cc)
            self.published_fps.add(truth.fingerprint(self.contents.raw(e, cc)))

    def check_store(self):
        """Every committed object retention must keep is there, whole. Each object's bytes are
        checked once; after that one listing per check shows it is still there (objects are
        immutable: only deletion or the harness's own damage can change them)."""
        from nemo_dcr.sync.versions import read_head
        head, _ = read_head(self.own)
        assert head is not None  # called after a successful publish
        cutoff = 0 if self.retain is None else min(head.keyframe_version, head.version - self.retain)
        listed = set(self.own.list("versions/"))
        for m in self._walk(head):
            if m.version < cutoff:
                break
            for p in [*m.parts, *m.keyframe_parts]:
                if p.key in self.damaged:
                    continue
                ok = p.key in listed
                if ok and p.key not in self.verified:
                    ok = checksums.of(p.algo, self.own.get(p.key)) == p.checksum
                    self.verified.add(p.key)
                if not ok:
                    self.violation(f"committed object {p.key} of version {m.version} unreadable before retention "
                                   f"allows (cutoff {cutoff}, head {head.version})", fatal=False)

    def forge(self, kind) -> bool:
        """Someone with write access to the store but not the key publishes a version of their
        own (content no publish had: FORGED_EPOCH): signed with another key for the run's
        namespace, or unsigned. A real ``Publisher`` writes it, so it is consistent in every
        digest: only the signature check stands between it and the receivers."""
        from nemo_dcr.errors import DcrError
        from nemo_dcr.sync.publisher import Publisher
        from nemo_dcr.sync.signing import Signer
        signer = Signer(self.c.foreign_key, self.namespace) if kind == "foreign_signed" else None
        try:
            r = Publisher(self.own, signer=signer, chunk_elems=256, allow_unverified_chain=True).publish(
                self.contents.state(FORGED_EPOCH, 0), keyframe=True, meta={"chaos": [FORGED_EPOCH, 0]})
        except DcrError as e:
            self.c.log(f"  forgery not written: {e}")
            return False
        self.damaged.add(r.manifest.key)
        return True

    def _walk(self, head):
        """The committed chain from ``head``, newest first, as walk() reads it, ending (instead of
        raising) at a manifest the harness itself damaged or deleted."""
        from nemo_dcr.errors import ManifestError, VersionNotFound
        from nemo_dcr.sync.versions import walk
        it = walk(self.own, head)
        while True:
            try:
                m = next(it)
            except StopIteration:
                return
            except (ManifestError, VersionNotFound) as e:
                if any(k in str(e) for k in self.damaged):
                    return
                raise
            yield m

    def damage(self, kind):
        from nemo_dcr.sync.versions import HEAD_KEY, read_head
        if HEAD_DAMAGED in self.damaged:
            return False  # HEAD is unreadable: nothing newer to damage until a publish replaces it
        head, _ = read_head(self.own)
        if head is None:
            return False
        if kind in SIGNED_ONLY:
            return self.forge(kind)
        if kind.startswith(("manifest_", "head_")):
            key = HEAD_KEY if kind.startswith("head_") else head.manifest
            if key in self.damaged:  # a failed publish leaves the same newest manifest
                self.t.skipped[f"{kind}: the newest manifest is already damaged"] += 1
                return True
            data = self.own.get(key)
            if kind == "manifest_delete":
                self.own.delete(key)
            elif kind == "head_truncate":
                self.own.put(key, data[: self.rng.randrange(len(data))])
            else:  # one bit flipped
                i = self.rng.randrange(len(data))
                self.own.put(key, data[:i] + bytes([data[i] ^ (1 << self.rng.randrange(8))]) + data[i + 1:])
            self.damaged.add(HEAD_DAMAGED if key == HEAD_KEY else key)
            return True
        ms = list(self._walk(head))
        if not ms:
            return False
        newest = ms[0]
        # not one the harness deleted at an earlier step (a failed publish leaves the same newest)
        parts = [q for q in [*newest.parts, *newest.keyframe_parts] if self.own.exists(q.key)] or None
        if parts is None:
            self.t.skipped[f"{kind}: every part of the newest version already deleted"] += 1
            return True
        p = self.rng.choice(parts)
        data = self.own.get(p.key)
        if kind == "obj_corrupt":
            i = self.rng.randrange(len(data))
            new = data[:i] + bytes([data[i] ^ (1 << self.rng.randrange(8))]) + data[i + 1:]
        elif kind == "obj_truncate":
            new = data[: self.rng.randrange(len(data))]
        elif kind == "obj_replace":
            # another committed object still in the store: the chain's older manifests may name
            # objects retention has deleted since
            listed = set(self.own.list("versions/"))
            others = [q.key for m in ms for q in [*m.parts, *m.keyframe_parts] if q.key != p.key and q.key in listed]
            if not others:
                self.t.skipped[f"{kind}: no other object"] += 1
                return True
            new = self.own.get(self.rng.choice(others))
        else:
            new = None
        from nemo_dcr.errors import DcrError
        try:
            if new is None:
                self.own.delete(p.key)
            else:
                self.own.put(p.key, new)
        except DcrError:  # the store is read-only or full this step (a disk fault drawn with it)
            self.t.skipped[f"{kind}: store not writable"] += 1
            return True
        self.damaged.add(p.key)
        return True

    # -- receivers --------------------------------------------------------------------------
    def update_all(self, faults=(), final=False):
        c = self.c
        for w in c.followers.values():
            w.send({"op": "update"})
        killed = set()
        if "kill_follower" in faults or "kill_engine" in faults:
            # the engine's refit runs ~0.3-1 s (its layers are rebuilt): the kill lands in it
            time.sleep(self.rng.uniform(0, 0.15 if "kill_follower" in faults else 0.6))
            i = self.rng.randrange(len(c.followers))
            c.followers[i].kill()
            killed.add(i)
        if "kill_relay" in faults:
            time.sleep(self.rng.uniform(0, 0.15))
            self.relay.kill()
        if "retention_race" in faults:
            time.sleep(self.rng.uniform(0, 0.05))
            i = self.rng.randrange(len(c.followers))
            w = c.followers[i]
            os.kill(w.proc.pid, signal.SIGSTOP)
            self.stopped.append(w)
            for _ in range(3):  # retain=0, keyframe every 2: what the receiver was fetching is deleted
                self.publish()
            os.kill(w.proc.pid, signal.SIGCONT)
            self.stopped.remove(w)
        at_head = {}
        for i, w in list(c.followers.items()):
            if i in killed:
                continue
            try:
                rep = w.recv()
            except (TimeoutError, EOFError, OSError) as e:
                self.violation(f"follower {c.receivers[i]} hung or died in update ({type(e).__name__})", fatal=False)
                killed.add(i)
                continue
            at_head[i] = self.check(i, rep)
            self.answers[i] = (rep.get("version"), rep.get("key"), rep.get("error"))
            if final and not at_head[i]:
                self.c.log(f"  {c.receivers[i]} not at head {self.head}: version {rep.get('version')} "
                           f"error {rep.get('error')}")
        for i in killed:  # a receiver killed (or hung) starts again from nothing
            self.answers.pop(i, None)
            self.held.pop(i, None)
            c._start_follower(i)
            self.t.engine_restarts += c.engine is not None
            self._open_follower(i)
            at_head[i] = False
        return all(at_head.values())

    def check(self, i, rep) -> bool:
        """The invariants for one receiver's answer -> whether it holds the newest version."""
        t = self.t
        if not rep.get("ok"):
            self.violation(f"follower {self.c.receivers[i]} worker failed: {rep.get('error')}", fatal=False)
            return False
        kind, v, key, err, raw = self.c.receivers[i], rep["version"], rep.get("key"), rep["error"], rep.get("raw")
        t.checks += 1
        t.errors_reported += err is not None
        t.rekeyed += bool(rep.get("rekeyed"))
        t.fallbacks += rep.get("fallbacks", 0)
        if err is not None:
            t.refused_replay += err.startswith("ReplayError")
            t.refused_forged += err.startswith(("SignatureError", "UnsignedError"))
        if v is not None:
            # a receiver that reports an older version than it held before (the same process,
            # the same history): a stale HEAD took it back. Allowed without signatures (counted);
            # a verifier must refuse it (ReplayError)
            prev = self.held.get(i)
            if prev is not None and v < prev:
                t.went_back += 1
                if self.c.sign:
                    self.violation(f"signed receiver {kind} went back from version {prev} to {v}", fatal=False)
            self.held[i] = max(v, prev if prev is not None else v)
        fp = truth.fingerprint(raw) if raw else None
        if v is not None:
            if key not in self.manifests:
                self._corrupt(i, f"reports version {v} from manifest {key}, which was never committed")
                return False
            exp = self.contents.raw(*self.manifests[key])
            if raw != exp:
                bad = sorted(n for n in exp if raw.get(n) != exp[n])
                self._corrupt(i, f"reports version {v} but holds other bits in {bad}")
                return False
        else:
            if err is None and self.head is not None:
                self.violation(f"follower {kind} has no version and reported no error (HEAD {self.head})",
                               fatal=False)
            if v is None and self.head is None and fp is not None:
                self.fresh_fps.add(fp)
            if err is None and fp is not None and fp not in self.published_fps | self.fresh_fps:
                self._corrupt(i, "holds bits no published version had and reported no error")
                return False
        return self.head is None or key == self.head[1]

    def _corrupt(self, i, what):
        self.t.corruptions += 1
        self.violation(f"SILENT CORRUPTION: follower {self.c.receivers[i]}: {what}", fatal=False)

    def violation(self, what, fatal=True):
        self.t.violations.append(f"run {self.index} ({self.backend}): {what}")
        self.c.log(f"  VIOLATION: {what}")
        if fatal:
            raise _Violation(what)

    # -- convergence ------------------------------------------------------------------------
    def converge(self):
        """Faults stop: the publisher publishes once more and every receiver must reach it."""
        c, t = self.c, self.t
        for f in self.pending_damage:
            t.skipped[f"{f}: nothing was committed in the run"] += 1
        for w in self.stopped:
            os.kill(w.proc.pid, signal.SIGCONT)
        self.stopped.clear()
        c.recv_proxy.clear()
        c.pub_proxy.clear()
        c.relay_local.ensure()
        c.relay_s3.ensure()
        t0 = time.monotonic()
        for _ in range(2):
            if self.publish():
                break
        else:
            # a restarted publisher cannot rebuild its base when the store lost an object of it:
            # the documented remedy is a keyframe (Publisher.publish(keyframe=True))
            t.publishes["keyframe_needed"] += 1
            if not self.publish(keyframe=True):
                self.violation("the publisher cannot publish after the faults stopped")
        if self._rounds(8):
            t.converged += 1
        else:
            # what the store lost is needed by every path: an operator publishes a keyframe
            self.publish(keyframe=True)
            if self._rounds(8):
                t.converged_after_keyframe += 1
            else:
                t.not_converged += 1
                self.violation("receivers did not converge after the faults stopped", fatal=False)
                return
        t.convergence_s.append(time.monotonic() - t0)

    def _rounds(self, n) -> bool:
        """Up to ``n`` update rounds until every receiver is at HEAD. Stops early when two
        rounds in a row left every receiver where it was, each one behind raising the same error
        while the store holds something the harness damaged: no round can change that (the
        damage stays), only a keyframe can."""
        prev = None
        for _ in range(n):
            if self.update_all(final=True):
                return True
            now = dict(self.answers)
            behind = [a for a in now.values() if self.head is None or a[1] != self.head[1]]
            if now == prev and behind and self.damaged and all(a[2] for a in behind):
                return False
            prev = now
        return False


# ----------------------------------------------------------------------------- long run

def long_run(versions: int, seed: int = 0, backend: str = "local", every: int | None = None, log=None) -> dict:
    """One run of ``versions`` versions without faults (retain 2, keyframe every 50), every
    receiver checked bit for bit at every version; RSS, open files and disk sampled."""
    c = Campaign(seed=seed, log=log)
    every = every or max(1, versions // 20)
    samples = []
    try:
        r = _Run(c, 0, random.Random(seed), backend, retain=2, kf_every=50)
        r.setup()
        t0 = time.monotonic()
        for v in range(versions):
            if not r.publish():
                r.violation(f"publish of version {v} failed", fatal=False)
            if not r.update_all():
                r.violation(f"a receiver is not at version {v}", fatal=False)
            r.contents.forget_before(0, max(0, v - 8))
            if v % every == 0 or v == versions - 1:
                samples.append(_sample(c, v, time.monotonic() - t0))
                if log:
                    log(json.dumps(samples[-1]))
        r.teardown()
    finally:
        c.close()
    return {"versions": versions, "backend": backend, "samples": samples,
            "violations": c.totals.violations, "silent_corruptions": c.totals.corruptions,
            "bit_checks": c.totals.checks}


def _proc_stats(pid):
    try:
        with open(f"/proc/{pid}/status") as fh:
            rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))
        return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, StopIteration):
        return None


def _du(path):
    total = 0
    for dp, _, fs in os.walk(path):
        for f in fs:
            try:
                total += os.lstat(os.path.join(dp, f)).st_size
            except OSError:
                pass
    return total


def _sample(c: Campaign, v, seconds):
    procs = {f"publisher{i}": w.proc.pid for i, w in enumerate(c.pubs)}
    procs.update({f"follower-{c.receivers[i]}": w.proc.pid for i, w in c.followers.items()})
    procs.update({"relay-local": c.relay_local.proc.pid, "relay-s3": c.relay_s3.proc.pid, "harness": os.getpid()})
    return {"version": v, "seconds": round(seconds, 1), "procs": {k: _proc_stats(p) for k, p in procs.items()},
            "store_bytes": _du(c.local_root), "store_objects": sum(len(fs) for _, _, fs in os.walk(c.local_root)),
            "relay_cache_bytes": _du(os.path.join(c.recv_disk.path, "cache-local")),
            "receiver_disk_bytes": _du(c.recv_disk.path)}


def _check_options(sign: bool, engine: str | None) -> None:
    if sign and engine is not None:
        from nemo_dcr.errors import DcrError
        raise DcrError("chaos: --sign is not supported with --engine (the engine's receiver is not given the key)")


def run_campaign(runs: int, seed: int = 0, fast: bool = False, sabotage: str | None = None, log=None,
                 progress: str | None = None, sign: bool = False, engine: str | None = None,
                 force: tuple = (), formats: tuple = ()) -> dict:
    """``progress``: a file rewritten after every run with the summary so far (a long campaign
    stopped early still has its figures). ``engine="vllm"``: engine mode (a real vLLM engine is
    the receiver). ``force``: fault kinds added to every run. ``formats``: the delta format
    versions the publishers write (``Campaign.batch``)."""
    _check_options(sign, engine)  # before anything starts
    c = Campaign(seed=seed, fast=fast, log=log, engine=engine)
    try:
        return c.batch(runs, seed=seed, sabotage=sabotage, sign=sign, progress=progress, force=force,
                       formats=formats)
    finally:
        c.close()
