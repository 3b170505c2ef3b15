"""The cache on disk (design §3): paths, manifests, blobs and revisions, the index, the
eviction plan. No network: imports only config and errors from the package."""
