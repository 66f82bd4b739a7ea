"""Rollout receivers at the edges a new user meets (issue 22): a mistyped store path, a
publisher and receiver that disagree on names or dtypes."""
import os

import pytest
import torch

from dcr_testing import assert_bits_equal
from nemo_dcr.errors import DcrError, PartialApplyError, StoreError
from nemo_dcr.integrations import RolloutLoader
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher


class Inner(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8, dtype=dtype)
        self.proj = torch.nn.Linear(8, 8, dtype=dtype)


class Wrapper(torch.nn.Module):
    """What a LightningModule holding a Hugging Face model as ``self.model`` publishes."""

    def __init__(self):
        super().__init__()
        self.model = Inner()


def test_a_mistyped_local_store_path_is_refused_not_created(tmp_path):
    missing = tmp_path / "runs" / "rnu1"
    for make in (lambda: RolloutLoader(str(missing), Inner()),
                 lambda: Follower(str(missing), {}),
                 lambda: Follower(missing, {}),
                 lambda: Follower(f"file://{missing}", {}),
                 lambda: Follower([str(missing)], {})):
        with pytest.raises(StoreError, match="does not exist"):
            make()
        assert not os.path.exists(missing) and not os.path.exists(tmp_path / "runs")
    Publisher(str(missing)).publish({"w": torch.ones(3)})  # a publisher creates its store
    assert Follower(str(missing), {}).sync().version == 0


def snapshot(module, dtype=None):
    return {k: (v.to(dtype) if dtype else v).detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("case", ["prefixed names", "dtype"])
def test_a_version_that_does_not_fit_says_what_differs_and_changes_nothing(tmp_path, case):
    """It used to raise PartialApplyError ('apply stopped after changing tensors in place ...
    resume=True') though nothing had been written."""
    torch.manual_seed(0)
    store = str(tmp_path / "store")
    recv = Inner(torch.bfloat16)
    before = snapshot(recv)
    if case == "prefixed names":
        published = snapshot(Wrapper(), torch.bfloat16)
        words = ["nothing was changed", "'model.'", "submodule='model'", "removeprefix('model.')"]
    else:
        published = snapshot(Inner())  # float32 published, bfloat16 receiver
        words = ["nothing was changed", "float32", "bfloat16", "dtype='bfloat16'"]
    Publisher(store).publish(published)
    loader = RolloutLoader(store, recv)
    for _ in range(2):  # and again: still nothing half-done to resume
        with pytest.raises(DcrError) as ei:
            loader.update()
        assert not isinstance(ei.value, PartialApplyError)
        for w in words:
            assert w in str(ei.value), str(ei.value)
        for k, v in snapshot(recv).items():
            assert_bits_equal(v, before[k], k)
        assert loader.version is None
