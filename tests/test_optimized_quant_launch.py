"""CPU tests of the per-token cast launcher's row slicing (``tileproof.optimized.quant.per_token``).

Rows sit on grid y, which stops at 65535, so longer inputs are launched in slices of rows, each
on views that start at the slice's first row. The kernel is replaced by a recorder (nothing runs on
the CPU) and the plan is made directly (``_cast_plan``: no plan cache is touched); the H200 checks
the results of such launches bitwise (``tests/test_gpu_quant.py``).
"""

import pytest
import torch

from tileproof.optimized.quant import per_token


def _record_launches(monkeypatch, factory_name):
    launches = []

    def factory(*args, **kwargs):
        return lambda *arguments: launches.append(arguments)

    monkeypatch.setattr(per_token, factory_name, factory)
    monkeypatch.setattr(per_token, "require_cuda", lambda name, tensor: None)
    return launches


@pytest.mark.parametrize("tokens", [1, 65535, 65536, 140000])
@pytest.mark.parametrize("packed", [False, True])
def test_rows_beyond_grid_y_go_in_slices_that_cover_each_row_once(monkeypatch, tokens, packed):
    launches = _record_launches(monkeypatch, "per_token_cast_kernel")
    hidden, channels = 256, 128
    x = torch.empty((tokens, hidden + 64), dtype=torch.bfloat16)[:, :hidden]
    # Column-major scales (rows padded to 4): fp32, or packed int32 words [T, kwords].
    run = per_token._cast_plan(x, per_token.MODE_CAST, "e4m3", channels, None, True, False, packed)
    q, sf = run(x)
    slices = [arguments[3] for arguments in launches]
    assert sum(slices) == tokens and all(0 < rows <= 65535 for rows in slices)  # CUDA: grid y <= 65535
    first = 0
    for arguments, rows in zip(launches, slices, strict=True):
        x_argument, q_argument, sf_argument = arguments[:3]
        assert x_argument.data_ptr() == x[first:].data_ptr()  # each slice starts at its first row
        assert q_argument.data_ptr() == q[first:].data_ptr()
        assert sf_argument.data_ptr() == sf[first:].data_ptr()
        first += rows


def test_sf_only_slices_the_scales_and_keeps_the_empty_codes(monkeypatch):
    launches = _record_launches(monkeypatch, "per_token_cast_kernel")
    tokens, hidden = 70000, 64
    x = torch.empty((tokens, hidden), dtype=torch.float32)
    _, sf = per_token._cast_plan(x, per_token.MODE_SF_ONLY, "e2m1", 32, None, False, False, False)(x)
    assert [arguments[3] for arguments in launches] == [65535, tokens - 65535]
    assert launches[1][2].data_ptr() == sf[65535:].data_ptr() and launches[1][1].numel() == 0
