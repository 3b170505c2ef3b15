"""The stores a revision comes from (design §4, Revision sources), one package or module
each, none importing another: s3, gcs, azure, hub (Hugging Face), http and file."""
