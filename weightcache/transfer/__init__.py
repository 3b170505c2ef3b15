"""The data plane to the object store (design §4): the S3 client, the ranged downloader,
its part state and pacing. Knows nothing of the cache layout or of the daemon."""
