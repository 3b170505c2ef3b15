"""The peer protocol on the wire (design §8, Peers): its one path, the headers a peer
advertises its pieces with, the request headers, and `parse_view`, which reads a
peer's advertisement as a `PeerView`. Nothing a peer sends is trusted."""

from __future__ import annotations

import re
from collections.abc import Mapping

from weightcache.config import format_hostport
from weightcache.swarm.choice import PeerView
from weightcache.swarm.pieces import Bitmap, BitmapError, piece_count, piece_ranges

#: The peer protocol's one path, and the reasons its server refuses a request (metric labels).
BLOB_PATH = re.compile(r"/blobs/sha256/([0-9a-f]{64})")
REFUSAL_REASONS = ("no_token", "bad_token", "bad_path", "not_found", "bad_range", "not_held",
                   "method", "busy")  # fmt: skip
#: Response headers advertising the pieces held (`all`, or a `pieces.Bitmap` with the piece
#: size), those in flight and those of them streamed from the store as they arrive (same
#: piece size), the uploads being served; the request header asking for held (or streamed)
#: pieces only (design §8, Peers: requests).
PIECES, PIECE_SIZE, FETCHING, LOAD = ("X-Weightcache-Pieces", "X-Weightcache-Piece-Size",
                                      "X-Weightcache-Fetching", "X-Weightcache-Load")  # fmt: skip
STREAMING = "X-Weightcache-Streaming"
HELD_ONLY = "X-Weightcache-Held-Only"


def regrid(theirs: Bitmap, their_size: int, our_size: int, size: int) -> Bitmap:
    """A bitmap of pieces of `their_size` bytes as one of `our_size` pieces: ours is held
    when every byte of it is in one of theirs."""
    bits = 0
    for j, (a, b) in enumerate(piece_ranges(size, our_size)):
        first, last = a // their_size, (b - 1) // their_size
        mask = ((1 << (last + 1)) - 1) ^ ((1 << first) - 1)
        if theirs.bits & mask == mask:
            bits |= 1 << j
    return Bitmap(piece_count(size, our_size), bits)


def parse_view(url: str, headers: Mapping[str, str], size: int, piece_size: int) -> PeerView:
    """A peer's view of a `size`-byte blob in pieces of `piece_size`, from its response
    headers; nothing held if it advertises nothing. Raises ValueError (BitmapError) for
    headers that do not parse."""
    count = piece_count(size, piece_size)
    empty = Bitmap(count)
    pieces = headers.get(PIECES)
    if pieces is None:
        return PeerView(url, empty, empty)
    load = int(headers.get(LOAD, "0"))
    if load < 0:  # a peer claiming less than idle would draw every request to itself
        raise BitmapError(f"load {load} from {url}")
    if pieces == "all":
        return PeerView(url, Bitmap.full(count), empty, load)
    theirs = int(headers.get(PIECE_SIZE, "0"))
    if theirs < 4096:
        raise BitmapError(f"piece size {theirs} from {url}")
    have = regrid(Bitmap.decode(piece_count(size, theirs), pieces), theirs, piece_size, size)
    fetching, streaming = empty, None
    if FETCHING in headers and theirs == piece_size:
        fetching = Bitmap.decode(count, headers[FETCHING])
    if STREAMING in headers and theirs == piece_size:
        streaming = Bitmap.decode(count, headers[STREAMING])
    return PeerView(url, have, fetching, load, streaming)


def peer_url(host: str, port: int) -> str:
    return "http://" + format_hostport(host, port)


#: The request header naming the asking peer's URL, so that a node downloading a blob
#: learns of a newcomer at its first HEAD, before the newcomer claims anything.
ASKER = "X-Weightcache-Peer"
