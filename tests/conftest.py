import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def nemo_dcr_cmd():
    """The installed console script, next to the running interpreter."""
    exe = os.path.join(os.path.dirname(sys.executable), "nemo-dcr")
    assert os.path.exists(exe), "nemo-dcr console script not installed in this environment"
    return exe


# The S3 server and the store fixtures, shared by every module (one moto server per session).
from stores_fixtures import make_s3_store, moto_s3, store  # noqa: E402,F401
