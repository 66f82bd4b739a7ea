"""The fault campaign in engine mode (``nemo-dcr chaos --engine vllm``): a real vLLM engine is the
receiver, refitted from the campaign's store (local directory or the S3 server behind the fault
proxy, directly or through a relay), its weights read back bit for bit and compared with the
harness's own ground truth. Every run here SIGKILLs the engine's process mid-refit
(``kill_engine``): a fresh engine started on the base checkpoint must converge to HEAD with 0
silent corruptions; the self-test shows the comparison sees a bit flipped in the engine's own
weights after a verified refit. Runs in the vLLM venv (``make test-vllm``); skipped elsewhere."""
import pytest

from dcr_testing import vllm_models as vm

vm.require_vllm()
pytestmark = pytest.mark.xdist_group("chaos")  # one module fixture: one test process
pytest.importorskip("moto.moto_server.werkzeug_app", reason="the campaign needs moto[server]")
pytest.importorskip("aiohttp", reason="the campaign needs aiohttp")

from nemo_dcr.chaos.campaign import Campaign  # noqa: E402


@pytest.fixture(scope="module")
def campaign():
    c = Campaign(fast=True, engine="vllm")  # one engine start; each kill starts another
    yield c
    c.close()


def test_engine_killed_mid_refit_restarts_and_converges(campaign):
    out = campaign.batch(2, seed=11, force=("kill_engine",))
    assert out["runs"] == 2 and not out["aborted"], out["aborted"]
    assert out["silent_corruptions"] == 0 and not out["violations"], out["violations"]
    assert out["faults"]["kill_engine"] == 2 and out["engine_restarts"] == 2
    assert out["converged"] + out["converged_after_keyframe"] == 2 and out["not_converged"] == 0
    assert out["bit_checks"] >= 4


def test_engine_sabotage_is_seen(campaign):
    out = campaign.batch(1, seed=12, sabotage="flip-after-update")
    assert out["silent_corruptions"] > 0, out
