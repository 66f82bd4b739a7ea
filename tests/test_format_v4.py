"""Format version 4: version 3 with each tensor digest (``"sdn:"``) the tensor's or region's share
of the state digest, keyed by its name and global shape, so that a state's tensor digests add up
to its state digest and a writer sums each element once (docs/format.md, "Digests")."""
from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch

from dcr_testing import assert_state
from nemo_dcr import DeltaReader, ShardSpec, apply, diff
from nemo_dcr.codec import format as fmt
from nemo_dcr.codec import native
from nemo_dcr.errors import BaseMismatchError, DeltaFormatError
from nemo_dcr.state import statedigest
from nemo_dcr.state.digest import Place, SumKey, sum_of, tensor_digest
from nemo_dcr.state.index_map import IndexMap
from nemo_dcr.state.statedigest import StateDigest, region_contrib, state_contrib, tensor_contrib

diff_module = importlib.import_module("nemo_dcr.delta.diff")  # the module (nemo_dcr.delta.diff is the function)

GLOBAL = (37, 50)
SPECS = [ShardSpec.full(GLOBAL), ShardSpec.of(GLOBAL, (0, 10), (37, 20)), ShardSpec.of(GLOBAL, (5, 0), (10, 50)),
         ShardSpec.of(GLOBAL, (3, 47), (20, 3)), ShardSpec.of(GLOBAL, (3, 1), (20, 2))]


def _region(g: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    return g[tuple(slice(o, o + s) for o, s in zip(spec.offsets, spec.shape))].contiguous()


@pytest.mark.parametrize("use_native", [False, True] if native.lib() is not None else [False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.offsets}+{s.shape}")
def test_a_regions_sum_in_any_pieces_is_its_share_of_the_state_digest(monkeypatch, use_native, dtype, spec):
    """``region_contrib`` over any cut of a region's elements (a chunk cut inside a run, whole
    runs, single elements) adds up to ``tensor_contrib`` of the region placed in its tensor: the
    run-by-run path of a column shard, a row shard's one run and the whole tensor alike, in the C
    kernel and in the torch reference."""
    if not use_native:
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setattr(native, "_tried", True)
    g = torch.Generator().manual_seed(3)
    whole = torch.randint(0, 256, GLOBAL, generator=g, dtype=torch.uint8) if dtype == torch.uint8 \
        else torch.randn(GLOBAL, generator=g).to(dtype) if dtype.is_floating_point \
        else torch.randint(-(1 << 40), 1 << 40, GLOBAL, generator=g)
    v = _region(whole, spec)
    want = tensor_contrib("w", v, spec)
    flat, imap = v.reshape(-1), IndexMap(spec)
    n = flat.numel()
    for cuts in ([0, n], [0, 7, 33, 80, n], [0, 1, 2, 3, 100, n], list(range(0, n + 1, 1 + n // 9)) + [n]):
        cuts = sorted({min(c, n) for c in cuts})
        got = StateDigest.zero()
        for a, b in zip(cuts, cuts[1:]):
            got = got + region_contrib("w", dtype, imap, flat[a:b], a)
        assert got == want, cuts
    other = torch.zeros(n, dtype=dtype).view(flat.dtype) if flat.dtype != dtype else torch.zeros(n, dtype=dtype)
    assert region_contrib("w", dtype, imap, other, 0) != want  # (the sum sees the bits)


def _sharded(seed: int):
    """A state cut over two ranks: a column-sharded matrix, a row-sharded one, a whole vector on
    rank 0 (each canonical element on exactly one rank)."""
    g = torch.Generator().manual_seed(seed)
    full = {"col": torch.randn(64, 48, generator=g).bfloat16(), "row": torch.randn(30, 16, generator=g),
            "vec": torch.randn(1000, generator=g).half()}
    specs = [{"col": ShardSpec.of((64, 48), (0, 0), (64, 24)), "row": ShardSpec.of((30, 16), (0, 0), (18, 16))},
             {"col": ShardSpec.of((64, 48), (0, 24), (64, 24)), "row": ShardSpec.of((30, 16), (18, 0), (12, 16))}]
    ranks = [{k: _region(full[k], s) for k, s in specs[r].items()} for r in range(2)]
    ranks[0]["vec"] = full["vec"].clone()
    return full, ranks, specs


def test_the_tensor_digests_of_a_sharded_state_add_up_to_its_state_digest():
    """Each rank's version-4 delta names its regions' shares: summed over the two ranks, the base
    digests give the base's state digest and the target digests the target's, and each rank's
    target digests sum to its own part (what a publisher commits, with no pass of its own)."""
    full, base, specs = _sharded(1)
    target = [{k: v.clone() for k, v in r.items()} for r in base]
    target[0]["col"].view(-1)[::11] += 1
    target[1]["col"].view(-1)[::7] *= -1
    target[1]["row"][2, 3] = float("nan")
    target[0]["vec"][::3] = 0
    bases, targets = StateDigest.zero(), StateDigest.zero()
    for r in range(2):
        reader = DeltaReader.open(diff(base[r], target[r], shards=specs[r], format_version=4))
        assert reader.version == 4
        h = reader.header
        mine = StateDigest.zero()
        for e in h.tensors:
            assert e.target_digest.startswith("sdn:") and e.base_digest.startswith("sdn:")
            bases, mine = bases + sum_of(e.base_digest), mine + sum_of(e.target_digest)
        assert mine == state_contrib(target[r], specs[r])
        targets = targets + mine
    assert bases == state_contrib(full)
    whole = {k: v.clone() for k, v in full.items()}
    for r in range(2):
        for k, s in specs[r].items():
            whole[k][tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape))] = target[r][k]
    whole["vec"] = target[0]["vec"]
    assert targets == state_contrib(whole)


def test_a_receiver_holding_whole_tensors_applies_the_ranks_deltas_and_checks_their_digests():
    """A receiver holding every tensor whole checks each column or row shard's ``sdn`` digests on
    its view of the region (where the region sits in the tensor: its canonical indices), applies
    both ranks' deltas bit-exactly, and refuses a rank's delta on the wrong base."""
    full, base, specs = _sharded(2)
    target = [{k: v.clone() for k, v in r.items()} for r in base]
    target[0]["col"].view(-1)[::5] += 1
    target[1]["row"].view(-1)[::3] = -0.0
    recv = {k: v.clone() for k, v in full.items()}
    blobs = [diff(base[r], target[r], shards=specs[r]) for r in range(2)]
    for blob in blobs:
        apply(recv, blob)  # verify=True: every base and target digest checked on the region's view
    want = {k: v.clone() for k, v in full.items()}
    for r in range(2):
        for k, s in specs[r].items():
            want[k][tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape))] = target[r][k]
    want["vec"] = target[0]["vec"]
    assert_state(recv, want)
    wrong = {k: v.clone() for k, v in full.items()}
    wrong["col"][0, 30] += 1  # rank 1's region, one element
    with pytest.raises(BaseMismatchError):
        apply(wrong, blobs[1])


def test_an_sdn_digest_is_keyed_by_name_and_place():
    """The same bits under another name, or at another place in the same tensor, have another
    digest (``sd`` keyed them by dtype and shape alone); the whole tensor's is its term of the
    state digest; a digest without a place is refused, not guessed."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = tensor_digest(t, "sdn", place=Place("a"))
    assert a == "sdn:" + tensor_contrib("a", t).hex() == "sdn:" + state_contrib({"a": t}).hex()
    assert tensor_digest(t, "sdn", place=Place("b")) != a
    assert tensor_digest(t, "sd") == tensor_digest(t, "sd")  # (no name: the same for every tensor)
    top = ShardSpec.of((6, 4), (0, 0), (3, 4))
    low = ShardSpec.of((6, 4), (3, 0), (3, 4))
    assert tensor_digest(t, "sdn", place=Place("a", top)) != tensor_digest(t, "sdn", place=Place("a", low))
    # a whole region in another index shape (same flat order): keyed by the global shape
    flat = ShardSpec.of((12,), (0, 0), (3, 4), index_shape=(3, 4))
    assert tensor_digest(t, "sdn", place=Place("a", flat)) == "sdn:" + state_contrib({"a": t.reshape(12)}).hex()
    with pytest.raises(ValueError, match="name and place"):
        tensor_digest(t, "sdn")
    with pytest.raises(ValueError, match="not an 'sdn' tensor digest"):
        SumKey("sdn", t.dtype, t.shape, Place("a")).parse("sd:" + "0" * 32)


def test_a_version_4_publisher_sums_each_element_once(tmp_path, monkeypatch):
    """The first version of a version-4 publisher: each element is summed once (its chunk's
    share of its tensor digest), and the committed state digest is the digests' sum, checked by
    a follower (which compares it with its own). Version 3 summed every element twice."""
    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher
    g = torch.Generator().manual_seed(4)
    state = {"w": torch.randn(70_000, generator=g).bfloat16(), "b": torch.randn(300, generator=g)}
    counted: dict = {}
    for fv in (3, 4):
        n = counted[fv] = [0]
        real_range, real_pieces = SumKey.range, statedigest._pieces

        def counting_range(self, bits, start, n=n, real=real_range):
            n[0] += bits.numel()
            return real(self, bits, start)

        def counting_pieces(name, tensor, spec, *a, n=n, real=real_pieces):
            n[0] += tensor.numel()
            return real(name, tensor, spec, *a)

        def counting_many(ranges, n=n, real=statedigest.many_contrib, **k):  # small tensors, one call a job
            n[0] += sum(r[3].numel() for r in ranges)
            return real(ranges, **k)
        monkeypatch.setattr(SumKey, "range", counting_range)
        monkeypatch.setattr(statedigest, "_pieces", counting_pieces)
        monkeypatch.setattr(statedigest, "many_contrib", counting_many)  # state_contrib's
        monkeypatch.setattr(diff_module, "many_contrib", counting_many)  # a keyframe's, summed ahead
        m = Publisher(LocalStore(tmp_path / f"v{fv}"), chunk_elems=1 << 14, format_version=fv).publish(state).manifest
        monkeypatch.undo()
        assert m.target_digest == state_contrib(state).hex()
        recv = {k: torch.zeros_like(v) for k, v in state.items()}
        Follower(LocalStore(tmp_path / f"v{fv}"), recv).sync()
        assert_state(recv, state)
    elements = sum(v.numel() for v in state.values())
    assert counted == {3: [2 * elements], 4: [elements]}


def test_a_reader_of_versions_1_to_3_refuses_version_4_clearly():
    g = torch.Generator().manual_seed(5)
    base = {"w": torch.randn(1000, generator=g)}
    target = {"w": base["w"] + 1}
    blob = diff(base, target, format_version=4)
    with mock.patch.dict(fmt.VERSIONS, {k: v for k, v in fmt.VERSIONS.items() if k < 4}, clear=True):
        with pytest.raises(DeltaFormatError, match="format version 4 is not supported"):
            DeltaReader.open(blob)
    # a reader of version 4's container that does not know its digests: refused at the header
    from nemo_dcr.state import digest
    with mock.patch.object(digest, "_PREFIX", {k: v for k, v in digest._PREFIX.items() if k != "sdn"}):
        with pytest.raises(DeltaFormatError, match="unknown tensor digest algorithm 'sdn'"):
            DeltaReader.open(blob)


@pytest.mark.parametrize("fv", [3, 4, 5])
def test_a_base_digest_summed_beside_the_chunks_is_of_the_base_before_any_change_is_written(monkeypatch, fv):
    """A base digest not known before (a publisher's first delta after it rebuilt its base from
    the store) is summed beside the tensor's chunks, while ``on_change`` may write each chunk's
    changes into that base (the publisher's snapshot does). No change is reported before the
    sum is done: here the sum waits for a change to be written (or half a second), and the
    digests are still those of the intact base. Before, they were of a base half-way to the
    target, and in version 4 the state digest with them."""
    import sys
    import threading

    from nemo_dcr.state.flat import FlatAccess
    diff_mod = sys.modules["nemo_dcr.delta.diff"]  # (the package's ``diff`` is the function)
    g = torch.Generator().manual_seed(6)
    base = {"w": torch.randn(300_000, generator=g).bfloat16()}  # one range: summed beside the chunks
    target = {"w": base["w"].clone()}
    target["w"][::50] += 1
    want = DeltaReader.open(diff(base, target, format_version=fv, chunk_elems=1 << 14)).header
    held = {"w": base["w"].clone()}
    reported = threading.Event()
    real = diff_mod.tensor_digest

    def late(t, *a, **kw):  # the base's sum starts once a change is written (or after 0.5 s)
        reported.wait(0.5)
        return real(t, *a, **kw)

    def write(name, dtype, global_shape, global_idx, old, new):  # as the publisher's snapshot takes them
        FlatAccess(held[name]).scatter(global_idx, new)
        reported.set()
    monkeypatch.setattr(diff_mod, "tensor_digest", late)
    got = DeltaReader.open(diff(held, target, format_version=fv, chunk_elems=1 << 14, workers=2,
                                on_change=write)).header
    assert [(e.base_digest, e.target_digest) for e in got.tensors] == \
        [(e.base_digest, e.target_digest) for e in want.tensors]
    assert_state(held, target)


def test_digests_summed_in_their_text_form_are_their_sum():
    """``StateDigest.sum_hex`` (a version-4 publisher's state digest from thousands of tensor
    digests in one pass) is ``from_hex`` and ``+`` of each, lanes at P - 1 included, and refuses
    what ``from_hex`` refuses."""
    import random

    from nemo_dcr.errors import DcrError
    from nemo_dcr.state.statedigest import P
    rng = random.Random(8)
    ds = [StateDigest((P - 1,) * 4), StateDigest.zero()] + \
        [StateDigest(tuple(rng.randrange(P) for _ in range(4))) for _ in range(5000)]
    want = StateDigest.zero()
    for d in ds:
        want = want + d
    assert StateDigest.sum_hex(d.hex() for d in ds) == want
    assert StateDigest.sum_hex([]) == StateDigest.zero()
    for bad in ("f" * 32, "z" * 32, "0" * 31, 5):
        with pytest.raises(DcrError):
            StateDigest.sum_hex([ds[2].hex(), bad])


def test_a_sharded_senders_removal_is_checked_on_its_part():
    """A sender holding part of a tensor that leaves the state (a trainer rank's row block)
    names that part in its ``removed`` entry (version 4): a receiver holding the tensor whole
    checks the base digest on that part and drops the tensor, and still refuses a wrong base
    there. Version 3's entry named no part: the part's digest was compared with the whole
    tensor's, and a good base was refused."""
    g = torch.Generator().manual_seed(9)
    full = {"a": torch.randn(8, 4, generator=g), "gone": torch.randn(8, 4, generator=g)}
    specs = [{k: ShardSpec.of((8, 4), (r * 4, 0), (4, 4)) for k in full} for r in range(2)]
    ranks = [{k: v[r * 4:(r + 1) * 4].clone() for k, v in full.items()} for r in range(2)]
    blobs = {fv: [diff(ranks[r], {"a": ranks[r]["a"] + 1}, shards={"a": specs[r]["a"]}, base_shards=specs[r],
                       format_version=fv) for r in range(2)] for fv in (3, 4)}
    gone = [e for e in DeltaReader.open(blobs[4][1]).header.tensors if e.removed]
    assert [(e.name, e.base_region) for e in gone] == [("gone", specs[1]["gone"])]
    recv = {k: v.clone() for k, v in full.items()}
    for blob in blobs[4]:
        apply(recv, blob)
    assert sorted(recv) == ["a"] and torch.equal(recv["a"], full["a"] + 1)
    wrong = {k: v.clone() for k, v in full.items()}
    wrong["gone"][5, 2] += 1  # in rank 1's rows
    with pytest.raises(BaseMismatchError):
        apply(wrong, blobs[4][1])
    assert sorted(wrong) == ["a", "gone"] and torch.equal(wrong["a"], full["a"])  # refused before a write
    good = {k: v.clone() for k, v in full.items()}
    with pytest.raises(BaseMismatchError):  # version 3: the part's digest against the whole tensor's
        apply(good, blobs[3][0])


@pytest.mark.parametrize("fv", [3, 4, 5])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_keyframes_small_tensors_are_summed_ahead_on_the_workers(monkeypatch, fv, workers):
    """A tensor sent whole in one light chunk (a keyframe's small tensors) has its summed
    target digest made ahead of the stream, several tensors a job (``diff._digests_ahead``), on a
    worker where there are two: each digest is its tensor's, whatever job and place in it it had;
    a larger tensor, a strided one, a region of another index shape and an empty tensor are
    summed as before."""
    import io
    import threading

    from nemo_dcr.codec.chunk import LIGHT_DENSE
    g = torch.Generator().manual_seed(11)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.float64]
    state = {f"s{i:02d}": torch.randn(30 + 97 * i, generator=g).to(dtypes[i % len(dtypes)]) for i in range(40)}
    state["transposed"] = torch.randn(40, 30, generator=g).bfloat16().t()  # not contiguous: as before
    state["special"] = torch.tensor([float("nan"), -0.0, 1e-40, float("inf"), -float("inf")])
    state["large"] = torch.randn(LIGHT_DENSE + 1, generator=g).bfloat16()
    state["empty"] = torch.zeros(0, 4)
    region = ShardSpec.of(GLOBAL, (3, 1), (20, 2))
    state["region"] = torch.randn(20, 2, generator=g)
    shards = {"region": region}
    monkeypatch.setattr(diff_module, "MANY_JOB", 5000)  # several jobs
    jobs, threads = [], []
    real = diff_module.many_contrib

    def spy(ranges, **k):
        jobs.append([r[0] for r in ranges])
        run = real(ranges, **k)
        return lambda: threads.append(threading.current_thread()) or run()
    monkeypatch.setattr(diff_module, "many_contrib", spy)
    header = diff({}, state, shards=shards, workers=workers, format_version=fv, out=io.BytesIO())
    algo = {3: "sd", 4: "sdn", 5: "sdb"}[fv]
    for e in header["tensors"]:
        assert e["target_digest"] == tensor_digest(state[e["name"]], algo,
                                                   place=Place(e["name"], shards.get(e["name"]))), e["name"]
    small = {k for k in state if k.startswith("s")}
    summed = sorted(n for job in jobs for n in job)
    if fv >= 4:
        assert summed == sorted(small)
    else:  # "sd": keyed by no name (""), and by a region's own shape, so the region is summed ahead too
        assert len(summed) == len(small) + 1
    assert len(jobs) > 2
    assert threads and all((t is threading.main_thread()) == (workers == 1) for t in threads)
    definition = 2 if fv == 5 else 1
    assert statedigest.StateDigest.sum_hex([e["target_digest"].split(":")[1] for e in header["tensors"]], definition) \
        == state_contrib(state, shards, definition=definition) or fv == 3
