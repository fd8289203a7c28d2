"""`deepinfer convert` checks OUT before it converts anything."""

from __future__ import annotations

import pytest

from deepinfer.core.errors import ConversionError
from deepinfer.core.weights.convert import run


@pytest.mark.parametrize("target", ["missing", "existing"])
def test_an_output_that_is_a_symlink_is_refused_before_the_source_is_opened(tmp_path, monkeypatch, target):
    """A dangling link used to pass the existence check (it follows the link), so the whole conversion ran
    before the final rename failed on it."""
    def no_conversion(*args, **kwargs):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(run, "open_source", no_conversion)
    pointed = tmp_path / "elsewhere"
    if target == "existing":
        pointed.mkdir()
    out = tmp_path / "out"
    out.symlink_to(pointed)
    with pytest.raises(ConversionError, match="is a symbolic link") as raised:
        run.convert_checkpoint(tmp_path, out)
    assert "nothing was written" in str(raised.value)
    assert out.is_symlink() and pointed.exists() == (target == "existing")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out"] + (["elsewhere"] if target == "existing" else []))
