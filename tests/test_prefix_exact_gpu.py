"""Prefix-cache exactness on the GPU: the same sessions as test_prefix_exact.py, with the pools on
CUDA and the data path's Triton kernels (impl "auto"): a hit then its suffix read what the cold twin
reads, integrity after every operation."""

import pytest

from prefix_session import scripted


@pytest.mark.gpu
def test_scripted_session_on_the_gpu_triton_path():
    s = scripted(device="cuda", impl="auto")
    assert s.hits == 2


@pytest.mark.gpu
def test_property_sessions_on_the_gpu_triton_path():
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from test_prefix_exact import SLOW, run_session

    @settings(max_examples=6, deadline=None, suppress_health_check=SLOW, database=None)
    @given(data=st.data())
    def sessions(data):
        run_session(data, 3, device="cuda", impl="auto")

    sessions()
