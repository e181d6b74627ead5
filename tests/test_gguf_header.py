"""The scalar metadata at the head of a GGUF file, read without loading it (the model's
family, which llama-server does not report): checked against the real SmolLM2 GGUF and
against files built here, byte by byte."""

from __future__ import annotations

import struct

import pytest

from kvstream.backends.llamacpp.gguf_header import read_gguf_metadata


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _gguf(entries: list[bytes], version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(entries)) + b"".join(entries)


def test_the_real_models_architecture_and_context():
    from tests.conftest import smollm2_gguf

    found = read_gguf_metadata(smollm2_gguf(), {"general.architecture", "llama.context_length"})
    assert found == {"general.architecture": "llama", "llama.context_length": 8192}


def test_arrays_before_the_wanted_key_are_skipped_and_reading_stops_once_found(tmp_path):
    path = tmp_path / "m.gguf"
    strings = _string("tokens") + struct.pack("<IIQ", 9, 8, 2) + _string("a") + _string("bc")
    floats = _string("scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 1, 2, 3)
    arch = _string("general.architecture") + struct.pack("<I", 8) + _string("qwen2")
    count = _string("qwen2.block_count") + struct.pack("<II", 4, 28)
    path.write_bytes(_gguf([strings, floats, arch, count]) + b"\xff" * 3)  # garbage after: never read
    assert read_gguf_metadata(path, {"general.architecture"}) == {"general.architecture": "qwen2"}
    assert read_gguf_metadata(path, {"general.architecture", "qwen2.block_count"}) == {
        "general.architecture": "qwen2", "qwen2.block_count": 28}
    assert read_gguf_metadata(path, {"absent"}) == {}


@pytest.mark.parametrize("content", [b"", b"GGML" + bytes(20), _gguf([], version=1),
                                     _gguf([_string("k") + struct.pack("<I", 99)]),
                                     _gguf([_string("k") + struct.pack("<I", 8)])])
def test_what_is_not_a_readable_gguf_header_is_a_value_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError):
        read_gguf_metadata(path, {"k", "general.architecture"})
