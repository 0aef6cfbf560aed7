"""`kernels` is also the module name of Hugging Face's `kernels` distribution: where both are
installed, transformers imports ours in its place. Its names must fail saying so and what to
do; any other missing name stays a plain AttributeError (hasattr and friends keep working)."""

from __future__ import annotations

import pytest

import kernels


def test_hub_kernels_names_explain_the_clash():
    with pytest.raises(ImportError, match="Hugging Face's `kernels` package.*own"):
        from kernels import CUDAProperties  # noqa: F401


def test_other_names_are_attribute_errors():
    assert not hasattr(kernels, "no_such_kernel")
