"""Experts streamed from the checkpoint on disk (issue 29)."""
