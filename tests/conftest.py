"""Shared pytest set-up: environment, per-test seeding, the ``gpu`` marker and the shape tier.

The environment defaults are set when this module is imported, i.e. before any test module (or
``tileproof.optimized``) imports TileLang, which reads its cache location at import time.
"""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The TileLang kernel cache lives inside the checkout (git-ignored), so that test runs neither
# write to the home directory nor share stale kernels between checkouts.
os.environ.setdefault("TILEPROOF_CACHE_DIR", str(REPO_ROOT / ".tilelang-cache"))
os.environ.setdefault("TILELANG_CACHE_DIR", os.environ["TILEPROOF_CACHE_DIR"])
os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda").exists():
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import pytest  # noqa: E402
import torch  # noqa: E402

TIERS = ("quick", "full")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        action="store",
        default="quick",
        choices=TIERS,
        help="shape tier of the parametrized tests: quick (CI-sized, default) or full (every shape)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def seed_of(nodeid: str) -> int:
    """A seed that depends only on the test's node id (stable across runs, processes, machines)."""
    return zlib.crc32(nodeid.encode("utf-8"))


@pytest.fixture(autouse=True)
def _seed_everything(request: pytest.FixtureRequest) -> int:
    seed = seed_of(request.node.nodeid)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device when there is one
    return seed


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """The test's own seed (the one the autouse fixture used)."""
    return seed_of(request.node.nodeid)


@pytest.fixture
def generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from the test's node id."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def tier(request: pytest.FixtureRequest) -> str:
    """``"quick"`` or ``"full"``, from ``--tier`` (default quick)."""
    return request.config.getoption("--tier")
