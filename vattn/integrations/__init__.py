"""Integrations with other libraries (transformers)."""
