"""Checkpoints: local.py (atomic folders, exact resume), resume.py (which checkpoint
--output.resume means, and whether this run may resume it), sharded.py (FSDP2 / DeepSpeed
engines)."""
