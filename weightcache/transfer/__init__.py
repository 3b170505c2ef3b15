"""The data plane (design §4): blob sources and their protocol (sources.py, httprange.py),
the S3 client, the ranged downloader with its partial files, part state and pacing. Knows
nothing of the cache layout or of the daemon."""
