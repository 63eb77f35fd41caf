"""Datasets of the package's tasks (N-way parallel text and image-feature sources)."""
