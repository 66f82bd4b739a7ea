"""Shard layouts for tests."""
import itertools

from nemo_dcr import ShardSpec


def grid(global_shape, splits):
    """Cartesian split: ``splits`` maps dim -> number of (possibly uneven) pieces."""
    per_dim = []
    for d, n in enumerate(global_shape):
        k = splits.get(d, 1)
        b = [n * r // k for r in range(k + 1)]
        per_dim.append([(b[r], b[r + 1] - b[r]) for r in range(k)])
    return [ShardSpec.of(global_shape, [p[0] for p in c], [p[1] for p in c])
            for c in itertools.product(*per_dim)]


def cut(t, spec):
    """The part of the full tensor ``t`` that ``spec`` holds."""
    return t[ShardSpec.full(spec.global_shape).slices_of(spec)]
