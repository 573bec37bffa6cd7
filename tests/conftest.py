import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="session")
def digits_bundle(tmp_path_factory) -> Path:
    """The built-in example's bundle (examples/digits_nan.py), written once per test session."""
    pytest.importorskip("sklearn")
    spec = importlib.util.spec_from_file_location("digits_nan_example", ROOT / "examples" / "digits_nan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("digits")
    assert mod.main(["--out-dir", str(out)]) == 0
    (bundle,) = out.glob("nanreplay-step*.h5")
    return bundle


# -- the shared failure scenarios (tests/scenarios.py), one fixture each ------------------------

@pytest.fixture
def nested_div_bundle(out_dir) -> Path:
    """0/0 born in the forward pass of ``encoder.block.norm``, sample 2 (scenarios.division_by_zero_in_a_submodule)."""
    import scenarios

    return Path(scenarios.division_by_zero_in_a_submodule(out_dir).bundle_path)


@pytest.fixture
def sqrt_bundle(out_dir) -> Path:
    """+Inf born in backward of sqrt at 0, module ``root``, sample 1 (scenarios.sqrt_at_zero)."""
    import scenarios

    return Path(scenarios.sqrt_at_zero(out_dir).bundle_path)


@pytest.fixture
def unreproducible_bundle(out_dir) -> Path:
    """A NaN gradient written after backward: the replay says ``not reproduced`` (scenarios.unreproducible)."""
    import scenarios

    return Path(scenarios.unreproducible(out_dir).bundle_path)


@pytest.fixture(scope="session")
def autocast_runs(tmp_path_factory) -> tuple[Path, Path]:
    """(A, B): the float16 run's bundle of its failing step 22 and the bfloat16 run's spike bundle
    of the same step (examples/amp_config.py, scenarios.autocast_run), in ``<tmp>/runs/fp16`` and
    ``<tmp>/runs/bf16``: two runs that differ in the autocast dtype alone."""
    import scenarios

    root = tmp_path_factory.mktemp("amp")
    (a,) = scenarios.autocast_run(root / "runs" / "fp16", "float16")
    (b,) = scenarios.autocast_run(root / "runs" / "bf16", "bfloat16")
    assert a.name == "nanreplay-step22.h5" and b.name == "nanreplay-spike-step22.h5"
    return a, b
