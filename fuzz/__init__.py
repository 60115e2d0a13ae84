"""Fuzzing for the parsers that read bytes from a shared bucket (issue 22); see fuzz/README.md.

``python -m fuzz`` (``make fuzz``) runs every target and prints its figures.
"""
