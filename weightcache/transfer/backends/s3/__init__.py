"""S3 and S3-compatible stores: the client (control plane, presigned data plane) and its
two transports (SigV4-signed and boto3), the revision source, the wire formats and SigV4
signing."""
