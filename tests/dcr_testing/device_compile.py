"""Compile every device-path Triton kernel for a GPU target without a GPU (Triton's own LLVM
and ptxas: source -> TTIR -> TTGIR -> LLVM IR -> PTX -> cubin), for each element width and
``classes`` dtype the wrappers launch them with. What ``nvcc -c`` would be for CUDA sources:
it catches what the CPU interpreter does not (types, layouts, the lowering to PTX).

    python -m dcr_testing.device_compile [--arch 90 80]     # TRITON_INTERPRET must be unset

Prints one line per kernel and exits non-zero on the first failure.
"""
import argparse
import os
import sys
import time


def variants():
    """(kernel name, signature, constexprs) of every launch the wrappers make."""
    from nemo_dcr.codec.classes import MANTISSA
    view = {1: "*u8", 2: "*i16", 4: "*i32", 8: "*i64"}
    for p in view.values():
        yield f"diff_compact_kernel[{p[1:]}]", dict(old_ptr=p, new_ptr=p, n="i64", chunk="i64", bpc="i32",
                                          pos_ptr="*i64", oldv_ptr=p, newv_ptr=p, cap="i64", ctr_ptr="*i64",
                                          boff_ptr="*i64",
                                          bcnt_ptr="*i32", BLOCK="constexpr"), dict(BLOCK=1024)
        yield f"preimage_check_kernel[{p[1:]}]", dict(target_ptr=p, pos_ptr="*i64", pre_ptr=p, k="i64", bad_ptr="*i32",
                                            BLOCK="constexpr"), dict(BLOCK=1024)
        yield f"scatter_kernel[{p[1:]}]", dict(target_ptr=p, pos_ptr="*i64", val_ptr=p, k="i64", BLOCK="constexpr"), \
            dict(BLOCK=1024)
    for dt, mant in MANTISSA.items():
        w = dt.itemsize
        p = view[w]
        yield f"class_rank_kernel[{str(dt).removeprefix('torch.')}]", dict(
            old_ptr=p, n="i64", chunk="i64", bpc="i32", lohi_ptr="*i64", pos_ptr="*i64", oldv_ptr=p,
            boff_ptr="*i64", bcnt_ptr="*i32", hist_ptr="*i32", within_ptr="*i32", W="constexpr",
            MANT="constexpr", RB="constexpr", BLOCK="constexpr", G="constexpr"), \
            dict(W=w, MANT=mant, RB=16, BLOCK=1024, G=16)
    # device/blake3.py: the tensor digest on the device
    yield "blake3.chunk_kernel", dict(src_ptr="*u8", nbytes="i64", nchunks="i64", counter0="i64", cv_ptr="*i32",
                                      root="i32", LANES="constexpr"), dict(LANES=64)
    yield "blake3.parent_kernel", dict(cv_ptr="*i32", n="i64", out_ptr="*i32", root="i32", LANES="constexpr"), \
        dict(LANES=64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90])
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("device_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nemo_dcr.device import blake3, kernels
    for arch in args.arch:
        for name, sig, const in variants():
            module, _, attr = name.split("[")[0].rpartition(".")
            fn = getattr(blake3 if module == "blake3" else kernels, attr)
            t0 = time.perf_counter()
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32))
            print(f"sm_{arch} {name:40s} cubin {len(k.asm['cubin']):7d} B  {time.perf_counter() - t0:5.1f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
