"""Request bodies (api/body.py): what each encoding inflates to, and every way one is refused."""

from __future__ import annotations

import gzip
import zlib

import pytest

from kvstream.api.body import inflate
from kvstream.api.errors import APIError

DATA = b'{"messages": []}' * 100


@pytest.mark.parametrize(
    "encoding, packed",
    [
        ("identity", DATA),
        ("gzip", gzip.compress(DATA)),
        ("x-gzip", gzip.compress(DATA)),
        ("deflate", zlib.compress(DATA)),  # zlib framing, as RFC 9110 means it
        ("deflate", zlib.compress(DATA)[2:-4]),  # raw deflate, as some clients send it
    ],
    ids=["identity", "gzip", "x-gzip", "deflate-zlib", "deflate-raw"],
)
def test_each_encoding_inflates_to_the_body(encoding, packed):
    assert inflate(packed, encoding, 1 << 20) == DATA


@pytest.mark.parametrize(
    "encoding, packed, status",
    [
        ("gzip", gzip.compress(DATA)[:-12], 400),  # cut short
        ("gzip", b"not gzip at all", 400),
        ("deflate", b"\x00\x01garbage", 400),
        ("gzip", gzip.compress(b"\0" * (1 << 21)), 413),  # inflates past the limit
        ("br", b"\x0b\x02\x80hi\x03", 415),
    ],
    ids=["truncated", "not-gzip", "not-deflate", "past-the-limit", "unsupported"],
)
def test_bodies_that_cannot_be_read_are_refused(encoding, packed, status):
    with pytest.raises(APIError) as err:
        inflate(packed, encoding, 1 << 20)
    assert err.value.status == status
