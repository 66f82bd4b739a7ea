"""Ground truth the chaos harness keeps itself: what every published content holds, bit for bit.

A *content* is ``(epoch, c)``: epoch ``e`` starts from a random state drawn from the run seed
(with NaN payloads, -0.0, subnormals and integer buffers in it) and content ``c`` applies ``c``
sparse bit-level updates to it. Publisher ranks compute the same global state and keep their
shard; the harness computes it whole and compares receivers' raw bytes with it. The harness
never learns a receiver's bits from the system under test's own digests.

Engine mode (``nemo-dcr chaos --engine vllm``): every epoch starts from a checkpoint's weights
instead (a tiny Llama a real vLLM engine runs, :mod:`nemo_dcr.chaos.engine`), with no special
values planted (the engine computes with them); the updates are the same low-bit flips (the
low mantissa bits of bf16: no update makes a NaN or an infinity).
"""
from __future__ import annotations

import hashlib

import torch

# name -> (shape, dtype): an HF-style module's state_dict (see workers.TinyLM)
SHAPES = {
    "embed.weight": ((64, 16), torch.bfloat16),
    "proj.weight": ((32, 16), torch.bfloat16),
    "proj.bias": ((32,), torch.float32),
    "norm.weight": ((16,), torch.float16),
    "ids": ((8,), torch.int32),
}
WORLD = 2  # publisher ranks (gloo)


def _ints(t: torch.Tensor) -> torch.Tensor:
    from nemo_dcr.state.dtypes import int_view
    return int_view(t).view(-1)


def base_state(seed: int, epoch: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(hash_seed(seed, epoch, -1))
    st = {}
    for n, (shape, dt) in SHAPES.items():
        if dt.is_floating_point:
            t = torch.randn(shape, generator=g).to(dt)
            flat = _ints(t)
            # values a float comparison would get wrong: a NaN with a payload, -0.0, a subnormal
            flat[0] = {2: 0x7FC3, 4: 0x7FC00123}[t.element_size()]
            flat[1] = {2: -0x8000, 4: -0x80000000}[t.element_size()]  # the sign bit alone
            flat[2] = 1
        else:
            t = torch.randint(-1000, 1000, shape, generator=g, dtype=dt)
        st[n] = t
    return st


def hash_seed(*xs: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(xs).encode()).digest()[:7], "little")


def step(st: dict[str, torch.Tensor], seed: int, epoch: int, c: int) -> None:
    """Content c-1 -> c in place: flip low bits of ~5 % of the elements of every tensor."""
    g = torch.Generator().manual_seed(hash_seed(seed, epoch, c))
    for n in st:
        flat = _ints(st[n])
        mask = torch.rand(flat.shape, generator=g) < 0.05
        flat[mask] ^= torch.randint(1, 16, (int(mask.sum()),), generator=g, dtype=flat.dtype)


class Contents:
    """Every content of a run, computed forward once and kept (tiny tensors: ~10 KB each; the
    engine's checkpoint: ~1 MB). ``base``: every epoch starts from these tensors (engine mode)
    rather than from ``base_state``."""

    def __init__(self, seed: int, base: dict[str, torch.Tensor] | None = None):
        self.seed, self.base = seed, base
        self._cache: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def state(self, epoch: int, c: int) -> dict[str, torch.Tensor]:
        key = (epoch, c)
        if key not in self._cache:
            prev = [k for k in self._cache if k[0] == epoch and k[1] < c]
            if prev:
                start = max(prev)
                st = {n: t.clone() for n, t in self._cache[start].items()}
                first = start[1] + 1
            else:
                st = base_state(self.seed, epoch) if self.base is None else \
                    {n: t.clone() for n, t in self.base.items()}
                first = 1
            for i in range(first, c + 1):
                step(st, self.seed, epoch, i)
            self._cache[key] = st
        return self._cache[key]

    def raw(self, epoch: int, c: int) -> dict[str, bytes]:
        return raw_bytes(self.state(epoch, c))

    def forget_before(self, epoch: int, c: int) -> None:
        """Long runs: drop contents older than ``c`` (keeping one to step forward from)."""
        for k in [k for k in self._cache if k[0] < epoch or (k[0] == epoch and k[1] < c)]:
            del self._cache[k]


def raw_bytes(tensors) -> dict[str, bytes]:
    """name -> the tensor's raw bytes (its integer view, contiguous): what is compared."""
    return {n: _ints(t.detach().cpu().contiguous()).numpy().tobytes() for n, t in tensors.items()}


def fingerprint(raw: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for n in sorted(raw):
        h.update(n.encode() + b"\0" + hashlib.sha256(raw[n]).digest())
    return h.hexdigest()


def load_base(checkpoint: str) -> dict[str, torch.Tensor]:
    """Engine mode's base state: the checkpoint's tensors as saved (``model.safetensors``)."""
    import os

    from safetensors.torch import load_file
    return {n: t.contiguous() for n, t in sorted(load_file(os.path.join(checkpoint, "model.safetensors")).items())}


def shard_layout(rank: int, shapes: dict | None = None):
    """The trainer's sharding: embed by rows (vocab parallel), proj.weight by columns; the small
    tensors whole on one rank each. ``shapes`` (name -> shape, engine mode): matrices by rows,
    the others whole on one rank each, in turn."""
    from nemo_dcr.state.index_map import ShardSpec

    def split(shape, dim):
        n = shape[dim] // WORLD
        off, loc = [0] * len(shape), list(shape)
        off[dim], loc[dim] = rank * n, n
        return ShardSpec.of(shape, off, loc)

    if shapes is not None:
        whole = [n for n, sh in shapes.items() if len(sh) != 2]
        return {n: split(tuple(sh), 0) if len(sh) == 2 else ShardSpec.full(tuple(sh))
                for n, sh in shapes.items() if len(sh) == 2 or whole.index(n) % WORLD == rank}
    lay = {"embed.weight": split(SHAPES["embed.weight"][0], 0), "proj.weight": split(SHAPES["proj.weight"][0], 1)}
    owned = {0: ("proj.bias", "ids"), 1: ("norm.weight",)}[rank]
    for n in owned:
        lay[n] = ShardSpec.full(SHAPES[n][0])
    return lay


def local_shard(st: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    out = {}
    for n, spec in layout.items():
        sl = tuple(slice(o, o + s) for o, s in zip(spec.offsets, spec.shape))
        out[n] = st[n][sl].clone()
    return out
