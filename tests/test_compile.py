"""Every kernel configuration the oracle registers compiles for sm_90a, on any machine.

A CPU machine cannot launch a kernel, but TileLang lowers and compiles it to a cubin without a
GPU; this is what keeps a kernel that no longer builds from landing. The kernel cache lives inside
the checkout (``.tilelang-cache``, set by conftest), so repeated runs are fast.
"""

import pytest

from tileproof.optimized.jit import compile_target
from tileproof.oracle.runner import compile_all

PROFILES = ("quick", "full")


@pytest.mark.compile
@pytest.mark.parametrize("profile", PROFILES)
def test_every_registered_kernel_configuration_compiles(profile):
    failures = compile_all(profile)
    details = "\n".join(f"{failure.label}: {failure.error}" for failure in failures[:10])
    assert not failures, f"{len(failures)} configurations failed to compile:\n{details}"


def test_kernels_target_hopper_without_a_gpu():
    target = compile_target()
    assert target["kind"] == "cuda"
    assert target["arch"] in ("sm_90a", "sm_100a") or target["arch"].startswith("sm_")
