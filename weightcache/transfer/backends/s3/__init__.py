"""S3 and S3-compatible stores: the client (boto3 control plane, presigned data plane),
the revision source, the wire formats and SigV4 signing."""
