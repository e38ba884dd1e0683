"""Attention backends over the page-major KV pool."""
