"""Kept for tools that call ``setup.py``: the metadata is in ``pyproject.toml``."""
from setuptools import setup

setup()
