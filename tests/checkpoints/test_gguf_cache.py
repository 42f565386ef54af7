"""Cached GGUF conversions (weights and tokenizer) cannot hide a change of the converting code, and test
runs never share a cache."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from dflax import paths
from dflax.checkpoints import gguf_file, model_files, tokenizer
from dflax.checkpoints.hf_dir import read_hf_dir


def test_each_run_converts_into_its_own_empty_cache():
    """conftest points DFLAX_CACHE at a fresh temporary directory, never the user's ~/.cache/dflax."""
    cache = paths.cache_dir()
    assert cache.parent == Path(tempfile.gettempdir()) and cache.name.startswith("dflax-test-cache-")
    assert cache != Path.home() / ".cache" / "dflax"


def test_xdist_workers_share_the_cache_their_controller_made():
    """Under xdist the controller makes the run's cache and the workers inherit it (conftest), so a GGUF
    is converted once per run; a worker making its own would convert every model again."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("not an xdist worker (run with -n 2)")
    assert os.environ["DFLAX_TEST_CACHE_OWNER"] != str(os.getpid())


def test_gguf_cache_key_covers_the_conversion_code():
    assert gguf_file.__name__ in gguf_file._CONVERSION_MODULES
    assert "dflax.models.config" in gguf_file._CONVERSION_MODULES


def test_gguf_is_converted_again_when_the_conversion_code_changes(tmp_path, monkeypatch, tiny_checkpoint):
    """Same GGUF file (path, size, mtime), edited conversion source: the warm entry must not be read."""
    config, tensors = read_hf_dir(tiny_checkpoint("llama")[0])
    conversions = []

    def convert(path):
        conversions.append(path)
        return config, tensors

    source = tmp_path / "src" / "conversion_under_test.py"
    source.parent.mkdir()
    source.write_text("ROWS = 'interleaved -> rotate-half'\n")
    monkeypatch.syspath_prepend(str(source.parent))
    monkeypatch.setattr(gguf_file, "_CONVERSION_MODULES", ("conversion_under_test",))
    monkeypatch.setattr(gguf_file, "_dequantize_gguf", convert)
    monkeypatch.setenv("DFLAX_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")

    gguf_file.read_gguf(model)
    _, cached = gguf_file.read_gguf(model)
    assert len(conversions) == 1  # the second load read the cache
    assert sorted(cached) == sorted(tensors)
    source.write_text("ROWS = 'left as stored'\n")  # the converting code changes, the GGUF does not
    gguf_file.read_gguf(model)
    assert len(conversions) == 2
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2


def test_tokenizer_is_converted_again_when_its_code_changes(tmp_path, monkeypatch):
    """The tokenizer conversion cache is keyed on tokenizer.py's source hash the same way."""
    conversions = []
    convert = tokenizer._convert_gguf
    monkeypatch.setattr(tokenizer, "_convert_gguf", lambda path: conversions.append(path) or convert(path))
    path = model_files.smollm2_gguf_path()
    tokenizer.Tokenizer.from_gguf(path, cache_dir=tmp_path)
    tokenizer.Tokenizer.from_gguf(path, cache_dir=tmp_path)
    assert len(conversions) == 1
    monkeypatch.setattr(paths, "source_hash", lambda *modules: "edited-source")
    tokenizer.Tokenizer.from_gguf(path, cache_dir=tmp_path)
    assert len(conversions) == 2


def test_a_first_load_parses_the_gguf_once(tmp_path, monkeypatch):
    """Within one load, weights, tokenizer and compile config of one GGUF share one parse (seconds each:
    ~15 s for Gemma 3's vocabulary); a file edited in place is parsed again, and no reader outlives the load
    (a parsed Gemma 3 reader holds ~700 MB)."""
    import gguf

    from dflax.aot.models import target_config

    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setenv("DFLAX_CACHE", str(tmp_path / "cache"))  # nothing converted: each step reads the file
    path = tmp_path / "model.gguf"
    path.write_bytes(model_files.smollm2_gguf_path().read_bytes())

    with gguf_file.one_parse_per_file():
        config, _ = gguf_file._dequantize_gguf(path)
        tokenizer._convert_gguf(path)
        assert target_config(str(path)) == config
        assert len(parsed) == 1
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
        tokenizer._convert_gguf(path)
        assert len(parsed) == 2
    tokenizer._convert_gguf(path)
    assert len(parsed) == 3
