"""The Hugging Face Hub: the revision source and the parsing of the Hub's listings."""
