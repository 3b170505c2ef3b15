"""The swarm (design §8): nodes download a blob piece by piece from each other and the
store at once. Pure choice at the bottom (bitsets, pieces, choice), the peer protocol on
the wire (wire), what this node sees of its peers and the store (views, pace, storegate),
the download (download), the peers (discovery, client), the peers' server (server) and the
entry point the fetch layer calls (entry)."""
