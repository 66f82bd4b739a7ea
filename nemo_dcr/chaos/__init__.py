"""The fault campaign (``nemo-dcr chaos``): randomized end-to-end runs of publisher ranks, a
store (local directory or an S3 server behind a fault-injecting proxy), relays and followers,
with faults injected at random points and every receiver's bits compared with ground truth the
harness keeps itself. A testing tool, not a runtime path: nothing else imports it.
Needs ``pip install "nemo-dcr[chaos]"`` (boto3, moto's server, aiohttp)."""
from __future__ import annotations

__all__ = ["run_campaign", "long_run", "FAULTS"]


def __getattr__(name):
    if name in __all__:
        from nemo_dcr.chaos import campaign
        return getattr(campaign, name)
    raise AttributeError(name)
