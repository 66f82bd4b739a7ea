"""``nemo-dcr status``: what a store holds and who follows it, at a glance (``--watch``: again and
again).

    nemo-dcr status --store s3://bucket/run1 [--relay http://relay:8470] [--watch [SECONDS]]

HEAD (version, keyframe, when it was committed, signer), the versions still held (retention),
the recent versions with their commit times, sizes and change rates, and -- where receivers
report themselves to a relay (the store URL is a relay, or ``--relay``) -- each receiver's
version and how many versions it is behind.
"""
from __future__ import annotations

import datetime
import json
import sys
import time

from nemo_dcr.errors import DcrError

__all__ = ["register", "when", "age", "gather", "render"]


def when(ts: float | None) -> str:
    """A commit time as ``YYYY-MM-DD HH:MM:SSZ`` (UTC: the same on the trainer and the rollouts)."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def age(seconds: float | None) -> str:
    """``42 s``, ``3.5 min``, ``2.0 h``, ``4.1 d``."""
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.1f} min"
    if s < 36 * 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _size(n: int) -> str:
    x = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if x < 1000:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} TB"


def _row(m) -> dict:
    return {"version": m.version, "base": m.base_version, "kind": m.kind, "created": m.created,
            "committed": when(m.created), "step": m.step, "delta_bytes": m.delta_bytes(),
            "keyframe_bytes": m.keyframe_bytes(), "dense_bytes": m.dense_bytes, "change_rate": m.change_rate,
            "parts": len(m.parts) or len(m.keyframe_parts), "digest": m.target_digest}


def gather(store, relay=None, limit: int = 10, now: float | None = None) -> dict:
    """Everything ``status`` shows, as a dict (``--json`` prints it): ``head``, ``held``,
    ``versions`` (newest first, at most ``limit``), ``receivers`` (None when no relay reports)."""
    from nemo_dcr.stores.http import HttpStore
    from nemo_dcr.sync.versions import key_version, read_head, walk
    now = time.time() if now is None else now
    head, _ = read_head(store)
    out: dict = {"store": store.url, "at": when(now), "head": None, "held": None, "versions": [],
                 "receivers": None, "relay": None}
    if head is not None:
        rows: list = []
        for m in walk(store, head):
            if len(rows) >= limit:
                break
            rows.append(_row(m))
        top = rows[0] if rows else None
        sig = head.signature or {}
        out["head"] = {"version": head.version, "keyframe_version": head.keyframe_version,
                       "manifest": head.manifest, "committed": top["committed"] if top else "-",
                       "created": top["created"] if top else None,
                       "age_seconds": now - top["created"] if top else None,
                       "signed_by": sig.get("key"), "namespace": sig.get("namespace")}
        out["versions"] = rows
        held = sorted({v for v in (key_version(k)[0] for k in store.list("versions/"))
                       if v is not None and v <= head.version})
        gaps = [(a, b) for a, b in zip(held, held[1:]) if b != a + 1]
        created = [r["created"] for r in rows]
        out["held"] = {"oldest": held[0] if held else None, "newest": held[-1] if held else None,
                       "count": len(held), "gaps": gaps, "keyframe_version": head.keyframe_version,
                       "seconds_per_version": (created[0] - created[-1]) / (len(created) - 1)
                       if len(created) > 1 else None}
    source = relay if relay is not None else store if isinstance(store, HttpStore) else None
    if source is not None:
        st = source.stats()
        out["relay"] = source.url
        out["receivers"] = st.get("receivers", [])
        out["relay_head_version"] = st.get("head_version")
    return out


def render(s: dict) -> str:
    lines = [f"store     {s['store']}    (at {s['at']})"]
    h = s["head"]
    if h is None:
        lines.append("HEAD      none: nothing committed yet")
    else:
        signed = f"signed by key {h['signed_by']} for {h['namespace']!r}" if h["signed_by"] else "unsigned"
        lines.append(f"HEAD      version {h['version']} (keyframe {h['keyframe_version']}), committed "
                     f"{h['committed']}, {age(h['age_seconds'])} ago; {signed}")
        held = s["held"]
        if held["count"]:
            rate = f"; a version every {age(held['seconds_per_version'])}" if held["seconds_per_version"] else ""
            gaps = f"; gaps after {', '.join(str(a) for a, _ in held['gaps'][:5])}" if held["gaps"] else ""
            lines.append(f"held      versions {held['oldest']}..{held['newest']} ({held['count']}){gaps}{rate}")
            lines.append(f"retention keeps the newest keyframe ({held['keyframe_version']}) and every version after "
                         f"it; older versions go when the publisher prunes (--retain)")
        lines.append("")
        lines.append(f"{'version':>8}  {'committed (UTC)':<20} {'age':>8}  {'kind':<14} {'delta':>10} "
                     f"{'keyframe':>10} {'dense':>10} {'change %':>9} {'step':>6}")
        for r in s["versions"]:
            cr = f"{100 * r['change_rate']:.4f}" if r["change_rate"] is not None else "-"
            lines.append(f"{r['version']:>8}  {r['committed']:<20} {age(_ago(s, r)):>8}  {r['kind']:<14} "
                         f"{_size(r['delta_bytes']) if r['parts'] and r['delta_bytes'] else '-':>10} "
                         f"{_size(r['keyframe_bytes']) if r['keyframe_bytes'] else '-':>10} "
                         f"{_size(r['dense_bytes']):>10} {cr:>9} {r['step'] if r['step'] is not None else '-':>6}")
    if s["receivers"] is not None:
        lines.append("")
        rs = s["receivers"]
        lines.append(f"receivers reporting to {s['relay']} (relay at version {s.get('relay_head_version')}): {len(rs)}")
        if rs:
            lines.append(f"  {'receiver':<32} {'version':>8} {'behind':>7}  {'last report':>12}  peer")
            for r in rs:
                v = r["version"] if r["version"] is not None else "none"
                lag = r["lag"] if r["lag"] is not None else "-"
                lines.append(f"  {r['receiver']:<32} {v:>8} {lag:>7}  {age(r['seen_seconds_ago']) + ' ago':>12}  "
                             f"{r['peer']}")
    return "\n".join(lines)


def _ago(s: dict, r: dict) -> float | None:
    h = s["head"]
    if h is None or h["created"] is None or h["age_seconds"] is None:
        return None
    return h["age_seconds"] + (h["created"] - r["created"])


def run(a, open_store) -> None:
    from nemo_dcr.stores import HttpStore
    store = open_store(a)
    relay = HttpStore(a.relay) if a.relay else None
    n = 0
    while True:
        s = gather(store, relay, limit=a.limit)
        if a.json:
            print(json.dumps(s, indent=2), flush=True)
        else:
            if a.watch is not None and sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")  # a fresh screen per refresh, as watch(1) does
            print(render(s), flush=True)
        n += 1
        if a.watch is None or (a.count is not None and n >= a.count):
            return
        if not sys.stdout.isatty() and not a.json:
            print("", flush=True)
        time.sleep(a.watch)


def register(sub, signing_args, open_store) -> None:
    """Add ``status`` to the CLI's subcommands (``open_store(args)``: the store to read, verified
    as the other read commands verify it)."""
    p = sub.add_parser("status", help="HEAD, recent versions, retention and (through a relay) receivers' lag")
    p.add_argument("--store", required=True, help="the store (a directory, s3://..., or a relay's http://...)")
    p.add_argument("--relay", default=None,
                   help="a relay whose receivers to show (default: the store URL, when it is a relay)")
    p.add_argument("--limit", type=int, default=10, help="recent versions to show (default 10)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until interrupted")
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after this many refreshes")
    p.add_argument("--json", action="store_true", help="the status as JSON (one object per refresh)")
    signing_args(p)
    p.set_defaults(func=lambda a: _checked(a, open_store))


def _checked(a, open_store) -> None:
    if (a.count is not None and a.count < 1) or (a.watch is not None and a.watch <= 0):
        raise DcrError("status: --count must be at least 1 and --watch positive")
    run(a, open_store)
