"""The data plane (design §4): blob sources and their protocol (sources.py), the
shared HTTP range client (httpclient.py), the ranged downloader (downloader.py) with
its partial files, part state and pacing, and the stores' backends (backends/). Knows
nothing of the cache layout or of the daemon."""
