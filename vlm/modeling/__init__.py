"""The model alone: no ranks, no files, no logging."""
