import os
import tempfile

import pytest
import torch

# Every test (and every subprocess a test starts) uses a private, throwaway trust store: the
# Recorder marks the bundles it writes as trusted there, never in the developer's ~/.nanreplay.
if not os.environ.get("NANREPLAY_TEST_KEEP_HOME"):
    os.environ["NANREPLAY_HOME"] = tempfile.mkdtemp(prefix="nanreplay-test-home-")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    yield


@pytest.fixture
def out_dir(tmp_path):
    return tmp_path / "bundles"
