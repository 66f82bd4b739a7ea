"""Decide, per tensor entry of a delta, what applying it does: the typed apply plan.

``plan_entry`` reads the receiver's tensor (digests only) and returns a ``Plan``; it changes
nothing, so every entry can be planned (and every base checked) before the first write.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from nemo_dcr.codec.header import TensorEntry, TensorKind
from nemo_dcr.errors import BaseMismatchError, DcrError
from nemo_dcr.state.digest import Place, tensor_digest_like
from nemo_dcr.state.index_map import ShardSpec


class Action(enum.Enum):
    APPLY = "apply"            # base verified: decode the chunks against it
    SKIP = "skip"              # already at the target (or nothing to do)
    RESUME = "resume"          # base unverified (resume, or verify off): chunks check their pre-images
    UNVERIFIED = "unverified"  # the receiver holds only part of the region: no digest can be checked
    CREATE = "create"          # a new tensor (or one of a new dtype/shape) built from a whole region
    OVERWRITE = "overwrite"    # a full region written over what the receiver holds
    REMOVE = "remove"          # the target lacks this tensor: the receiver drops it
    IGNORE = "ignore"          # nothing of it is held here

    @property
    def writes(self) -> bool:
        """Whether running the plan changes the receiver's tensors in place."""
        return self in (Action.APPLY, Action.RESUME, Action.UNVERIFIED, Action.CREATE, Action.OVERWRITE)


@dataclass(frozen=True)
class Plan:
    entry: TensorEntry
    tensor: torch.Tensor | None  # the receiver's tensor (None: it has none)
    recv: ShardSpec | None  # where the receiver's tensor sits in the canonical tensor
    region: ShardSpec | None  # the region the entry carries
    covered: bool  # the receiver holds the entry's whole region
    action: Action

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def checks_chunks(self) -> bool:
        """Each chunk's pre-image is checked against what is held before it is written."""
        return self.covered and self.action in (Action.APPLY, Action.RESUME)

    @property
    def held(self) -> torch.Tensor:
        """The receiver's tensor, for the plans that have one: all but an ``ignore`` of a removed tensor
        it lacks and a ``create`` of a new one."""
        assert self.tensor is not None, f"{self.name}: a {self.action.value} plan without the receiver's tensor"
        return self.tensor

    @property
    def sent(self) -> ShardSpec:
        """The region the entry carries (every entry but a removed one has one)."""
        assert self.region is not None, f"{self.name}: a removed entry carries no region"
        return self.region

    @property
    def target(self) -> str:
        """The entry's target digest (every entry but a removed one has one)."""
        assert self.entry.target_digest is not None, f"{self.name}: a removed entry has no target digest"
        return self.entry.target_digest

    @property
    def replaces(self) -> bool:
        """A ``create`` over a tensor the receiver holds with another dtype or shape."""
        return self.action == Action.CREATE and self.tensor is not None


def _removed_base(entry: TensorEntry, tensor: torch.Tensor, recv: ShardSpec | None) -> bool:
    """Whether the tensor a removed entry names holds the base its digest is of, where the
    receiver can tell: the whole tensor's, or the sender's part of it (``base_region``) where
    the receiver holds that part; True where it cannot (it holds another part)."""
    assert entry.base_digest is not None  # (the caller's condition)
    held = recv if recv is not None else ShardSpec.full(tensor.shape)
    where = entry.base_region
    if where is None:
        return not held.is_full or tensor_digest_like(tensor, entry.base_digest, Place(entry.name, recv)) \
            == entry.base_digest
    if tuple(held.global_shape) != tuple(where.global_shape) or not held.contains(where):
        return True
    return tensor_digest_like(held.view_of(tensor, where), entry.base_digest, Place(entry.name, where)) \
        == entry.base_digest


def plan_entry(entry: TensorEntry, tensor: torch.Tensor | None, recv: ShardSpec | None, *, verify: bool = True,
               resume: bool = False) -> Plan:
    """Decide what to do with one delta entry, checking the base. Mutates nothing."""
    name = entry.name
    if entry.kind == TensorKind.REMOVED:
        if tensor is not None and verify and entry.base_digest and not _removed_base(entry, tensor, recv):
            raise BaseMismatchError(f"{name}: the delta removes this tensor, but the receiver's is not the base's")
        return Plan(entry, tensor, recv, None, False, Action.REMOVE if tensor is not None else Action.IGNORE)
    dtype, region, target = entry.torch_dtype, entry.region, entry.target_digest
    assert region is not None and target is not None  # TensorEntry.parse: every entry but a removed one has both
    if entry.kind == TensorKind.FULL and (tensor is None or tensor.dtype != dtype
                                         or tuple((recv or ShardSpec.full(tensor.shape)).global_shape)
                                         != region.global_shape):
        # new tensor (or new dtype/shape): only a whole tensor can be created from a whole region
        if not region.is_full or (recv is not None and not recv.is_full):
            raise DcrError(f"{name}: the receiver has no matching tensor to write this shard into")
        return Plan(entry, tensor, recv, region, True, Action.CREATE)
    if tensor is None:
        raise BaseMismatchError(f"{name}: the delta changes this tensor but the receiver has none")
    if tensor.dtype != dtype:
        raise BaseMismatchError(f"{name}: receiver dtype {tensor.dtype} but the delta was built on {dtype}")
    if recv is None:
        recv = ShardSpec.full(tensor.shape)
    if tuple(tensor.shape) != recv.shape:
        raise DcrError(f"{name}: tensor shape {tuple(tensor.shape)} differs from its shard shape {recv.shape}")
    if tuple(recv.global_shape) != tuple(region.global_shape):
        raise BaseMismatchError(f"{name}: receiver's global shape {recv.global_shape} but the delta's is "
                                f"{region.global_shape}")
    covered = recv.contains(region)
    if not covered and not recv.overlaps(region):
        return Plan(entry, tensor, recv, region, False, Action.IGNORE)
    if entry.kind == TensorKind.FULL:  # the region's whole content, written over whatever is there
        if covered and verify \
                and tensor_digest_like(recv.view_of(tensor, region), target, Place(name, region)) == target:
            return Plan(entry, tensor, recv, region, True, Action.SKIP)
        return Plan(entry, tensor, recv, region, covered, Action.OVERWRITE)
    if not covered:
        return Plan(entry, tensor, recv, region, False, Action.UNVERIFIED)
    if not verify:
        return Plan(entry, tensor, recv, region, True, Action.RESUME)
    assert entry.base_digest is not None  # TensorEntry.parse: a delta entry has one (full ones returned above)
    d = tensor_digest_like(recv.view_of(tensor, region), entry.base_digest, Place(name, region))
    if d == entry.base_digest:
        action = Action.APPLY if entry.chunks else Action.SKIP
    elif d == entry.target_digest:
        action = Action.SKIP
    elif resume:
        action = Action.RESUME
    else:
        raise BaseMismatchError(f"{name}: receiver tensor is not the base this delta was built from "
                                f"(digest {d}, expected {entry.base_digest})")
    return Plan(entry, tensor, recv, region, True, action)

