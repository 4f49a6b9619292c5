import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Four real servers at once: run with `make soak` (SOAK_SYNCS set), not in `make test`.
collect_ignore = [] if os.environ.get("SOAK_SYNCS") else ["test_disk_fanout.py"]
# A fleet of real servers following a version store: `make soak-fleet` (FLEET_SYNCS set), not `make test`.
collect_ignore += [] if os.environ.get("FLEET_SYNCS") else ["test_soak_fleet.py"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 server (SeaweedFS) for one test module."""
    from store_server import SeaweedS3

    server = SeaweedS3(str(tmp_path_factory.mktemp("seaweed")))
    yield server
    server.stop()


@pytest.fixture(params=["posix", "s3"])
def store_url(request, tmp_path):
    """A fresh version store: a directory, then a prefix of the S3 server's bucket."""
    if request.param == "posix":
        os.makedirs(tmp_path / "store")
        return str(tmp_path / "store")
    return request.getfixturevalue("s3").url()
