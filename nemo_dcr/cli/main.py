"""The ``nemo-dcr`` command line. Stable interface for files; see README.md."""
from __future__ import annotations

import argparse
import json
import os
import sys

from nemo_dcr import __version__
from nemo_dcr.codec.names import CHOICES, DEFAULT_CHUNK, DEFAULT_LEVEL  # torch-free: --help, relay
from nemo_dcr.codec.versions import FORMAT_VERSION, VERSIONS
from nemo_dcr.errors import DcrError
from nemo_dcr.stores.checksums import ALGOS as OBJECT_CHECKSUMS  # torch-free


def _cmd_diff(a):
    from nemo_dcr.checkpoint.files import diff_checkpoints
    from nemo_dcr.delta.stats import inspect
    diff_checkpoints(a.base, a.target, a.output, encoding=a.encoding, level=a.level, chunk_elems=a.chunk_elems,
                     workers=a.workers, format_version=a.format_version)
    s = inspect(a.output)
    print(f"wrote {a.output}: {s['bytes']:,} bytes, {s['changed']:,} of {s['elements']:,} elements changed "
          f"({100 * s['change_rate']:.4f} %), {s['ratio_to_dense']:.1f}x smaller than dense")


def _cmd_apply(a):
    from nemo_dcr.checkpoint.files import apply_checkpoint
    r = apply_checkpoint(a.base, a.delta, a.output, workers=a.workers)
    if r.already:
        print(f"{r.out} is already the delta's target (an earlier apply finished; tensors and files checked "
              "bit-exactly): nothing to do")
        return
    rep = r.report
    print(f"wrote {r.out}: {r.files} file(s), {rep.elements_changed:,} elements changed in "
          f"{rep.tensors_changed} tensor(s); base and result verified bit-exactly")


def _cmd_inspect(a):
    from nemo_dcr.checkpoint.safetensors_io import input_kind
    from nemo_dcr.codec import backend
    from nemo_dcr.delta.stats import format_text, inspect
    if input_kind(a.delta, "delta") != "file":  # a FIFO would block the reader forever
        raise DcrError(f"{a.delta}: is a directory; the delta must be a regular file")
    s = inspect(a.delta)
    if a.json:
        print(json.dumps({**s, "backend": backend()}, indent=2))
    else:
        print(format_text(s))


def _signer(a):
    """--signing-key FILE (else $NEMO_DCR_SIGNING_KEY(_FILE)) for --namespace (else $NEMO_DCR_NAMESPACE)."""
    from nemo_dcr.sync.signing import NAMESPACE_ENV, Signer
    if not a.signing_key:
        return Signer.from_env(a.namespace)
    namespace = a.namespace or os.environ.get(NAMESPACE_ENV)
    if not namespace:
        raise DcrError(f"--signing-key needs --namespace (or ${NAMESPACE_ENV}): the run the versions belong to")
    return Signer.from_file(a.signing_key, namespace)


def _verifier(a):
    """--trusted-key (files or ed25519:... keys) else $NEMO_DCR_TRUSTED_KEYS(_FILE); None: unsigned is fine."""
    from nemo_dcr.sync.signing import NAMESPACE_ENV, Verifier
    if not a.trusted_key:
        return Verifier.from_env(a.namespace)
    return Verifier.from_sources(a.trusted_key, a.namespace or os.environ.get(NAMESPACE_ENV) or None)


def _verified_store(a, verifier="args"):
    from nemo_dcr.checkpoint.sync import open_for_reading
    from nemo_dcr.sync.signing import verifying
    store = a.store
    if getattr(a, "token_file", None):  # a relay that wants a bearer token (relay --token-file)
        from nemo_dcr.stores import open_store
        from nemo_dcr.stores.http import read_token_file
        if not store.lower().startswith(("http://", "https://")):
            raise DcrError(f"--token-file is for a relay's URL (http://HOST:PORT), not {store}")
        store = open_store(store, token=read_token_file(a.token_file))
    return verifying(open_for_reading(store), _verifier(a) if verifier == "args" else verifier)


def _cmd_keygen(a):
    from nemo_dcr.sync.signing import generate_key, key_id, private_key_pem, public_key_text
    from nemo_dcr.util.atomic import replacing
    key = generate_key()
    pub = public_key_text(key.public_key())
    for path in (a.output, a.output + ".pub"):
        if os.path.exists(path):
            raise DcrError(f"{path} exists: keygen never overwrites a key")
    with replacing(a.output) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_key_pem(key))
    with replacing(a.output + ".pub") as tmp:
        with open(tmp, "w") as f:
            f.write(pub + "\n")
    print(f"wrote {a.output} (private, mode 600) and {a.output}.pub; key id {key_id(key.public_key())}")
    print(f"public key: {pub}")


def _trusted_keys(a, signer) -> list:
    """--trusted-key on publish: the public keys whose versions a signed publish may extend."""
    if not a.trusted_key:
        return []
    from nemo_dcr.sync.signing import Verifier
    if signer is None:
        raise DcrError("--trusted-key on publish names keys whose versions a signed publish may extend: "
                       "give --signing-key too")
    return list(Verifier.from_sources(a.trusted_key).keys.values())


def _cmd_publish_dcp(a):
    from nemo_dcr.checkpoint.dcp import publish_dcp, publish_dcp_ranks
    kw = dict(prefix=a.prefix, keyframe=a.keyframe or a.new_model, keyframe_every=a.keyframe_every, retain=a.retain,
              encoding=a.encoding, level=a.level, dtype=a.dtype, format_version=a.format_version,
              object_checksum=a.object_checksum)
    if a.ranks > 1:
        if a.signing_key or a.namespace or a.trusted_key:  # key objects do not travel to the rank processes
            raise DcrError("--ranks signs with $NEMO_DCR_SIGNING_KEY(_FILE) and $NEMO_DCR_NAMESPACE only, "
                           "not --signing-key / --namespace / --trusted-key")
        s = publish_dcp_ranks(a.store, a.dcp, a.ranks, **kw)
    else:
        signer = _signer(a)
        r = publish_dcp(a.store, a.dcp, signer=signer, trusted_keys=_trusted_keys(a, signer), progress=None, **kw)
        s = {"version": r.version, "base_version": r.manifest.base_version, "kind": r.manifest.kind,
             "delta_bytes": r.delta_bytes, "keyframe_bytes": r.keyframe_bytes, "change_rate": r.change_rate}
    base = f"on version {s['base_version']}" if s["base_version"] is not None else "(first version)"
    print(f"published version {s['version']} {base} from {a.dcp} ({a.ranks} rank(s)): {s['kind']}; "
          f"delta {s['delta_bytes']:,} B, keyframe {s['keyframe_bytes']:,} B, {100 * s['change_rate']:.4f} % changed")


def _cmd_publish(a):
    from nemo_dcr.checkpoint.sync import publish_checkpoint
    if (a.checkpoint is None) == (a.dcp is None):
        raise DcrError("publish takes a safetensors CHECKPOINT or --dcp DIR (one of them)")
    if a.dcp is not None:
        return _cmd_publish_dcp(a)
    signer = _signer(a)
    trusted = _trusted_keys(a, signer)
    r = publish_checkpoint(a.store, a.checkpoint, keyframe_every=a.keyframe_every, keyframe=a.keyframe,
                           retain=a.retain, encoding=a.encoding, level=a.level, signer=signer, trusted_keys=trusted,
                           new_model=a.new_model, format_version=a.format_version,
                           object_checksum=a.object_checksum)
    m = r.manifest
    kind = m.kind
    base = f"on version {m.base_version}" if m.base_version is not None else "(first version)"
    print(f"published version {m.version} {base}: {kind}; delta {r.delta_bytes:,} B, keyframe {r.keyframe_bytes:,} B, "
          f"{100 * r.change_rate:.4f} % changed")


def _cmd_pull(a):
    from nemo_dcr.checkpoint import trust
    from nemo_dcr.checkpoint.sync import pull_checkpoint
    verifier = _verifier(a)
    if verifier is not None:  # what earlier pulls into this checkpoint verified: no replay across commands
        trust.seed(verifier, trust.load(a.into))
    p = pull_checkpoint(_verified_store(a, verifier), a.into, version=a.version)
    if verifier is not None:
        trust.save(a.into, verifier)
    r = p.sync
    if p.rewritten:
        print(f"{a.into} held version {r.version}'s tensors; its files differed from the version's and were "
              f"rewritten")
    elif not r.updated:
        print(f"{a.into} is already at version {r.version} (tensors and file bytes checked)")
    else:
        steps = ", ".join(f"{k} {v}" for k, v in r.steps)
        came_from = r.from_version if r.from_version is not None else "nothing"
        print(f"{a.into} is now at version {r.version} (from {came_from}; "
              f"{steps}; {r.bytes:,} B fetched; digest verified)")


def _cmd_log(a):
    from nemo_dcr.checkpoint.sync import history
    from nemo_dcr.cli.status import when
    ms = history(_verified_store(a), limit=a.limit)
    rows = []
    for m in ms:
        rows.append({"version": m.version, "base": m.base_version, "kind": m.kind, "delta_bytes": m.delta_bytes(),
                     "keyframe_bytes": m.keyframe_bytes(), "change_rate": m.change_rate,
                     "parts": len(m.parts) or len(m.keyframe_parts), "step": m.step, "created": m.created,
                     "committed": when(m.created), "digest": m.target_digest,
                     # which releases can follow it: the manifest's format says (docs/format.md)
                     "format": m.format, "checksum": next((p.algo for p in (*m.parts, *m.keyframe_parts)), None)})
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print("no versions")
        return
    print(f"{'version':>8} {'base':>6} {'committed (UTC)':<20} {'kind':<15} {'delta B':>12} {'keyframe B':>12} "
          f"{'change %':>9} {'parts':>5} {'format':>6}")
    for r in rows:
        cr = f"{100 * r['change_rate']:.4f}" if r["change_rate"] is not None else "-"
        base = r["base"] if r["base"] is not None else "-"
        print(f"{r['version']:>8} {base:>6} {r['committed']:<20} {r['kind']:<15} {r['delta_bytes']:>12,} "
              f"{r['keyframe_bytes']:>12,} {cr:>9} {r['parts']:>5} {r['format']:>6}")


def _cmd_verify(a):
    from nemo_dcr.checkpoint.sync import locate_checkpoint
    found, d = locate_checkpoint(_verified_store(a), a.checkpoint)
    if found.manifest is None:
        below = f" (the search down the chain stopped: {found.ended})" if found.ended else ""
        raise DcrError(f"{a.checkpoint} (digest {d}) matches no version in the store{below}")
    print(f"{a.checkpoint} is version {found.manifest.version} (digest {d})")


def _cmd_demo(a):
    from nemo_dcr.cli.demo import run_demo
    run_demo(a.workdir, store=a.store, steps=a.steps, lr=a.lr, keyframe_every=a.keyframe_every)


def _cmd_chaos(a):
    from nemo_dcr.util.extras import require
    for mod, what in (("boto3", "the S3 store"), ("moto.moto_server.werkzeug_app", "the S3 server"),
                      ("aiohttp", "the fault proxy and relays")):
        require(mod, "chaos", f"nemo-dcr chaos ({what})")
    import signal

    from nemo_dcr.chaos.campaign import kinds, long_run, run_campaign
    if a.engine and a.versions:
        raise DcrError("chaos: --versions is not supported with --engine")
    if a.versions and a.format_version:
        raise DcrError("chaos: --format-version is not supported with --versions (it draws at each start of the "
                       "publishers of a run)")
    unknown = [f for f in a.force if f not in kinds(a.sign, a.engine is not None)]
    if unknown:
        raise DcrError(f"chaos: --force {unknown}: not a fault kind of this campaign "
                       f"({', '.join(kinds(a.sign, a.engine is not None))})")

    def stop(*_):  # so the campaign's finally stops its processes and unmounts its tmpfs
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    log = None if a.json else (lambda s: print(s, file=sys.stderr, flush=True))
    if a.versions:
        out = long_run(a.versions, seed=a.seed, backend=a.backend, log=log)
        bad = out["violations"]
    else:
        runs = a.runs if a.runs is not None else 3 if a.engine else 20
        out = run_campaign(runs, seed=a.seed, fast=a.fast, sabotage=a.sabotage, log=log, progress=a.progress,
                           sign=a.sign, engine=a.engine, force=tuple(a.force), formats=tuple(a.format_version))
        bad = out["violations"] or out["not_converged"]
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(json.dumps({k: v for k, v in out.items() if k not in ("violations", "samples")}, indent=2))
        for v in out["violations"]:
            print(f"violation: {v}")
    if bad:
        raise DcrError(f"chaos: {len(out['violations'])} invariant violation(s)")


def _cmd_relay(a):
    import asyncio

    from nemo_dcr.stores import open_store
    from nemo_dcr.stores.http import read_token_file
    from nemo_dcr.transport import serve
    token = read_token_file(a.token_file) if a.token_file else None
    up_token = read_token_file(a.upstream_token_file) if a.upstream_token_file else token
    http = [u for u in a.upstream if u.lower().startswith(("http://", "https://"))]
    upstream = open_store([open_store(u, token=up_token) if u in http else u for u in a.upstream])
    # the relay's own defaults (transport/relay.py) for the options not given: written once, there
    given = {k: v for k in ("cache_max_bytes", "poll_interval", "prune_delay") if (v := getattr(a, k)) is not None}
    asyncio.run(serve(upstream, a.listen, cache_dir=a.cache_dir, token=token, secrets=[up_token or ""], mount=a.prefix,
                      verifier=_verifier(a), **given,
                      ready=lambda url: print(f"nemo-dcr relay: serving {' -> '.join(a.upstream)} at {url}",
                                              flush=True)))


# Allowed ranges of the numeric options, checked after parsing so that a bad value is the usual
# one-line error with exit status 1 (zstd's levels are 1..22; counts are non-negative).
RANGES = {"level": (1, 22), "chunk_elems": (1, None), "workers": (1, None), "keyframe_every": (0, None),
          "retain": (0, None), "version": (0, None), "runs": (1, None), "versions": (1, None), "limit": (1, None),
          "steps": (1, None), "every": (1, None), "prune_delay": (0, None)}


def check_ranges(args) -> None:
    for name, (lo, hi) in RANGES.items():
        v = getattr(args, name, None)
        if v is not None and (v < lo or (hi is not None and v > hi)):
            want = f"{lo}..{hi}" if hi is not None else f"at least {lo}"
            raise DcrError(f"--{name.replace('_', '-')} {v}: out of range (must be {want})")


class _Version(argparse.Action):
    """``--version``: the package version and the codec backend in use (found out only when asked:
    it loads the compiled kernels, which a relay never needs)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help="show the version and codec backend, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from nemo_dcr.codec.native import describe
        print(f"nemo-dcr {__version__} (codec backend: {describe()})")
        parser.exit()


def _signing_args(p, sign: bool = False) -> None:
    if not sign:  # the readers: pull, log, verify
        p.add_argument("--token-file", default=None,
                       help="bearer token for a relay that requires one (its --token-file; default: "
                            "$NEMO_DCR_RELAY_TOKEN(_FILE))")
    if sign:
        p.add_argument("--signing-key", default=None,
                       help="sign the version with this Ed25519 key file, mode 600 (default: "
                            "$NEMO_DCR_SIGNING_KEY(_FILE)); a store of signed versions takes only signed ones")
        p.add_argument("--trusted-key", action="append", default=[],
                       help="also extend versions signed by this public key (a .pub file or ed25519:...; key "
                            "rotation: the old key); the signing key's own is always trusted")
    else:
        p.add_argument("--trusted-key", action="append", default=[],
                       help="accept only versions signed by this key (a .pub file or ed25519:...); repeat for "
                            "rotation (default: $NEMO_DCR_TRUSTED_KEYS(_FILE); none: unsigned versions are read)")
    p.add_argument("--namespace", default=None,
                   help="the run the signed versions belong to (default: $NEMO_DCR_NAMESPACE"
                        + ("" if sign else "; unset: pinned to the first one seen") + ")")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-dcr", description="Bit-exact delta-compressed weight refit.")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("diff", help="encode TARGET as a delta against BASE (safetensors file or directory)")
    d.add_argument("base", help="the checkpoint the receiver holds (a .safetensors file or a directory)")
    d.add_argument("target", help="the checkpoint to encode against BASE")
    d.add_argument("-o", "--output", required=True, help="delta file to write")
    d.add_argument("--encoding", choices=list(CHOICES), default="auto",
                   help="auto (default): per chunk, classes where it pays, else the smallest of all; "
                        "portable: the smallest of xor, add and overwrite (receivers sharded finer than the sender)")
    d.add_argument("--level", type=int, default=DEFAULT_LEVEL, help=f"zstd level, 1..22 (default {DEFAULT_LEVEL})")
    d.add_argument("--chunk-elems", type=int, default=DEFAULT_CHUNK, help="elements per chunk (bounds memory)")
    d.add_argument("--workers", type=int, default=None, help="encoder threads (default: cores, at most 8)")
    d.add_argument("--format-version", type=int, choices=sorted(VERSIONS), default=FORMAT_VERSION,
                   help=f"delta format version (default {FORMAT_VERSION}: segments, tensor digests that add up to "
                        "the state digest under its definition 2); 4 (the same under definition 1), 3 (digests "
                        "summed apart), 2 (BLAKE3 digests) or 1 (SHA-256 and BLAKE2b) for receivers older than "
                        "version 5, 4, 3 or 2")
    d.set_defaults(func=_cmd_diff)

    ap = sub.add_parser("apply", help="apply DELTA to BASE and write the verified result to OUT atomically")
    ap.add_argument("base", help="the checkpoint the delta was made against")
    ap.add_argument("delta", help="delta file (from diff)")
    ap.add_argument("-o", "--output", required=True,
                    help="where the result goes (a file, a directory, or BASE itself: in place)")
    ap.add_argument("--workers", type=int, default=None, help="decoder threads (default: cores, at most 8)")
    ap.set_defaults(func=_cmd_apply)

    i = sub.add_parser("inspect", help="what a delta holds: change rate, bytes by stream and encoding")
    i.add_argument("delta", help="delta file")
    i.add_argument("--json", action="store_true", help="the figures as JSON (with the codec backend)")
    i.set_defaults(func=_cmd_inspect)

    pb = sub.add_parser("publish", help="publish a checkpoint as the next version in a store")
    pb.add_argument("--store", required=True, help="s3://bucket/prefix, file:///path or a directory")
    pb.add_argument("checkpoint", nargs="?",
                    help="the checkpoint to publish (a .safetensors file or a directory; or give --dcp)")
    pb.add_argument("--dcp", metavar="DIR", help="a torch.distributed.checkpoint directory: each saved shard as it is")
    pb.add_argument("--prefix", help="--dcp: publish the entries under this prefix, without it (e.g. model.)")
    pb.add_argument("--ranks", type=int, default=1,
                    help="--dcp: publish from N local processes, each its share of the saving ranks' shards")
    pb.add_argument("--dtype", help="--dcp: publish floating-point tensors in this dtype (e.g. bfloat16)")
    pb.add_argument("--keyframe-every", type=int, default=0,
                    help="also store the full state every K versions (0: only the first)")
    pb.add_argument("--keyframe", action="store_true", help="store the full state with this version")
    pb.add_argument("--new-model", action="store_true",
                    help="publish a checkpoint that shares less than half its tensors with the store's last "
                         "version (another model; refused without this): as a keyframe")
    pb.add_argument("--retain", type=int, default=None,
                    help="delete versions no receiver needs, keeping N recent")
    pb.add_argument("--encoding", choices=list(CHOICES), default="auto",
                    help="as diff's (default auto: classes where it pays, else the smallest of all)")
    pb.add_argument("--level", type=int, default=DEFAULT_LEVEL, help=f"zstd level, 1..22 (default {DEFAULT_LEVEL})")
    pb.add_argument("--format-version", type=int, choices=sorted(VERSIONS), default=None,
                    help=f"delta format version to write (default {FORMAT_VERSION}: state digests under their "
                         "definition 2, manifest format 5; 4 with --object-checksum sha256); 4, 3, 2 or 1 while "
                         "receivers of an earlier release follow the store (docs/format.md, \"Versioning\")")
    pb.add_argument("--object-checksum", choices=list(OBJECT_CHECKSUMS), default=None,
                    help="each stored object's checksum in the manifest (default blake3 from format version 3, "
                         "sha256 below it); sha256 (with format version 4 or below, 4 when none is named) keeps the "
                         "store readable by the release before manifest format 4")
    _signing_args(pb, sign=True)
    pb.set_defaults(func=_cmd_publish)

    pl = sub.add_parser("pull", help="bring a local checkpoint to the newest (or given) version")
    pl.add_argument("--store", required=True, help="store URL: a directory, file:///path, s3://bucket/prefix or a "
                                                   "relay's http://HOST:PORT (a local path must exist)")
    pl.add_argument("--into", required=True,
                    help="checkpoint to update (created if missing; OUT/ with a trailing slash: a directory)")
    pl.add_argument("--version", type=int, default=None, help="the version to bring it to (default: the newest)")
    _signing_args(pl)
    pl.set_defaults(func=_cmd_pull)

    lg = sub.add_parser("log", help="list the versions in a store")
    lg.add_argument("--store", required=True, help="store URL (as pull's)")
    lg.add_argument("--json", action="store_true", help="the rows as JSON")
    lg.add_argument("--limit", type=int, default=None, help="at most N versions, newest first (default: all)")
    _signing_args(lg)
    lg.set_defaults(func=_cmd_log)

    vf = sub.add_parser("verify", help="say which version a checkpoint is")
    vf.add_argument("--store", required=True, help="store URL (as pull's)")
    vf.add_argument("checkpoint", help="the checkpoint to identify (a .safetensors file or a directory)")
    _signing_args(vf)
    vf.set_defaults(func=_cmd_verify)

    from nemo_dcr.cli.status import register as register_status
    register_status(sub, _signing_args, _verified_store)

    kg = sub.add_parser("keygen", help="make an Ed25519 signing key (OUT) and its public key (OUT.pub)")
    kg.add_argument("output", help="private key file to write (never overwritten); the public key goes to OUT.pub")
    kg.set_defaults(func=_cmd_keygen)

    r = sub.add_parser("relay", help="serve a store's read side over HTTP with a cache, for a tree of receivers")
    r.add_argument("--listen", required=True, help="HOST:PORT to listen on (PORT 0: any free port)")
    r.add_argument("--upstream", required=True, action="append",
                   help="store or parent relay URL; repeat to fall back along ancestors to the store")
    r.add_argument("--cache-dir", default=None, help="where verified objects are kept (default: a temp dir)")
    r.add_argument("--cache-max-bytes", type=int, default=None, help="cache size cap (default 8 GiB)")
    r.add_argument("--token-file", default=None, help="require this bearer token from children")
    r.add_argument("--upstream-token-file", default=None, help="token for a parent relay (default: --token-file)")
    r.add_argument("--prefix", default="", help="serve under http://HOST:PORT/PREFIX")
    r.add_argument("--poll-interval", type=float, default=None,
                   help="seconds between HEAD reads of a store that cannot long-poll, while children wait (default "
                        "0.5)")
    r.add_argument("--prune-delay", type=float, default=None,
                   help="seconds after a new version before the upstream's versions are listed to drop cached ones "
                        "retention removed (default 5: not while children download the new version)")
    r.add_argument("--trusted-key", action="append", default=[],
                   help="keep (cache) only versions signed by this key (a .pub file or ed25519:...); repeat for "
                        "rotation (default: $NEMO_DCR_TRUSTED_KEYS(_FILE); none: what HEAD's digests vouch for). "
                        "Children still verify for themselves")
    r.add_argument("--namespace", default=None,
                   help="with --trusted-key: the run the signed versions belong to (default: $NEMO_DCR_NAMESPACE)")
    r.set_defaults(func=_cmd_relay)

    ch = sub.add_parser("chaos", help="fault campaign: randomized end-to-end runs with injected faults, "
                                      "receivers checked bit for bit (docs/reliability.md)")
    ch.add_argument("--runs", type=int, default=None, help="runs (default 20; with --engine 3)")
    ch.add_argument("--seed", type=int, default=0, help="seed of the runs' faults and timings (default 0)")
    ch.add_argument("--fast", action="store_true",
                    help="short runs, the fault kinds in turn (run i's first fault is kind i), at most two faults each")
    ch.add_argument("--sign", action="store_true",
                    help="signed versions: the publisher signs, every receiver trusts its key; adds forged versions "
                         "(another key, unsigned) to the faults, and a stale HEAD must be refused")
    ch.add_argument("--engine", choices=["vllm"], default=None,
                    help="engine mode: a real vLLM engine (the vLLM venv, `make venv-vllm`) is the receiver, refitted "
                         "from a tiny Llama's perturbed weights; adds kill_engine (SIGKILL mid-refit, restart) to the "
                         "faults. Slow: an engine start is ~20-60 s")
    ch.add_argument("--force", action="append", default=[], metavar="KIND",
                    help="add this fault kind to every run (repeatable)")
    ch.add_argument("--format-version", type=int, choices=sorted(VERSIONS), action="append", default=[],
                    help="delta format version the publishers write (repeatable: one drawn at each start of theirs, "
                         "so the store moves between them mid-run; default: the writer's default)")
    ch.add_argument("--json", action="store_true", help="the whole summary as JSON on stdout")
    ch.add_argument("--progress", default=None, help="rewrite this file with the summary so far after every run")
    ch.add_argument("--versions", type=int, default=None,
                    help="instead of runs: one run of N versions without faults, sampling memory, files and disk")
    ch.add_argument("--backend", choices=["local", "s3"], default="local", help="store for --versions")
    ch.add_argument("--sabotage", choices=["flip-after-update"], default=None,
                    help="self-test: flip a bit in the receivers' weights after each verified update "
                         "(the campaign must report silent corruptions)")
    ch.set_defaults(func=_cmd_chaos)

    m = sub.add_parser("demo", help="an RL loop: a Lightning trainer publishes every step, a rollout process follows, "
                                    "verifies and samples")
    m.add_argument("--workdir", default="runs/demo", help="where the store, summary and plot go (default runs/demo)")
    m.add_argument("--store", default=None, help="store URL (default: WORKDIR/store, a local directory)")
    m.add_argument("--steps", type=int, default=80, help="GRPO steps (one version each)")
    m.add_argument("--lr", type=float, default=3e-4, help="the policy's learning rate")
    m.add_argument("--keyframe-every", type=int, default=0,
                   help="also store the full state every K versions (0: only the first)")
    m.set_defaults(func=_cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_ranges(args)
        args.func(args)
    except DcrError as e:
        print(f"nemo-dcr: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nemo-dcr: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"nemo-dcr: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: still one line, the traceback with NEMO_DCR_DEBUG=1
        if os.environ.get("NEMO_DCR_DEBUG"):
            raise
        print(f"nemo-dcr: internal error (please report; NEMO_DCR_DEBUG=1 shows the traceback): "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
