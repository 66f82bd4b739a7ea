"""Two names of a receiver's mapping over one memory (tied weights listed twice, as a module's
``state_dict()`` lists them), both written by a delta: refused before the first write
(``delta/overlap.py``). Their chunks used to run on two workers at once over the same bits."""
import itertools
import random

import pytest
import torch

from dcr_testing import assert_bits_equal
from nemo_dcr import apply, diff
from nemo_dcr.codec import format as fmt
from nemo_dcr.delta import apply_stream, overlap
from nemo_dcr.delta.overlap import Claims, share_bytes
from nemo_dcr.errors import AliasedWriteError, PartialApplyError
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher


def test_share_bytes_is_exact_for_views_of_one_storage():
    m = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    assert share_bytes(m, m) and share_bytes(m, m[3])
    assert share_bytes(m[:4], m[3:]) and not share_bytes(m[:4], m[4:])
    # interleaved without a common byte: columns, split; every other element
    assert not share_bytes(m[:, :4], m[:, 4:]) and not share_bytes(m.view(-1)[::2], m.view(-1)[1::2])
    assert share_bytes(m[:, :5], m[:, 4:]) and share_bytes(m.view(-1)[::2], m.view(-1)[::3])
    # another dtype over the same bytes: the half of an element is a common byte
    assert share_bytes(m.view(torch.int16)[0, 1:2], m[0, 0]) and not share_bytes(m.view(torch.int16)[0, 2], m[0, 0])
    assert not share_bytes(m, m.clone()) and not share_bytes(m[:0], m)


def _bytes_of(t: torch.Tensor) -> set[int]:
    es, base = t.element_size(), t.data_ptr()
    out: set[int] = set()
    for idx in itertools.product(*[range(n) for n in t.shape]):
        off = sum(i * s for i, s in zip(idx, t.stride(), strict=True))
        out.update(range(base + off * es, base + (off + 1) * es))
    return out


def _random_view(rnd: random.Random, buf: torch.Tensor, stride: int) -> torch.Tensor:
    """A view of ``buf`` as another dtype: any strides, or runs ``stride`` apart (columns)."""
    b = buf.view(rnd.choice([torch.float32, torch.int16, torch.uint8]))
    kind = rnd.choice(["any", "columns", "every k-th", "dense"])
    if kind == "any":
        shape = [rnd.randint(1, 5) for _ in range(rnd.randint(1, 3))]
        strides = [rnd.randint(0, 12) for _ in shape]
    elif kind == "columns":
        shape, strides = [rnd.randint(1, 6), rnd.randint(1, stride + 2)], [stride, 1]
    elif kind == "every k-th":
        shape, strides = [rnd.randint(1, 8)], [stride]
    else:
        shape = [rnd.randint(1, 4), rnd.randint(1, 4)]
        strides = [shape[1], 1] if rnd.random() < 0.5 else [1, shape[0]]
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    return b.as_strided(shape, strides, rnd.randint(0, min(b.numel() - span, 24)))  # near one another


@pytest.mark.parametrize("marks_max", [overlap.MARKS_MAX, 16])
def test_share_bytes_agrees_with_the_bytes_each_view_covers(monkeypatch, marks_max):
    """Seeded views of every layout, among them the ones compared arithmetically (runs a common
    stride apart) and the ones marked byte by byte (or, over a longer span than ``MARKS_MAX``,
    taken apart), against the set of bytes each covers."""
    monkeypatch.setattr(overlap, "MARKS_MAX", marks_max)
    rnd = random.Random(0)
    buf = torch.zeros(160, dtype=torch.float32)
    met = 0
    for _ in range(3000):
        stride = rnd.randint(1, 9)
        a, b = _random_view(rnd, buf, stride), _random_view(rnd, buf, stride)
        truth = bool(_bytes_of(a) & _bytes_of(b))
        assert share_bytes(a, b) == truth, (a.shape, a.stride(), a.storage_offset(), a.dtype,
                                           b.shape, b.stride(), b.storage_offset(), b.dtype)
        met += truth
    assert 600 < met < 2400  # both outcomes, many times


def test_claims_refuse_a_second_name_over_claimed_memory_and_keep_none_of_a_refused_claim():
    m = torch.zeros(10, 10)
    c = Claims()
    c.claim([("a", m[:5]), ("b", m[5:])])
    c.claim([("a", m[:5])])  # the same name again (a segment of the same tensor)
    with pytest.raises(AliasedWriteError, match="b and c share memory"):
        c.claim([("x", torch.zeros(3)), ("c", m[9])])
    c.claim([("x", torch.zeros(3))])  # nothing of the refused claim was kept
    far = [torch.zeros(1000) for _ in range(50)]
    c.claim([(f"f{i}", t) for i, t in enumerate(far)])
    with pytest.raises(AliasedWriteError, match="f7 and g"):
        c.claim([("g", far[7][10:20])])


def tied(seed: int, tie: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    return {"embed.weight": emb, "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
            "lm_head.weight": emb if tie else emb.clone()}


def stepped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in state.items()}
    out["embed.weight"].view(-1)[::7] += 1
    out["lm_head.weight"] = out["embed.weight"]
    out["norm.weight"].view(-1)[::3] -= 1
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_a_delta_writing_both_names_of_tied_memory_is_refused_with_nothing_changed(workers):
    """The publisher named the tied tensor twice (a raw ``state_dict``), and so does the receiver."""
    base = tied(0, tie=False)
    blob = diff(base, stepped(base))
    recv = tied(0)  # the same values, the two names over one memory
    before = {k: v.clone() for k, v in recv.items()}
    with pytest.raises(AliasedWriteError) as e:
        apply(recv, blob, workers=workers)
    assert not isinstance(e.value, PartialApplyError)
    for words in ("embed.weight and lm_head.weight share memory", "refused before writing lm_head.weight"):
        assert words in str(e.value)
    for k, v in recv.items():
        assert_bits_equal(v, before[k], k)
    # named once on either side, it applies
    once = {k: v for k, v in recv.items() if k != "lm_head.weight"}
    apply(once, diff({k: v for k, v in base.items() if k != "lm_head.weight"},
                     {k: v for k, v in stepped(base).items() if k != "lm_head.weight"}))
    assert_bits_equal(recv["lm_head.weight"], stepped(base)["lm_head.weight"])


def test_split_columns_of_one_matrix_are_written_as_two_tensors():
    """Views that interleave without a common byte are not aliases."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(256, 64, generator=g)
    base = {"left": m[:, :32].clone(), "right": m[:, 32:].clone()}
    target = {k: v + (i + 1) * (torch.rand(v.shape, generator=g) < 0.1) for i, (k, v) in enumerate(base.items())}
    recv = {"left": m[:, :32], "right": m[:, 32:]}
    apply(recv, diff(base, target), workers=2)
    assert_bits_equal(m[:, :32], target["left"])
    assert_bits_equal(m[:, 32:], target["right"])


def test_objects_applied_at_once_share_their_claims(monkeypatch):
    """A follower applies the parts of a version arriving at once together, each through its own
    ``apply_stream``: one name in each part, over one memory, is refused in the second."""
    monkeypatch.setattr(fmt, "SEGMENT_BYTES", 256)
    base = tied(2, tie=False)
    target = stepped(base)
    parts = [diff({k: base[k]}, {k: target[k]}, format_version=3) for k in ("embed.weight", "lm_head.weight")]
    recv = tied(2)
    claims = Claims()
    apply_stream(recv, fmt.SegmentStream(memoryview(parts[0])).ready(len(parts[0])), claims=claims)
    with pytest.raises(AliasedWriteError, match="embed.weight and lm_head.weight"):
        apply_stream(recv, fmt.SegmentStream(memoryview(parts[1])).ready(len(parts[1])), claims=claims)
    assert_bits_equal(recv["embed.weight"], target["embed.weight"])  # the first part, as written


@pytest.mark.parametrize("parts", ["one part", "a part per tensor"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_follower_over_tied_names_is_refused_and_keeps_its_state(tmp_path, stream, parts):
    """The parts of a version share their claims, applied at once (streamed) or in turn."""
    store = str(tmp_path / "store")
    base = tied(3, tie=False)
    pub = Publisher(store, part_bytes=1 if parts == "a part per tensor" else 32 << 20)
    assert len(pub.publish(base).manifest.keyframe_parts) == (3 if parts == "a part per tensor" else 1)
    recv = tied(3)
    before = {k: v.clone() for k, v in recv.items()}
    f = Follower(store, recv, verifier=None, stream=stream)
    with pytest.raises(AliasedWriteError, match="embed.weight and lm_head.weight"):
        f.sync()
    assert f.version is None
    for k, v in recv.items():
        assert_bits_equal(v, before[k], k)
