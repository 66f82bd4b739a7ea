"""Reload benchmark: dense vs delta reload of a model across an emulated inter-region link,
through the S3 server in the trainer region and through a relay in the rollout region, against
the floor; keyframe publish vs uploading the raw checkpoint; and the pipeline model's
extrapolation to 120B / 1T parameters next to the published figures.

    python bench/reload.py                  # sizes 10M/30M/100M BF16 elements, 1/3/5 %, 200 Mbit/s + 1 Gbit/s
    python bench/reload.py --json           # the same as JSON
    python bench/reload.py --quick --json   # 2M elements, 3 %, 200 Mbit/s, in-process limiter (< 1 min)
    python bench/reload.py --encoding portable   # the publisher's deltas without classes (default: auto)
    python bench/reload.py --speculate both      # each row also without the follower's reads beside HEAD

Setup: bench/netenv.py (the trainer region is a network namespace behind a veth pair shaped with
tc tbf; where namespaces are unavailable, an in-process rate limiter, said so in the output).
The publisher writes into the S3 server (moto, the tests' server) with the link unshaped (it sits
in the trainer region); then per link rate:

* dense reload: stream the raw checkpoint (one object) into the receiver's tensors;
* delta reload: ``Follower(stream=True).sync`` from one version to the next (its parts asked
  for beside the HEAD read where the held version's manifest says they will be, ``sync/speculate.py``;
  fetch with its checksum (BLAKE3: manifest format 4) as bytes arrive, decode+apply, digest
  check), with its per-stage spans and the receiver's CPU time (beside the wall time: how many
  cores the sync kept busy);
* floor: max(delta bytes / link rate, one memcpy of the receiver's tensors) + one round trip
  (a small request across the link, median of 5);
* via "s3": the receiver reads the S3 server directly; via "relay": a fresh relay in the rollout
  region (upstream: the S3 server) serves it (one more hop, cut-through).

The receiver is a fresh follower holding the version before, which a delta made (a warm-up delta
after the keyframe, at the first change rate): a follower one step behind a trainer.

Changes are INJECTED (random positions, optimizer-step-sized relative nudges), labelled so.
Every reload is checked bit for bit against the published state.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import netenv as ne  # noqa: E402

from nemo_dcr.codec.names import DEFAULT_CHUNK  # noqa: E402
from nemo_dcr.stores import HttpStore  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402


def measure(region, endpoint, args) -> dict:
    """Per size: one keyframe (timed against a raw put of the same bytes), then one version per
    change rate on top of the previous (the keyframe's O(model) digest is paid once per size);
    each version is reloaded from the one before it."""
    out = {"rows": [], "publish": [], "notes": []}
    for size in args.sizes:
        prev = ne.model(size)
        elements, dense_bytes = sum(v.numel() for v in prev.values()), ne.nbytes(prev)
        memcpy = ne.memcpy_seconds(prev)
        region.shape(None)
        prefix = f"e{size}-{int(time.time() * 1e3) % 10**8}"
        raw = ne.raw_bytes(prev)
        t = time.perf_counter()
        ne.s3_store(endpoint, prefix + "-raw").put(ne.RAW_KEY, raw)
        raw_put = time.perf_counter() - t
        del raw
        store = ne.s3_store(endpoint, prefix)
        pub = Publisher(store, format_version=args.format_version, encoding=args.encoding,
                        chunk_elems=args.chunk_elems)
        r0 = pub.publish(prev)
        stages = ne.stage_sums(r0.spans)
        out["publish"].append({"elements": elements, "raw_put": raw_put, "keyframe_publish": r0.seconds,
                               "ratio": r0.seconds / raw_put, "keyframe_stages": stages,
                               "digest_and_other": r0.seconds - sum(stages.values())})
        # the follower under test holds a version a delta made, as one following a trainer does
        # from its second version on (after a keyframe alone nothing tells how large the next
        # delta's parts are, so only its first part is asked for beside HEAD: sync/speculate.py)
        prev = ne.changed(prev, args.changes[0], seed=1000)
        pub.publish(prev)
        dense = {}
        for i, change in enumerate(args.changes):
            cur = ne.changed(prev, change, seed=1 + i)
            r1 = pub.publish(cur)
            if i == 0:
                store.put(ne.RAW_KEY, ne.raw_bytes(cur))
            for mbit in args.rates:
                region.shape(mbit)
                rtt = ne.rtt(store, ne.RAW_KEY)
                for via in ("s3", "relay"):
                    row = {"elements": elements, "dense_bytes": dense_bytes, "change": change, "changes": "injected",
                           "changed": r1.changed, "delta_bytes": r1.delta_bytes,
                           "payload_ratio": dense_bytes / r1.delta_bytes,
                           "link_mbit": mbit, "via": via, "rtt": rtt, "memcpy": memcpy,
                           "publish_delta_stages": ne.stage_sums(r1.spans), "publish_delta_s": r1.seconds}
                    if i == 0:
                        with _source(via, prefix, endpoint) as src:
                            recv = {k: v.clone() for k, v in prev.items()}
                            dense[(mbit, via)] = min(ne.dense_reload(src(), recv) for _ in range(args.reps))
                            ne.same_bits(recv, cur, f"dense reload {via}")
                    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.speculate]
                    best: dict = {m: None for m in modes}
                    times: dict = {m: [] for m in modes}
                    for _ in range(args.reps):  # a fresh relay each time: nothing cached
                        for m in modes:  # with and without, alternated
                            with _source(via, prefix, endpoint) as src:
                                d = ne.delta_reload(src(), prev, r1.version - 1, speculate=m)
                            ne.same_bits(d.pop("tensors"), cur, f"delta reload {via}")
                            times[m].append(d["seconds"])
                            if best[m] is None or d["seconds"] < best[m]["seconds"]:
                                best[m] = d
                    row["dense"], row["delta"] = dense[(mbit, via)], best[modes[0]]
                    # every repetition's time: the median beside the best (one cell of the best of
                    # 3 moved by a third between runs on a 2-core VM; the median moves less)
                    row["delta_seconds_all"] = times[modes[0]]
                    _derive(row)
                    if len(modes) > 1:  # the same reload without the reads beside HEAD: the baseline
                        row["delta_unspeculated"] = best[False]
                        row["unspeculated_over_floor"] = best[False]["seconds"] / row["floor"]
                    out["rows"].append(row)
                    if not args.json:
                        print(_row_line(row), file=sys.stderr, flush=True)
                region.shape(None)
            prev = cur
    return out


@contextlib.contextmanager
def _source(via: str, prefix: str, endpoint: str):
    """-> a function making the receiver's store: the S3 server itself, or a fresh relay in the
    rollout region in front of it (stopped afterwards)."""
    if via == "s3":
        yield lambda: ne.s3_store(endpoint, prefix)
        return
    r = ne.relay(f"s3://{ne.BUCKET}/{prefix}", "127.0.0.1:0", env=ne.s3_env(endpoint))
    try:
        r.wait_ready()
        url = ne.relay_url(r)
        yield lambda: HttpStore(url)
    finally:
        r.stop()


def _derive(row: dict) -> None:
    bps = row["link_mbit"] * 1e6
    d = row["delta"]
    row["wire"] = row["delta_bytes"] * 8 / bps
    row["floor"] = max(row["wire"], row["memcpy"]) + row["rtt"]
    row["delta_over_floor"] = d["seconds"] / row["floor"]
    row["delta_median"] = statistics.median(row.get("delta_seconds_all") or [d["seconds"]])
    row["median_over_floor"] = row["delta_median"] / row["floor"]
    row["speedup"] = row["dense"] / d["seconds"]
    row["dense_achieved_mbit"] = row["dense_bytes"] * 8 / row["dense"] / 1e6
    row["transport_share"] = min(1.0, d["fetch_busy"] / d["seconds"])
    st = d["stages"]
    # receiver-side work that did not overlap the transfer: what the pipeline failed to hide
    row["after_transfer"] = max(0.0, d["seconds"] - d["fetch_busy"])
    row["receiver_s"] = st.get("apply", 0.0) + st.get("digest", 0.0) + st.get("verify", 0.0)


def extrapolate(rows: list, workers: int) -> list:
    """Per change rate, from the largest model measured at the fastest link: EXTRAPOLATED."""
    out = []
    if not rows:
        return out
    big = max(r["elements"] for r in rows)
    fast = max(r["link_mbit"] for r in rows)
    for change in sorted({r["change"] for r in rows}):
        base = {r["via"]: r for r in rows if r["elements"] == big and r["link_mbit"] == fast and r["change"] == change}
        if "s3" not in base:
            continue
        r = base["s3"]
        achieved = min(1.0, r["dense_achieved_mbit"] / r["link_mbit"])
        per_elem = r["receiver_s"] / r["elements"]
        for name, params in ne.PARAMS.items():
            for via, fan in (("s3, 1 receiver", None), ("relay tree k=4, 64 receivers", 4)):
                m = ne.pipeline_model(params, change, bytes_per_elem=r["delta_bytes"] / r["elements"],
                                      link_bps=ne.IMPLIED_LINK[name], rtt=r["rtt"], achieved=achieved,
                                      receiver_s_per_elem=per_elem, workers=workers,
                                      receivers=64 if fan else 1, fanout=fan)
                out.append({"model": name, "params": params, "change": change, "via": via,
                            "link_gbit": ne.IMPLIED_LINK[name] / 1e9, "extrapolated": True, **m})
    return out


def run(args) -> dict:
    res, kind, note = ne.with_s3_in_trainer_region(args.shaping, lambda region, ep: measure(region, ep, args),
                                                   args.rtt_ms / 1e3)
    if note:
        res["notes"].append(note)
    res["config"] = {"sizes": args.sizes, "changes": args.changes, "rates_mbit": args.rates, "reps": args.reps,
                     "quick": args.quick, "shaping": kind, "rtt_added_ms": args.rtt_ms,
                     "format_version": args.format_version, "encoding": args.encoding,
                     "speculate": args.speculate, "chunk_elems": args.chunk_elems,
                     "receiver_workers_assumed": args.workers,
                     "changes_kind": "injected (random positions, relative nudges), not an optimizer's"}
    res["machine"] = ne.machine()
    res["targets"] = ne.TARGETS
    res["extrapolated"] = extrapolate(res["rows"], args.workers)
    res["published"] = ne.PAPER
    return res


def _row_line(r: dict) -> str:
    without = f" (without the reads beside HEAD: {r['unspeculated_over_floor']:.2f})" \
        if "unspeculated_over_floor" in r else ""
    return (f"| {r['elements'] / 1e6:.0f}M | {r['change']:.0%} | {r['link_mbit']:g} | {r['via']} | "
            f"{r['dense']:.3f} | {r['delta']['seconds']:.3f} | {r['floor']:.3f} | "
            f"{r['delta_over_floor']:.2f}{without} | {r['median_over_floor']:.2f} | "
            f"{r['speedup']:.1f}x | {r['payload_ratio']:.1f}x | {r['transport_share']:.0%} | "
            f"{r['dense_achieved_mbit']:.0f} |")


def table(res: dict) -> str:
    c = res["config"]
    L = [f"link emulation: {c['shaping']}; changes {c['changes_kind']}; format version {c['format_version']}; "
         f"encoding {c.get('encoding', 'auto')}",
         f"machine: {res['machine']['cpus']} CPUs, load {res['machine']['load_1min']:.2f}", "",
         "MEASURED",
         f"delta s: the best of {c['reps']} fresh followers; "
         f"median/floor: the median of the {c['reps']}, over the floor",
         "| elements | change | link Mbit/s | via | dense s | delta s | floor s | delta/floor (<=1.25) | median/floor "
         "| speedup | payload ratio | transport share | dense achieved Mbit/s |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    L += [_row_line(r) for r in res["rows"]]
    L += ["", "per-stage seconds of the delta reload (summed spans; fetch includes waiting on the link):"]
    for r in res["rows"]:
        d = r["delta"]
        objects = sum(1 for s in d["spans"] if s[0] == "fetch")
        L.append(f"  {r['elements'] / 1e6:.0f}M {r['change']:.0%} {r['link_mbit']:g} Mbit/s {r['via']}: "
                 f"{d['stages']} over {objects} object(s), after the transfer {r['after_transfer'] * 1e3:.1f} ms, "
                 f"receiver CPU {d['cpu'] * 1e3:.0f} ms ({d['cpu'] / d['seconds']:.1f} cores)")
    if res["rows"]:
        r = timeline_row(res["rows"])
        L += [f"timeline ({r['elements'] / 1e6:.0f}M, {r['change']:.0%}, {r['link_mbit']:g} Mbit/s via {r['via']}):",
              ne.timeline(r["delta"]["spans"])]
    L += ["", "| elements | keyframe publish s | raw put s | ratio (<=1.0) | keyframe stages |",
          "|---|---|---|---|---|"]
    L += [f"| {p['elements'] / 1e6:.0f}M | {p['keyframe_publish']:.3f} | {p['raw_put']:.3f} | {p['ratio']:.2f} | "
          f"{p['keyframe_stages']} |" for p in res["publish"]]
    L += ["", f"EXTRAPOLATED (pipeline model, measured rates; receiver work split over {c['receiver_workers_assumed']} "
              "workers; links at the rate the paper's dense figures imply)",
          "| model | change | via | link Gbit/s | delta GB | wire s | receiver s | reload s | dense s "
          "| transport share |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    L += [f"| {e['model']} | {e['change']:.0%} | {e['via']} | {e['link_gbit']:.2f} | {e['delta_bytes'] / 1e9:.1f} | "
          f"{e['wire']:.1f} | {e['compute']:.1f} | {e['seconds']:.1f} | {e['dense']:.0f} | {e['transport_share']:.0%} |"
          for e in res["extrapolated"]]
    L += ne.footer(res)
    return "\n".join(L)


def timeline_row(rows: list) -> dict:
    """The reload whose stages the table and ``reload_timeline.png`` draw (and docs/results.md walks
    through): the largest model at 3 % (or the change rate nearest it), the slowest link, via S3;
    chosen by value, not by the rows' order."""
    return max(rows, key=lambda r: (r["elements"], -abs(r["change"] - 0.03), -r["link_mbit"], r["via"] == "s3"))


def main(argv=None) -> int:
    ap = ne.parser(__doc__)
    ap.add_argument("--sizes", type=float, nargs="+", default=None, help="BF16 elements per model")
    ap.add_argument("--changes", type=float, nargs="+", default=None, help="change rates (0.03 = 3 %%)")
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="link rates, Mbit/s")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--speculate", choices=("on", "off", "both"), default="on",
                    help="the follower's reads of the next version's parts beside its HEAD read (both: each "
                         "row also without them, alternated, as delta_unspeculated)")
    ap.add_argument("--encoding", default="auto",
                    help="the publisher's delta coding: auto (the default; classes where it pays), portable "
                         "(positions sent: more bytes, no scan of the receiver's base), ...")
    ap.add_argument("--chunk-elems", type=int, default=DEFAULT_CHUNK,
                    help="the publisher's elements per chunk (default %(default)s): a receiver decodes and "
                         "applies a chunk as one job, so smaller chunks spread an arriving part's work finer")
    args = ap.parse_args(argv)
    q = args.quick
    args.sizes = [int(s) for s in (args.sizes or ([2e6] if q else [10e6, 30e6, 100e6]))]
    args.changes = args.changes or ([0.03] if q else [0.01, 0.03, 0.05])
    args.rates = args.rates or ([200.0] if q else [200.0, 1000.0])
    args.reps = args.reps or (1 if q else 2)
    args.shaping = args.shaping or ("proxy" if q else "auto")
    return ne.report(run(args), args.json, table)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
