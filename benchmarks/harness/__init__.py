"""Harnesses: runs that exercise the pipeline rather than time it (random faults until a stage ends
as a clean run; the prepared run on a lent GPU and the files carried to it)."""
