"""``state/digest.tensor_digest`` (BLAKE3) of a tensor where it lives: Triton kernels over the
device's memory, 16 bytes to the host.

    tensor_digest(t)   # == nemo_dcr.state.digest.tensor_digest(t, "blake3"), t a CUDA tensor

The delta header names each tensor's BLAKE3 digest (docs/format.md, "Digests"), over
``dtype|shape|`` and the tensor's bytes. Hashed on the host, a device tensor crossed to the host
whole at every publish (O(model) device-to-host bytes per version, the one the device path had
left, docs/design.md). BLAKE3 is a tree hash: 1 KiB chunks are compressed independently (their
chaining values), then pairs of chaining values are merged up to the root. So the chunks run as
parallel lanes on the device (``chunk_kernel``: 16 64-byte blocks each, 7 rounds of the
compression function per block), and the tree is merged level by level (``parent_kernel``, one
launch per level, log2(chunks) of them: pairwise with an odd one carried up, which is BLAKE3's
left-complete tree). Only the root's first 16 bytes come to the host.

The message is the prefix (~20 bytes, made on the host) and then the tensor's bytes, so chunk 0
holds the prefix and the first bytes of the tensor: it is hashed from a small device buffer
(prefix, then those bytes, copied on the device); chunks 1.. read the tensor's bytes in place.
Checked against the ``blake3`` package (tests/test_device_digest.py, under TRITON_INTERPRET=1 on
CPU tensors; tests/gpu/run_gpu.py on a GPU).
"""
from __future__ import annotations

import torch

from nemo_dcr.device import kernels
from nemo_dcr.errors import DcrError
from nemo_dcr.state.dtypes import dtype_name

CHUNK = 1024
LANES = 64  # chunks per program
IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
CHUNK_START, CHUNK_END, PARENT, ROOT = 1, 2, 4, 8

try:  # optional: the ``gpu`` extra (kernels.available() says whether it is there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _rotr(x, n: tl.constexpr):
        return (x >> n) | (x << (32 - n))

    @triton.jit
    def _g(a, b, c, d, x, y):
        a = a + b + x
        d = _rotr(d ^ a, 16)
        c = c + d
        b = _rotr(b ^ c, 12)
        a = a + b + y
        d = _rotr(d ^ a, 8)
        c = c + d
        b = _rotr(b ^ c, 7)
        return a, b, c, d

    @triton.jit
    def _round(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
               m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15):
        s0, s4, s8, s12 = _g(s0, s4, s8, s12, m0, m1)
        s1, s5, s9, s13 = _g(s1, s5, s9, s13, m2, m3)
        s2, s6, s10, s14 = _g(s2, s6, s10, s14, m4, m5)
        s3, s7, s11, s15 = _g(s3, s7, s11, s15, m6, m7)
        s0, s5, s10, s15 = _g(s0, s5, s10, s15, m8, m9)
        s1, s6, s11, s12 = _g(s1, s6, s11, s12, m10, m11)
        s2, s7, s8, s13 = _g(s2, s7, s8, s13, m12, m13)
        s3, s4, s9, s14 = _g(s3, s4, s9, s14, m14, m15)
        return s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15

    @triton.jit
    def _compress(h0, h1, h2, h3, h4, h5, h6, h7,
                  m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
                  counter, block_len, flags):
        """BLAKE3's compression function on lanes of uint32 -> the 8 words of the new chaining
        value (the output's first 8 words: the digest bytes, at the root)."""
        z = h0 * 0
        s0, s1, s2, s3, s4, s5, s6, s7 = h0, h1, h2, h3, h4, h5, h6, h7
        s8 = z + 0x6A09E667
        s9 = z + 0xBB67AE85
        s10 = z + 0x3C6EF372
        s11 = z + 0xA54FF53A
        s12 = z + (counter & 0xFFFFFFFF).to(tl.uint32)
        s13 = z + (counter >> 32).to(tl.uint32)
        s14 = z + block_len.to(tl.uint32)
        s15 = z + flags.to(tl.uint32)
        for _ in range(7):  # a loop, not unrolled: the kernel stays small to compile
            s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
                s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
                m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15)
            # the message permutation (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = \
                m2, m6, m3, m10, m7, m0, m4, m13, m1, m11, m12, m5, m9, m14, m15, m8
        return s0 ^ s8, s1 ^ s9, s2 ^ s10, s3 ^ s11, s4 ^ s12, s5 ^ s13, s6 ^ s14, s7 ^ s15

    @triton.jit
    def _word(src, base, o: tl.constexpr, lim):
        """Little-endian uint32 of the bytes at base + o .. o + 3; bytes at or past ``lim``
        (relative to base) read as 0 (the zero padding of a short block)."""
        b0 = tl.load(src + base + o, mask=o < lim, other=0).to(tl.uint32)
        b1 = tl.load(src + base + (o + 1), mask=o + 1 < lim, other=0).to(tl.uint32)
        b2 = tl.load(src + base + (o + 2), mask=o + 2 < lim, other=0).to(tl.uint32)
        b3 = tl.load(src + base + (o + 3), mask=o + 3 < lim, other=0).to(tl.uint32)
        return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)

    @triton.jit
    def chunk_kernel(src_ptr, nbytes, nchunks, counter0, cv_ptr, root, LANES: tl.constexpr):
        """The chaining values of ``nchunks`` 1 KiB chunks of ``src`` (``nbytes`` bytes; the last
        chunk may be short), chunk j numbered ``counter0 + j``, into cv[counter0 + j, 0:8].
        ``root``: the message is this one chunk (its last block is the root)."""
        j = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
        live = j < nchunks
        start = j * 1024
        clen = tl.where(live, tl.minimum(nbytes - start, 1024), 0)
        nblk = tl.maximum((clen + 63) // 64, 1)
        h0 = tl.full([LANES], 0x6A09E667, tl.uint32)
        h1 = tl.full([LANES], 0xBB67AE85, tl.uint32)
        h2 = tl.full([LANES], 0x3C6EF372, tl.uint32)
        h3 = tl.full([LANES], 0xA54FF53A, tl.uint32)
        h4 = tl.full([LANES], 0x510E527F, tl.uint32)
        h5 = tl.full([LANES], 0x9B05688C, tl.uint32)
        h6 = tl.full([LANES], 0x1F83D9AB, tl.uint32)
        h7 = tl.full([LANES], 0x5BE0CD19, tl.uint32)
        counter = counter0 + j
        for b in range(16):
            base = start + b * 64
            blen = tl.minimum(tl.maximum(clen - b * 64, 0), 64)
            lim = tl.where(live, blen, 0)
            last = b == nblk - 1
            flags = tl.where(last, 2, 0) + tl.where(last & (root != 0), 8, 0) + tl.where(b == 0, 1, 0)
            c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
                h0, h1, h2, h3, h4, h5, h6, h7,
                _word(src_ptr, base, 0, lim), _word(src_ptr, base, 4, lim), _word(src_ptr, base, 8, lim),
                _word(src_ptr, base, 12, lim), _word(src_ptr, base, 16, lim), _word(src_ptr, base, 20, lim),
                _word(src_ptr, base, 24, lim), _word(src_ptr, base, 28, lim), _word(src_ptr, base, 32, lim),
                _word(src_ptr, base, 36, lim), _word(src_ptr, base, 40, lim), _word(src_ptr, base, 44, lim),
                _word(src_ptr, base, 48, lim), _word(src_ptr, base, 52, lim), _word(src_ptr, base, 56, lim),
                _word(src_ptr, base, 60, lim), counter, blen, flags)
            act = b < nblk  # a chunk of n blocks stops after its n-th
            h0 = tl.where(act, c0, h0)
            h1 = tl.where(act, c1, h1)
            h2 = tl.where(act, c2, h2)
            h3 = tl.where(act, c3, h3)
            h4 = tl.where(act, c4, h4)
            h5 = tl.where(act, c5, h5)
            h6 = tl.where(act, c6, h6)
            h7 = tl.where(act, c7, h7)
        out = cv_ptr + (counter0 + j) * 8
        tl.store(out + 0, h0.to(tl.int32, bitcast=True), mask=live)
        tl.store(out + 1, h1.to(tl.int32, bitcast=True), mask=live)
        tl.store(out + 2, h2.to(tl.int32, bitcast=True), mask=live)
        tl.store(out + 3, h3.to(tl.int32, bitcast=True), mask=live)
        tl.store(out + 4, h4.to(tl.int32, bitcast=True), mask=live)
        tl.store(out + 5, h5.to(tl.int32, bitcast=True), mask=live)
        tl.store(out + 6, h6.to(tl.int32, bitcast=True), mask=live)
        tl.store(out + 7, h7.to(tl.int32, bitcast=True), mask=live)

    @triton.jit
    def _cv(p, i: tl.constexpr, mask):
        return tl.load(p + i, mask=mask, other=0).to(tl.uint32, bitcast=True)

    @triton.jit
    def parent_kernel(cv_ptr, n, out_ptr, root, LANES: tl.constexpr):
        """One level of the tree: out[i] = parent(cv[2i], cv[2i + 1]); an odd last one is
        carried up unchanged. ``root``: this level has one parent, the root."""
        i = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
        live = i < (n + 1) // 2
        pair = live & (2 * i + 1 < n)
        lp = cv_ptr + 2 * i * 8
        rp = lp + 8
        l0, l1, l2, l3 = _cv(lp, 0, live), _cv(lp, 1, live), _cv(lp, 2, live), _cv(lp, 3, live)
        l4, l5, l6, l7 = _cv(lp, 4, live), _cv(lp, 5, live), _cv(lp, 6, live), _cv(lp, 7, live)
        r0, r1, r2, r3 = _cv(rp, 0, pair), _cv(rp, 1, pair), _cv(rp, 2, pair), _cv(rp, 3, pair)
        r4, r5, r6, r7 = _cv(rp, 4, pair), _cv(rp, 5, pair), _cv(rp, 6, pair), _cv(rp, 7, pair)
        z = l0 * 0
        flags = tl.where(root != 0, 4 + 8, 4) + (i * 0).to(tl.int32)
        p0, p1, p2, p3, p4, p5, p6, p7 = _compress(
            z + 0x6A09E667, z + 0xBB67AE85, z + 0x3C6EF372, z + 0xA54FF53A,
            z + 0x510E527F, z + 0x9B05688C, z + 0x1F83D9AB, z + 0x5BE0CD19,
            l0, l1, l2, l3, l4, l5, l6, l7, r0, r1, r2, r3, r4, r5, r6, r7, i * 0, flags * 0 + 64, flags)
        op = out_ptr + i * 8
        tl.store(op + 0, tl.where(pair, p0, l0).to(tl.int32, bitcast=True), mask=live)
        tl.store(op + 1, tl.where(pair, p1, l1).to(tl.int32, bitcast=True), mask=live)
        tl.store(op + 2, tl.where(pair, p2, l2).to(tl.int32, bitcast=True), mask=live)
        tl.store(op + 3, tl.where(pair, p3, l3).to(tl.int32, bitcast=True), mask=live)
        tl.store(op + 4, tl.where(pair, p4, l4).to(tl.int32, bitcast=True), mask=live)
        tl.store(op + 5, tl.where(pair, p5, l5).to(tl.int32, bitcast=True), mask=live)
        tl.store(op + 6, tl.where(pair, p6, l6).to(tl.int32, bitcast=True), mask=live)
        tl.store(op + 7, tl.where(pair, p7, l7).to(tl.int32, bitcast=True), mask=live)


def _launch_chunks(src: torch.Tensor, counter0: int, cv: torch.Tensor, root: bool, lanes: int) -> int:
    nbytes = src.numel()
    n = max(-(-nbytes // CHUNK), 1)
    chunk_kernel[(-(-n // lanes),)](src, nbytes, n, counter0, cv, int(root), LANES=lanes)
    return n


def root_words(data: torch.Tensor, prefix: bytes, lanes: int = LANES) -> torch.Tensor:
    """The first 8 words of BLAKE3(prefix + bytes of ``data``), an int32 tensor where ``data``
    is (``data``: 1-D uint8, contiguous). ``lanes``: chunks (and parents) per program, a power
    of two (the tests take 2, to run several programs on few chunks)."""
    if not kernels.available():
        raise DcrError('the device digest needs triton: pip install "nemo-dcr[gpu]"')
    dev = data.device
    total = len(prefix) + data.numel()
    nchunks = max(-(-total // CHUNK), 1)
    # chunk 0 (and any other the prefix reaches): the prefix, then the tensor's first bytes up
    # to the next chunk boundary, in a small buffer on the device; the rest read in place
    k = min(data.numel(), (-len(prefix)) % CHUNK)
    head = torch.cat([torch.tensor(list(prefix), dtype=torch.uint8).to(dev), data[:k]])
    cv = torch.empty((nchunks, 8), dtype=torch.int32, device=dev)
    h = _launch_chunks(head, 0, cv, nchunks == 1, lanes)
    if h < nchunks:
        _launch_chunks(data[k:], h, cv, False, lanes)
    n = nchunks
    while n > 1:
        m = -(-n // 2)
        out = torch.empty((m, 8), dtype=torch.int32, device=dev)
        parent_kernel[(-(-m // lanes),)](cv, n, out, int(n == 2), LANES=lanes)
        cv, n = out, m
    return cv[0]


def tensor_digest(t: torch.Tensor, lanes: int = LANES) -> str:
    """``state.digest.tensor_digest(t, "blake3")``, hashed where ``t`` is; 16 bytes cross to the
    host. A non-contiguous ``t`` is copied on its device first."""
    from nemo_dcr.device.diff import bits
    prefix = f"{dtype_name(t.dtype)}|{list(t.shape)}|".encode()
    data = bits(t.detach().contiguous()).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8,
                                                                                        device=t.device)
    words = root_words(data, prefix, lanes)[:4].cpu()
    return "blake3:" + words.numpy().astype("<u4").tobytes().hex()
